"""The Speculative page's drafter choices, named for what they are, and its KV bar.

`DRAFTERS` maps each UI choice to the engine's SpeculativeConfig: n-gram prompt lookup, the
target's own early-exit self-draft, its dynamic-int8 copy, and a separate draft model given by
a path or hub id ("tiny" — kvscope's 2-layer random model with the same tokenizer — is offered
offline as an honestly poor drafter). `kv_bar_html` draws blocks used / budget from a Snapshot.
"""

from __future__ import annotations

import html

from engine.config import SpeculativeConfig

K_MAX = 16
POOR_DRAFTER = "tiny"
DRAFTERS = {  # label -> (method, help)
    "n-gram (prompt lookup)": (
        "ngram",
        "the draft is what followed the last few tokens earlier in the context: "
        "free to compute, strong when the answer repeats or edits the prompt",
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


def kv_bar_html(snap) -> str:
    """KV blocks used (and cached-free) against the budget, as one bar with the numbers in words."""
    m, info = snap.metrics, snap.info
    n = max(1, info.num_blocks)
    used, cached = m.num_blocks_used, m.num_blocks_cached
    pu, pc = 100 * used / n, 100 * cached / n
    text = (
        f"KV: {used} of {info.num_blocks} blocks used ({used * info.bytes_per_block / 2**20:,.2f} of "
        f"{info.num_blocks * info.bytes_per_block / 2**20:,.2f} MiB), {cached} cached-free"
    )
    return (
        '<div class="kvscope-kvbar" style="font-size:0.85rem">'
        '<div style="display:flex;height:14px;border:1px solid #888;border-radius:3px;overflow:hidden">'
        f'<div style="width:{pu:.2f}%;background:#0072B2"></div>'
        f'<div style="width:{pc:.2f}%;background:#BDBDBD"></div></div>'
        f"<div>{html.escape(text)}</div></div>"
    )


# --------------------------------------------------------------------------- the tick timeline


def tick_steps(req) -> list[int]:
    """The engine steps at which the request's tokens or KV changed (its history points and the
    steps its tokens were produced), sorted: the positions of the timeline slider."""
    return sorted({p.step for p in req.history} | {t.step for t in req.tokens})


def at_tick(req, step: int) -> tuple[tuple, object | None]:
    """(tokens produced up to `step`, the request's last history point at or before it)."""
    toks = tuple(t for t in req.tokens if t.step <= step)
    point = None
    for p in req.history:
        if p.step <= step:
            point = p
    return toks, point


def tick_caption(req, step: int, bytes_per_block: int) -> str:
    toks, p = at_tick(req, step)
    kinds = {}
    for t in toks:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    made = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none yet"
    if p is None:
        return f"Step {step}: not admitted yet. Tokens so far: {made}."
    return (
        f"Step {step}: {p.phase}, {p.num_cached_tokens} tokens' K/V in {p.num_blocks} block(s) "
        f"({p.num_blocks * bytes_per_block:,} bytes of blocks). Tokens so far: {made}."
    )
