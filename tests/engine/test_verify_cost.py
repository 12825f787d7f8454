"""engine/speculative/verify_cost.py: the engine's own target pass over k+1 rows vs 1 row, the one
home the Claims row, `bench speculative` and the speculative decoder's calibration time. Checked:
what it returns, and that the lent blocks leave the pool as it was (free count and order)."""

from __future__ import annotations

import pytest

from engine.core.llm import LLM
from engine.speculative import verify_cost


@pytest.fixture(scope="module")
def tiny_engine():
    llm = LLM(model="tiny", num_threads=1, num_kv_blocks=64, block_size=16)
    yield llm.engine


def test_ratios_for_each_k_and_the_pool_ends_as_it_began(tiny_engine):
    eng = tiny_engine
    free_before = eng.bm.free_block_ids()
    out = verify_cost.engine_verify_cost_ratios(eng, ks=(1, 4, 8), context=40, reps=2)
    assert set(out) == {
        "verify_pass_1_ms",
        "verify_context",
        "verify_cost_ratio_k1",
        "verify_cost_ratio_k4",
        "verify_cost_ratio_k8",
    }
    assert out["verify_context"] == 40 and out["verify_pass_1_ms"] > 0
    assert all(out[f"verify_cost_ratio_k{k}"] > 0 for k in (1, 4, 8))
    assert eng.bm.free_block_ids() == free_before
    assert eng.bm.is_empty


def test_each_row_count_is_timed_every_round(tiny_engine):
    times = verify_cost.time_target_passes(tiny_engine.runner, tiny_engine.bm, (5, 1, 5), context=8, reps=3)
    assert sorted(times) == [1, 5] and all(len(ts) == 3 for ts in times.values())


def test_a_pool_too_small_is_refused_with_the_counts(tiny_engine):
    bm = tiny_engine.bm
    with pytest.raises(ValueError, match="free KV blocks needed"):
        verify_cost.time_target_passes(tiny_engine.runner, bm, (1, 9), context=bm.block_size * (bm.num_free_blocks + 1))
    assert bm.is_empty
    with pytest.raises(ValueError, match="rows must be"):
        verify_cost.time_target_passes(tiny_engine.runner, bm, (0,), context=8)
