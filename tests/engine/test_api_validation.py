"""The Python API's validation, as the OpenAI server relies on it: prompts that are neither text
nor token ids, max_tokens past the context (vLLM's message), vLLM's speculative_config dict,
SamplingParams.min_tokens (EOS / stop ids masked until reached) and logprobs."""

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpeculativeConfig

TINY = {"model": "tiny", "device": "cpu", "num_kv_blocks": 64, "block_size": 8, "max_model_len": 128, "num_threads": 1}


@pytest.fixture(scope="module")
def llm():
    return LLM(**TINY)


@pytest.mark.parametrize("prompt", [42, 4.2, None, {"text": "x"}, [1, "a"], [True, 2], [[1, 2], 3]])
def test_prompt_neither_text_nor_token_ids_is_rejected(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        llm.generate([1, 49152], SamplingParams(max_tokens=2))


def test_max_tokens_past_the_context_is_rejected_with_vllms_message(llm):
    ids = list(range(100, 120))  # 20 tokens
    with pytest.raises(
        ValueError,
        match=r"^This model's maximum context length is 128 tokens\. However, you "
        r"requested 129 tokens \(20 in the prompt, 109 in the completion\)",
    ):
        llm.generate(ids, SamplingParams(max_tokens=109))
    out = llm.generate(ids, SamplingParams(max_tokens=108, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 108 and out.outputs[0].finish_reason == "length"


def test_speculative_config_dict_as_vllm_spells_it():
    c = EngineConfig(
        model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert c.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert c.speculative_config is None and c.replace(seed=1).speculative == c.speculative
    d = EngineConfig(model="tiny", speculative_config={"model": "some/draft", "num_speculative_tokens": 2})
    assert d.speculative.method == "draft_model" and d.speculative.draft_model == "some/draft"
    with pytest.raises(ValueError, match=r"speculative_config\.method must be one of .*got 'eagle'"):
        EngineConfig(model="tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        EngineConfig(model="tiny", speculative_config={"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="tiny", speculative=SpeculativeConfig(), speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        EngineConfig(model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 99})
    with pytest.raises(ValueError, match=r"prompt_lookup_match_bound must be true or false, got 'yes'"):
        EngineConfig(model="tiny", speculative_config={"method": "ngram", "prompt_lookup_match_bound": "yes"})


def test_llm_accepts_speculative_config(llm):
    spec = LLM(**TINY, speculative_config={"method": "self_draft", "draft_layers": 1, "num_speculative_tokens": 2})
    plain = llm.generate("speculation keeps greedy output", SamplingParams(temperature=0, max_tokens=10))[0]
    out = spec.generate("speculation keeps greedy output", SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.engine.spec.metrics().num_drafts > 0


def test_min_tokens_masks_stop_ids_until_reached(llm):
    base = llm.generate("min tokens", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    stop = [base[0], base[1]]
    out = llm.generate("min tokens", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=stop))[0]
    assert out.outputs[0].token_ids == base[:1] and out.outputs[0].finish_reason == "stop"
    out = llm.generate("min tokens", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=stop, min_tokens=4))[
        0
    ].outputs[0]
    assert len(out.token_ids) >= 4 and not set(out.token_ids[:4]) & set(stop)
    # EOS too (as vLLM: masked unless ignore_eos), sampling as well as greedy
    eos = next(iter(llm.engine.eos_ids))
    out = llm.generate(
        "min tokens", SamplingParams(temperature=1.0, seed=3, max_tokens=5, min_tokens=5, stop_token_ids=[eos])
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and eos not in out.token_ids


def test_min_tokens_checks():
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


def test_logprobs_of_each_token(llm):
    out = llm.generate("logprobs", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and top[0][0] == tok and top[0][1] == pytest.approx(lp) and lp <= 0
    assert llm.generate("logprobs", SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
