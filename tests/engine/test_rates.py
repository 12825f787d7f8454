"""engine/observe/rates.py, the one home of the rates the pages, metrics and benchmarks show: vLLM's
definitions, their empty cases, and the rejection-sampling acceptance probability against
speculative/verify.py's rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.observe import rates


def test_acceptance_rate_is_accepted_over_draft_tokens():
    assert rates.acceptance_rate(6, 8) == 0.75
    assert rates.acceptance_rate(0, 8) == 0.0
    assert rates.acceptance_rate(0, 0) is None  # nothing proposed yet


def test_mean_acceptance_length_counts_the_bonus_or_correction_token():
    assert rates.mean_acceptance_length(6, 4) == 2.5  # 4 verify passes emitted 6 + 4 tokens
    assert rates.mean_acceptance_length(0, 3) == 1.0
    assert rates.mean_acceptance_length(0, 0) is None


def test_queue_prefill_and_decode_times_split_the_request_as_vllm_v1():
    # arrived at 1, scheduled at 1.5, first token at 2, tokens at 2, 2.25, 3
    assert rates.queue_time(1.0, 1.5) == 0.5
    assert rates.prefill_time(1.5, 2.0) == 0.5
    assert rates.decode_time(2.0, [2.0, 2.25, 3.0]) == 1.0
    assert rates.queue_time(1.0, 1.5) + rates.prefill_time(1.5, 2.0) == rates.ttft(1.0, 2.0)
    assert rates.queue_time(1.0, None) is None and rates.prefill_time(1.5, None) is None
    assert rates.decode_time(None, []) is None and rates.decode_time(2.0, []) == 0.0


def test_prefix_hit_rate():
    assert rates.prefix_hit_rate(48, 64) == 0.75
    assert rates.prefix_hit_rate(0, 0) == 0.0


@given(p=st.floats(0, 1), q=st.floats(0, 1))
def test_accept_probability_is_min_1_p_over_q(p, q):
    a = rates.accept_probability(p, q)
    assert 0.0 <= a <= 1.0
    assert a == (pytest.approx(min(1.0, p / q)) if q > 0 else 1.0)


def test_accept_probability_is_the_fraction_of_uniform_us_verify_accepts():
    """verify.py accepts iff u * q < p: over a fine grid of u the accepted fraction is min(1, p/q)."""
    us = [(i + 0.5) / 10_000 for i in range(10_000)]
    for p, q in ((0.2, 0.5), (0.5, 0.2), (0.3, 0.3), (0.0, 0.4)):
        frac = sum(u * q < p for u in us) / len(us)
        assert frac == pytest.approx(rates.accept_probability(p, q), abs=1e-4)


@given(st.lists(st.integers(0, 3), max_size=40))
def test_itl_kept_as_the_request_goes_is_itl_of_all_its_times(steps):
    """rates.itl_extend, called before each token's time is appended (several tokens of one
    step share a time: a speculative step's accepted tokens), keeps itl(token_times)."""
    times, gaps, t = [], [], 0.0
    for n in steps:
        t += 0.25
        for _ in range(n):
            rates.itl_extend(gaps, times, t)
            times.append(t)
        assert gaps == rates.itl(times)
