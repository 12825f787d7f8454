"""The Speculative page's drafter choices, named for what they are.

`DRAFTERS` maps each UI choice to the engine's SpeculativeConfig: n-gram prompt lookup, the
target's own early-exit self-draft, its dynamic-int8 copy, and a separate draft model given by
a path or hub id ("tiny" — kvscope's 2-layer random model with the same tokenizer — is offered
offline as an honestly poor drafter).
"""

from __future__ import annotations

from engine.config import SpeculativeConfig

K_MAX = 16
POOR_DRAFTER = "tiny"
DRAFTERS = {  # label -> (method, help)
    "n-gram (prompt lookup)": (
        "ngram",
        "the draft is what followed the last few tokens earlier in the context, as many tokens as "
        "that match is long plus one (up to k): free to compute, strong when the answer repeats or "
        "edits the prompt",
    ),
    "self-draft: early exit": (
        "self_draft_exit",
        "the target itself, stopped after its first layers (set below): cheap but often wrong",
    ),
    "self-draft: int8 copy": (
        "self_draft_int8",
        "a dynamic-int8 copy of the target drafts for it: close guesses, cheaper matmuls on CPU",
    ),
    "draft model": (
        "draft_model",
        "a separate model with the same tokenizer (a path or hub id); 'tiny' is a "
        "2-layer random model, offline: a poor drafter on purpose",
    ),
}


# The Speculative page's default prompt (scripts/spec_page_speedup.py measures it the page's way): an
# edit whose answer is mostly the prompt's own text, the case prompt lookup exists for. The default
# model answers with the paragraph, "evenning" corrected (56 tokens, greedy): the n-gram drafts are
# accepted run after run and one is rejected at the fix. The one-sentence prompt before drew a
# 10-token answer ("The quick brown dog jumps over lazy dog."), too short for drafting to pay.
EXAMPLE_PROMPT = (
    "Fix the spelling mistakes in this paragraph and return the whole corrected paragraph: "
    "The quick brown cat jumps over the lazy fox. Every morning the cat walks to the river, drinks the "
    "cold water, and watches the boats go by. In the evenning the cat comes back home, sits by the "
    "fire, and sleeps until the sun rises again."
)


def drafter_config(
    label: str, k: int, *, exit_layers: int = 1, draft_model: str = "", fallback: bool = True
) -> SpeculativeConfig:
    """The SpeculativeConfig for a UI choice; ValueError (field named) for a bad one."""
    if label not in DRAFTERS:
        raise ValueError(f"drafter must be one of {list(DRAFTERS)}")
    if not isinstance(k, int) or not 1 <= k <= K_MAX:
        raise ValueError(f"k must be an integer in [1, {K_MAX}]")
    method = DRAFTERS[label][0]
    kw = dict(num_speculative_tokens=k, enable_fallback=fallback)
    if method == "ngram":
        return SpeculativeConfig(method="ngram", **kw)
    if method == "self_draft_exit":
        return SpeculativeConfig(method="self_draft", draft_layers=int(exit_layers), **kw)
    if method == "self_draft_int8":
        return SpeculativeConfig(method="self_draft", draft_quantize="int8", **kw)
    name = (draft_model or "").strip()
    if not name:
        raise ValueError("draft model: give a local path or hub id (or 'tiny' for the offline poor drafter)")
    return SpeculativeConfig(method="draft_model", draft_model=name, **kw)


def label_of(cfg: SpeculativeConfig | None) -> str:
    """The UI label of an engine's current drafter (n-gram when none)."""
    if cfg is None or cfg.method == "ngram":
        return "n-gram (prompt lookup)"
    if cfg.method == "draft_model":
        return "draft model"
    return "self-draft: int8 copy" if cfg.draft_quantize == "int8" else "self-draft: early exit"
