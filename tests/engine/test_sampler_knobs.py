"""Sampler knobs (presence / frequency / repetition penalties, logit_bias, min_p) against references:
transformers' RepetitionPenaltyLogitsProcessor and MinPLogitsWarper, and the OpenAI / vLLM formula
for presence / frequency / logit_bias. Greedy + a penalty through the engine is the argmax of the
reference-penalised logits of the HF model, token for token; speculation leaves such requests on
plain decode steps (exact)."""

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from engine.core.sampler import probs, process
from engine.core.stops import find_stop_string
from engine.observe import trace_events as ev
from tests.engine.engines import one_output, run_to_end, tiny_engine

V = 50


def logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def ref_presence_frequency(x: torch.Tensor, out_ids: list[int], pres: float, freq: float) -> torch.Tensor:
    y = x.clone()
    for t in set(out_ids):
        y[t] -= freq * out_ids.count(t) + pres  # OpenAI: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres
    return y


@pytest.mark.parametrize("rp", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(rp):
    x = logits(1)
    prompt, out = [3, 7, 7, 11], [7, 20, 3, 41]
    ref = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([prompt + out]), x[None].clone())[0]
    got = process(x, SamplingParams(repetition_penalty=rp), prompt, out)
    assert torch.allclose(got, ref, atol=0, rtol=1e-6)
    untouched = [t for t in range(V) if t not in prompt + out]
    assert torch.equal(got[untouched], x[untouched])


@pytest.mark.parametrize("pres,freq", [(0.5, 0.0), (0.0, 0.7), (-1.0, 2.0), (2.0, -2.0)])
def test_presence_frequency_match_the_openai_formula_over_generated_tokens_only(pres, freq):
    x = logits(2)
    prompt, out = [1, 2, 3], [5, 5, 5, 9, 2]
    got = process(x, SamplingParams(presence_penalty=pres, frequency_penalty=freq), prompt, out)
    assert torch.allclose(got, ref_presence_frequency(x, out, pres, freq), atol=1e-6)
    assert got[1] == x[1] and got[3] == x[3]  # prompt-only tokens are not penalised


def test_logit_bias_adds_per_token_and_combines_in_vllm_order():
    x = logits(3)
    bias = {4: 100.0, 9: -100.0, 0: 2.5}
    got = process(x, SamplingParams(logit_bias=bias), [], [])
    ref = x.clone()
    for t, b in bias.items():
        ref[t] += b
    assert torch.equal(got, ref)
    assert int(got.argmax()) == 4
    # bias first, then repetition, then presence (vLLM's order)
    p = SamplingParams(logit_bias={4: 5.0}, repetition_penalty=1.5, presence_penalty=0.25)
    ref = x.clone()
    ref[4] += 5.0
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[4, 8]]), ref[None])[0]
    ref = ref_presence_frequency(ref, [8], 0.25, 0.0)
    assert torch.allclose(process(x, p, [4], [8]), ref, atol=1e-6)


@pytest.mark.parametrize("min_p,temp", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_matches_transformers(min_p, temp):
    x = logits(4)
    ref = MinPLogitsWarper(min_p)(None, (x / temp)[None])[0]
    ref_p = torch.softmax(ref, dim=-1)
    got = probs(x, SamplingParams(temperature=temp, min_p=min_p))
    assert torch.allclose(got, ref_p, atol=1e-6)
    assert (got > 0).sum() < V


def test_neutral_knobs_are_no_processors_and_leave_probs_unchanged():
    assert not SamplingParams().has_logits_processors
    assert not SamplingParams(logit_bias={}, presence_penalty=0.0, repetition_penalty=1.0).has_logits_processors
    assert SamplingParams(min_p=0.1).has_logits_processors
    x = logits(5)
    assert torch.equal(probs(x, SamplingParams(temperature=0.8)), probs(x, SamplingParams(temperature=0.8, min_p=0)))


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={3: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"3": 1}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ],
)
def test_bad_knobs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


# ---- through the engine (tiny random model, fp32)


def engine_tokens(eng: LLMEngine, prompt: str, params: SamplingParams) -> tuple[list[int], list[int]]:
    (out,) = run_to_end(eng, [prompt], params, check=False).values()
    assert out.error is None
    return list(out.prompt_token_ids), out.outputs[0].token_ids


def reference_greedy(model, prompt_ids: list[int], params: SamplingParams, n: int) -> list[int]:
    """HF forward over the whole sequence each step; transformers' repetition processor and the
    OpenAI formula for presence / frequency / logit_bias; argmax."""
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            x = model(torch.tensor([ids])).logits[0, -1].float()
            for t, b in (params.logit_bias or {}).items():
                x[t] += b
            if params.repetition_penalty != 1.0:
                x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([ids]), x[None])[0]
            x = ref_presence_frequency(x, out, params.presence_penalty, params.frequency_penalty)
            tok = int(x.argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine()


# the random model never repeats on its own: penalties < neutral (which reward repeats) change its output
KNOBS = [
    dict(repetition_penalty=0.5),
    dict(presence_penalty=-2.0, frequency_penalty=-0.5),
    dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=0.5, logit_bias={17: 0.5}),
]


@pytest.mark.parametrize("knobs", KNOBS)
def test_greedy_with_penalties_is_the_reference_argmax(tiny, knobs):
    params = SamplingParams(max_tokens=16, ignore_eos=True, **knobs)
    prompt_ids, got = engine_tokens(tiny, "a b a b a b a b", params)
    assert got == reference_greedy(tiny.model, prompt_ids, params, 16)
    _, again = engine_tokens(tiny, "a b a b a b a b", params)
    assert again == got  # deterministic
    _, plain = engine_tokens(tiny, "a b a b a b a b", SamplingParams(max_tokens=16, ignore_eos=True))
    assert plain != got  # the knob changed something (the test has power)


def test_logit_bias_forces_a_token_and_out_of_vocab_is_refused(tiny):
    params = SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={42: 100.0})
    assert engine_tokens(tiny, "hello", params)[1] == [42] * 5
    with pytest.raises(ValueError, match="logit_bias: token id"):
        tiny.add_request(None, "hello", SamplingParams(logit_bias={tiny.vocab_size: 1.0}))


def test_speculative_engine_runs_penalised_requests_on_plain_steps_exactly(tiny):
    sc = SpeculativeConfig(method="self_draft", draft_layers=1, num_speculative_tokens=4)
    spec = LLMEngine(EngineConfig(model="tiny", num_threads=1, speculative=sc))
    for knobs in KNOBS:
        params = SamplingParams(max_tokens=16, ignore_eos=True, **knobs)
        _, plain = engine_tokens(tiny, "a b a b a b a b", params)
        _, got = engine_tokens(spec, "a b a b a b a b", params)
        assert got == plain
    assert not spec.events.since(0, kinds=[ev.SPEC_VERIFY])  # never verified with drafts
    engine_tokens(spec, "a b a b a b a b", SamplingParams(max_tokens=16, ignore_eos=True))
    assert spec.events.since(0, kinds=[ev.SPEC_VERIFY])  # a plain request is speculated (the test has power)


# ---- include_stop_str_in_output


def test_find_stop_string_cuts_before_or_after():
    assert find_stop_string("hello world, bye", ["xyz", "world"], False) == ("hello ", "world")
    assert find_stop_string("hello world, bye", ["xyz", "world"], True) == ("hello world", "world")
    assert find_stop_string("hello", ["xyz"], True) is None


def run_text(eng: LLMEngine, prompt: str, params: SamplingParams):
    return one_output(eng, prompt, params)


def test_include_stop_str_in_output_keeps_the_stop_string(tiny):
    full = run_text(tiny, "Once upon a time", SamplingParams(max_tokens=16, ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.index(stop)
    out = run_text(tiny, "Once upon a time", SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    kept_params = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    kept = run_text(tiny, "Once upon a time", kept_params)
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:cut], "stop", stop)
    assert (kept.text, kept.finish_reason, kept.stop_reason) == (full[: cut + len(stop)], "stop", stop)
    assert kept.token_ids == out.token_ids
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)
