"""engine/lab/side_channel.py: the probe design (which probes can hit, exactly), the alternation,
and the attacker's threshold rule. Timings themselves are not asserted (wall clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import EngineConfig, EngineThread, LLMEngine
from engine.lab import side_channel as sc


@pytest.fixture(scope="module")
def th():
    t = EngineThread(LLMEngine(EngineConfig(model="tiny", block_size=4, num_kv_blocks=128)))
    yield t
    t.shutdown()


def test_shared_probes_hit_the_victims_blocks_salted_never(th):
    seen = []
    probes = sc.measure(th, prefix_tokens=34, rounds=3, on_probe=lambda p, i, n: seen.append((i, n)))
    assert seen == [(i, 12) for i in range(1, 13)]
    assert len(probes) == 12
    for r in range(3):
        assert [(p.mode, p.cached) for p in probes if p.round == r] == sc.cell_order(r)
    for p in probes:
        # prefix rounded down to whole blocks (32 tokens); the probe adds 3 tokens of its own
        assert p.hit_tokens == (32 if (p.mode == "shared" and p.cached) else 0)
        assert p.ttft_s > 0
    assert sc.hit_rate(probes, "shared", 32) == 1.0 and sc.hit_rate(probes, "salted", 32) == 0.0
    th.engine.check_invariants()


def test_bad_arguments_name_the_limit(th):
    with pytest.raises(ValueError, match="rounds must be an integer in \\[1, 64\\]"):
        sc.measure(th, prefix_tokens=32, rounds=0)
    with pytest.raises(ValueError, match="prefix_tokens must be an integer in \\[4, 4096\\]"):
        sc.measure(th, prefix_tokens=2, rounds=1)


def test_cells_alternate_and_every_cell_runs_each_round():
    assert sc.cell_order(0) == [("shared", True), ("shared", False), ("salted", True), ("salted", False)]
    assert sc.cell_order(1) == sc.cell_order(0)[::-1]


def _p(mode, cached, t):
    return sc.Probe(mode, cached, t, 0, False, 0)


def test_threshold_rule_and_accuracy():
    probes = [
        _p("shared", True, 0.01),
        _p("shared", True, 0.02),
        _p("shared", False, 0.09),
        _p("shared", False, 0.10),
        _p("salted", True, 0.09),
        _p("salted", False, 0.095),
        _p("salted", True, 0.10),
        _p("salted", False, 0.01),
    ]
    thr = sc.threshold(probes)
    assert thr == pytest.approx((0.015 + 0.095) / 2)
    assert sc.accuracy(probes, "shared", thr) == 1.0
    assert sc.accuracy(probes, "salted", thr) == 0.25
    assert sc.threshold([_p("shared", True, 0.1)]) is None


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40))
def test_spread_orders_its_numbers(vals):
    s = sc.spread(vals)
    assert s.lo <= s.q1 <= s.median <= s.q3 <= s.hi and s.n == len(vals)
    assert (s.lo, s.hi) == (min(vals), max(vals))


def test_probed_prefix_is_whole_blocks():
    assert [sc.probed_prefix_tokens(n, 16) for n in (16, 17, 31, 32, 250)] == [16, 16, 16, 32, 240]
