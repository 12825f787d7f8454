"""Speculative decoding's arithmetic: E(alpha, k), the expected tokens per target pass when each
of k draft tokens is accepted with probability alpha (the first rejection stops the run), and
the alpha at which speculation breaks even with plain decoding. The one home of these formulas."""

from __future__ import annotations


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α): tokens per target pass when each of k draft tokens is
    accepted with probability α and the first rejection stops the run."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even_alpha(cost_ratio: float, k: float) -> float | None:
    """The α at which E(α, k) equals cost_ratio (speculation's cost per pass relative to a
    plain pass). 0 when speculation is cheaper than plain decoding even at α=0; None when even
    α=1 (k+1 tokens per pass) cannot pay for it."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_pass(mid, k) < cost_ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
