"""Page experiments on private engines: they share the loaded weights with the shared engine
(no second copy) and never touch the shared engine's pool; the speculative comparison is
controlled (engine/lab/ab_timing.py)."""

from __future__ import annotations

import pytest

from engine import EngineThread, LLMEngine
from engine.config import EngineConfig, SamplingParams, SpeculativeConfig
from engine.lab.experiments import compare_speculative, private_engine

BASE = EngineConfig(
    model="tiny",
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=256,
    seed=0,
    num_threads=1,
)


def test_private_engine_shares_weight_tensors():
    shared = LLMEngine(BASE)
    priv = private_engine(BASE, num_kv_blocks=16, speculative=SpeculativeConfig(method="ngram"))
    assert priv.model is shared.model
    for (n1, p1), (n2, p2) in zip(shared.model.named_parameters(), priv.model.named_parameters()):
        assert n1 == n2 and p1.data_ptr() == p2.data_ptr()
    # the packed copies of the Linear weights (CPU fast path) are per model object: the same pack
    assert priv.runner.linear_pack is shared.runner.linear_pack
    # its own pool: the KV tensors are not the shared engine's
    assert priv.runner is not shared.runner and priv.bm is not shared.bm


@pytest.mark.parametrize("method", ["ngram"])
def test_compare_speculative_leaves_shared_engine_alone(method):
    th = EngineThread(LLMEngine(BASE))
    try:
        h = th.submit([5, 6, 7, 8] * 4, SamplingParams(max_tokens=40, ignore_eos=True), request_id="other")
        step0 = th.engine.step_num
        res = compare_speculative(
            BASE,
            [11, 12, 13, 14] * 6,
            SpeculativeConfig(method=method, num_speculative_tokens=3, enable_fallback=False),
            16,
            busy=lambda: th.engine.step_num,
            busy_what="shared-engine steps",
            chat=False,
        )
        out = h.result(timeout=120)
        assert out.finished and out.outputs[0].finish_reason == "length"  # not aborted
        assert len(out.outputs[0].token_ids) == 40
        c = res.comparison
        assert c.rounds >= 3 and [s for _, s in c.order[:4]] == ["plain", "spec", "spec", "plain"]
        assert res.outputs_match  # greedy: speculation does not change the tokens
        assert res.spec.output_len == res.plain.output_len == 16
        assert res.tokens_per_target_pass is not None and res.tokens_per_target_pass >= 1.0
        # the shared engine kept stepping on its own request while we measured: contended only if it
        # stepped during a sample; the counter is the engine's own step number
        assert c.busy_what == "shared-engine steps"
        assert (th.engine.step_num > step0) or not c.contended
    finally:
        th.shutdown()


def test_compare_cache_vs_nocache_alternates_and_returns_median_round():
    from engine.lab.experiments import compare_cache_vs_nocache

    res = compare_cache_vs_nocache(BASE, 6, 8)
    c = res["comparison"]
    assert c.names == ("nocache", "cache") and c.rounds == 3
    assert [s for _, s in c.order] == ["nocache", "cache", "cache", "nocache", "nocache", "cache"]
    for key in ("cache", "nocache"):
        pre, pts = res[key]
        assert len(pts) == 5  # 6 tokens: 1 from the prefill step + 5 decode steps
    # the engine's own events: 1 token fed per decode step with the cache, the whole context without
    assert [p.fed_tokens for p in res["cache"][1]] == [1] * 5
    assert [p.fed_tokens for p in res["nocache"][1]] == [p.context_len - 1 for p in res["nocache"][1]]
    assert not c.contended  # no busy counter given: nothing to flag
