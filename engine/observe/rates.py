"""The engine's rate and latency definitions, one home each (vLLM's): the engine's metrics
(observe/metrics.py), /metrics (serve/metrics.py), the speculative decoder and the pages compute
them through here, so a figure labelled "TTFT" or "acceptance rate" means one thing everywhere.

- TTFT = first token time - arrival
- e2e latency = finish - arrival (any finished request, as vLLM's histogram)
- TPOT = (last token time - first token time) / (output tokens - 1): vLLM's decode time over the
  tokens after the first; it ends at the last token, not at the finish
- decode rate = 1 / TPOT: tokens after the first / (last token time - first token time); the
  Playground's "Decode" and watched_bench's API figure (its streamed chunks' times) both
- ITL = one gap per engine step that emitted tokens for the request (tokens one speculative step
  accepts together share a time, so there is no zero gap), as vLLM observes it per iteration
- acceptance rate = accepted draft tokens / draft tokens proposed
- mean acceptance length = 1 + accepted draft tokens / drafts (tokens a verify pass yields)
- prefix hit rate = prompt tokens found in the prefix cache / prompt tokens looked up
- accept probability of one draft token under rejection sampling = min(1, p(x) / q(x))
"""

from __future__ import annotations

from itertools import pairwise


def ttft(arrival_time: float, first_token_time: float | None) -> float | None:
    """None before the first token."""
    return None if first_token_time is None else first_token_time - arrival_time


def e2e_latency(arrival_time: float, finish_time: float | None) -> float | None:
    """None while the request runs."""
    return None if finish_time is None else finish_time - arrival_time


def queue_time(arrival_time: float, first_scheduled_time: float | None) -> float | None:
    """vLLM v1's queue time: arrival to first scheduled. None before it is scheduled."""
    return None if first_scheduled_time is None else first_scheduled_time - arrival_time


def prefill_time(first_scheduled_time: float | None, first_token_time: float | None) -> float | None:
    """vLLM v1's prefill time: first scheduled to first token. None before the first token."""
    if first_scheduled_time is None or first_token_time is None:
        return None
    return first_token_time - first_scheduled_time


def decode_time(first_token_time: float | None, token_times) -> float | None:
    """vLLM v1's decode time: first token to last token. None before the first token."""
    if first_token_time is None:
        return None
    return (token_times[-1] if token_times else first_token_time) - first_token_time


def tpot(first_token_time: float | None, token_times, num_output_tokens: int) -> float | None:
    """None with fewer than two output tokens. token_times: the time each output token was
    emitted (the last one ends the decode time)."""
    if first_token_time is None or num_output_tokens < 2 or not token_times:
        return None
    return (token_times[-1] - first_token_time) / (num_output_tokens - 1)


def decode_rate(first_token_time: float | None, last_token_time: float | None, num_output_tokens: int) -> float | None:
    """Tokens per second after the first (1 / TPOT); None with fewer than two output tokens or
    no time between the first and the last."""
    if first_token_time is None or last_token_time is None or num_output_tokens < 2:
        return None
    dt = last_token_time - first_token_time
    return (num_output_tokens - 1) / dt if dt > 0 else None


def itl(token_times) -> list[float]:
    """The inter-token latencies of one request: gaps between the distinct emission times."""
    ts: list[float] = []
    for t in token_times:
        if not ts or t != ts[-1]:
            ts.append(t)
    return [b - a for a, b in pairwise(ts)]


def itl_extend(gaps: list[float], token_times: list[float], now: float) -> None:
    """itl kept as the request goes: called before `now` is appended to token_times, it adds the
    gap that time opens (none for a token of the same step), so `gaps` stays itl(token_times)
    without going over all the times again at every step."""
    if token_times and now != token_times[-1]:
        gaps.append(now - token_times[-1])


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float | None:
    """None before any draft token was proposed."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else None


def mean_draft_length(num_draft_tokens: int, num_drafts: int) -> float | None:
    """Draft tokens per verify pass (the n-gram drafter drafts up to k, fewer after a short match);
    None before any draft was verified."""
    return num_draft_tokens / num_drafts if num_drafts else None


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
