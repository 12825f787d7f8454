"""engine/lab/ab_timing.py: alternation order, spread, contention flag, suspect rule, round budget."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.lab import ab_timing as M


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_order_alternates_sides_and_first_side():
    assert M.order(3, ("plain", "spec")) == [
        (0, "plain"),
        (0, "spec"),
        (1, "spec"),
        (1, "plain"),
        (2, "plain"),
        (2, "spec"),
    ]


@given(st.integers(1, 40))
def test_order_each_round_runs_both_sides_once(rounds):
    seq = M.order(rounds)
    assert len(seq) == 2 * rounds
    for r in range(rounds):
        pair = [s for rr, s in seq if rr == r]
        assert sorted(pair) == ["a", "b"]
        assert pair[0] == ("a" if r % 2 == 0 else "b")


def test_compare_runs_in_order_and_passes_round():
    calls = []
    clock = FakeClock()

    def side(name, secs):
        def run(r):
            calls.append((r, name))
            clock.t += secs
            return secs

        return run

    c = M.compare(side("plain", 2.0), side("spec", 1.0), names=("plain", "spec"), clock=clock)
    assert calls == M.order(3, ("plain", "spec"))
    assert list(c.order) == calls
    assert c.rounds == 3
    assert c.ratio.median == 2.0 and c.a.median == 2.0 and c.b.median == 1.0
    assert not c.contended and c.result == 2.0
    assert "median of 3 rounds" in c.conditions() and "contention not checked" in c.conditions()
    quiet = M.compare(side("plain", 2.0), side("spec", 1.0), busy=lambda: 0, clock=clock)
    assert "uncontended" in quiet.conditions()


@given(st.lists(st.floats(0.001, 1000.0), min_size=1, max_size=30))
def test_spread_matches_statistics(vals):
    s = M.spread(vals)
    assert s.n == len(vals)
    assert s.lo == min(vals) and s.hi == max(vals)
    assert s.median == pytest.approx(statistics.median(vals))
    assert s.lo <= s.q1 <= s.median <= s.q3 <= s.hi
    assert s.iqr >= 0


def test_spread_known_values_and_bad_input():
    s = M.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.lo, s.hi, s.q1, s.q3) == (3.0, 1.0, 5.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="at least one"):
        M.spread([])
    with pytest.raises(ValueError, match="finite"):
        M.spread([1.0, float("nan")])


def test_contention_flag_counts_rounds_where_the_counter_moved():
    clock = FakeClock()
    counter = {"n": 0}

    def a(r):
        clock.t += 1.0
        if r == 1:  # someone else's requests ran during round 1's first sample
            counter["n"] += 7
        return 1.0

    def b(r):
        clock.t += 0.5
        return 0.5

    c = M.compare(a, b, busy=lambda: counter["n"], busy_what="steps of other requests", clock=clock)
    assert c.contended and c.contended_rounds == 1 and c.busy_delta == 7
    assert "CONTENDED" in c.conditions() and "1 of 3 rounds" in c.conditions()
    assert "7 steps of other requests" in c.conditions()


@given(st.lists(st.booleans(), min_size=3, max_size=3))
def test_contended_rounds_equal_rounds_with_outside_work(moves):
    counter = {"n": 0}

    def a(r):
        counter["n"] += moves[r]
        return 1.0

    c = M.compare(a, lambda r: 1.0, busy=lambda: counter["n"], clock=FakeClock())
    assert c.contended_rounds == sum(moves)
    assert c.contended == any(moves)


def test_budget_adds_rounds_that_fit_and_stops():
    clock = FakeClock()

    def run(r):
        clock.t += 1.0
        return 1.0

    # 2 s a round: 3 rounds = 6 s; a 9 s budget fits a 4th (8 s) but not a 5th (8 + 2 > 9)
    c = M.compare(run, run, budget_s=9.0, clock=clock)
    assert c.rounds == 4 and len(c.samples_a) == 4 == len(c.samples_b)
    c = M.compare(run, run, budget_s=1.0, clock=clock)  # the minimum always runs
    assert c.rounds == 3
    c = M.compare(run, run, budget_s=1000.0, max_rounds=5, clock=clock)
    assert c.rounds == 5


def test_compare_rejects_bad_arguments_and_bad_samples():
    with pytest.raises(ValueError, match="min_rounds"):
        M.compare(lambda r: 1.0, lambda r: 1.0, min_rounds=0)
    with pytest.raises(ValueError, match="max_rounds"):
        M.compare(lambda r: 1.0, lambda r: 1.0, min_rounds=3, max_rounds=2)
    with pytest.raises(ValueError, match="positive"):
        M.compare(lambda r: 0.0, lambda r: 1.0)


def test_samples_carry_extra_counters():
    c = M.compare(lambda r: M.Sample(2.0, {"tokens": 10}), lambda r: M.Sample(1.0, {"tokens": 10}), clock=FakeClock())
    assert [s.extra["tokens"] for s in c.samples_a] == [10, 10, 10]


def test_ratio_after_a_phase_pairs_rounds_and_leaves_the_phase_out():
    """Plain 2.0 s with 0.5 s to its first token, speculative 1.25 s with the same 0.5 s: the whole
    runs are 1.6x apart, the time after the first token 1.5 / 0.75 = 2x."""
    c = M.compare(
        lambda r: M.Sample(2.0, {"ttft_s": 0.5}), lambda r: M.Sample(1.25, {"ttft_s": 0.5}), clock=FakeClock()
    )
    assert c.ratio.median == pytest.approx(1.6)
    after = M.ratio_after(c, "ttft_s")
    assert after.n == c.rounds and after.median == pytest.approx(2.0) and after.lo == after.hi
    missing = M.compare(lambda r: M.Sample(2.0, {"ttft_s": 0.5}), lambda r: M.Sample(1.0), clock=FakeClock())
    assert M.ratio_after(missing, "ttft_s") is None  # a round without the phase: no ratio, not a wrong one
    no_time_after = M.compare(lambda r: M.Sample(2.0, {"ttft_s": 2.0}), lambda r: 1.0, clock=FakeClock())
    assert M.ratio_after(no_time_after, "ttft_s") is None


def test_suspect_speedup_rule():
    # the case: 11.83x at 1.67 tokens per target pass
    reason = M.suspect_speedup(11.83, 1.67)
    assert reason is not None and "11.83" in reason and "1.67" in reason
    assert M.suspect_speedup(1.5, 1.67) is None
    assert M.suspect_speedup(1.67 * M.SUSPECT_MARGIN, 1.67) is None  # at the bound: believed
    assert M.suspect_speedup(None, 1.67) is None and M.suspect_speedup(2.0, None) is None
    with pytest.raises(ValueError, match="margin"):
        M.suspect_ratio(2.0, 1.0, margin=0.5)


@given(st.floats(0.01, 100.0), st.floats(0.01, 100.0), st.floats(1.0, 3.0))
def test_suspect_exactly_above_bound_times_margin(ratio, bound, margin):
    assert (M.suspect_ratio(ratio, bound, margin=margin) is not None) == (ratio > bound * margin)


def test_suspect_comparison_has_no_result():
    c = M.compare(lambda r: 10.0, lambda r: 1.0, clock=FakeClock())
    c = c.with_suspect(M.suspect_speedup(c.ratio.median, 1.67))
    assert c.result is None and c.suspect


def test_round_order_mirrors_on_odd_rounds_for_any_number_of_cells():
    assert M.round_order("ab", 0) == ["a", "b"] and M.round_order("ab", 1) == ["b", "a"]
    assert M.round_order([1, 2, 3, 4], 3) == [4, 3, 2, 1]
    assert M.order(3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
