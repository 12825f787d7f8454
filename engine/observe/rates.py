"""The engine's rate definitions, one home each (vLLM's): every module and page computes these
ratios through here, so a figure labelled "acceptance rate" or "prefix hit rate" means one thing.

- acceptance rate = accepted draft tokens / draft tokens proposed
- mean acceptance length = 1 + accepted draft tokens / drafts (tokens a verify pass yields)
- prefix hit rate = prompt tokens found in the prefix cache / prompt tokens looked up
- accept probability of one draft token under rejection sampling = min(1, p(x) / q(x))
"""

from __future__ import annotations


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float | None:
    """None before any draft token was proposed."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else None


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float | None:
    """None before any draft was verified."""
    return 1 + num_accepted_tokens / num_drafts if num_drafts else None


def prefix_hit_rate(hit_tokens: int, queried_tokens: int) -> float:
    """0.0 before any lookup."""
    return hit_tokens / queried_tokens if queried_tokens else 0.0


def accept_probability(p: float, q: float) -> float:
    """min(1, p(x)/q(x)): the chance rejection sampling keeps draft token x (speculative/verify.py
    accepts iff u * q < p, u uniform in [0, 1)); 1 for q = 0 by convention (x cannot be drawn)."""
    return min(1.0, p / q) if q > 0 else 1.0
