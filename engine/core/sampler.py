"""Sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator;
`process()` applies logit_bias and the presence / frequency / repetition penalties first.

`probs()` gives the exact distribution a request samples from (used by the speculative
verifier so that rejection sampling keeps the target's distribution). Requests with logits
processors are not speculated (engine/speculative/decoder.py), so `probs()` never needs the
history. All knobs neutral: the engine never calls `process()` (the greedy path is unchanged)."""

from __future__ import annotations

import torch

from engine.config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed() % (2**63))
    return g


def process(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """logits [V] -> fp32 logits after logit_bias and the penalties, in vLLM's order (bias, then
    repetition over prompt + output, then frequency and presence over the output). The token
    history is the request's own (Sequence.prompt_token_ids / output_token_ids)."""
    x = logits.float().clone()
    V = x.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=x.device)
        x[ids] += torch.tensor(list(params.logit_bias.values()), dtype=x.dtype, device=x.device)
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.zeros(V, dtype=torch.bool, device=x.device)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=x.device)] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=x.device), minlength=V)[:V]
        x = x - params.frequency_penalty * counts.to(x.dtype) - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, min-p, top-k and top-p (fp32)."""
    x = logits.float() / params.temperature
    if params.min_p:  # vLLM / HF: relative to the most likely token, after temperature
        p = torch.softmax(x, dim=-1)
        thresh = p.amax(dim=-1, keepdim=True) * params.min_p
        x = x.masked_fill(p < thresh, float("-inf"))
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
