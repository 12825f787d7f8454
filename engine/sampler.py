"""Sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator.

`probs()` gives the exact distribution a request samples from (used by the speculative
verifier so that rejection sampling keeps the target's distribution)."""

from __future__ import annotations

import torch

from .config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed() % (2**63))
    return g


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (fp32)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        cum = p.cumsum(-1)
        drop = (cum - p) >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    p = probs(logits, params)
    return int(torch.multinomial(p, 1, generator=generator).item())


def sample_from(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())
