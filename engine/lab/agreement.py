"""Greedy agreement between the engine and transformers' `generate`, one definition for the tests,
the GPU check and the benchmarks.

In fp32 the engine is held to identity (every token the same). In bfloat16 / float16 the two
sides round differently (other kernels, other summation orders), and once one token differs
the continuations part ways, so agreement is reported as measured, never claimed: the fraction
of generated tokens identical at the same index, and where each request first diverged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Agreement:
    requests: int
    tokens: int  # reference tokens compared
    identical: int  # tokens equal at the same index
    fraction: float  # identical / tokens
    exact_requests: int  # requests whose whole continuation is identical
    first_divergence: list  # per request: index of the first differing token, or None

    @property
    def exact(self) -> bool:
        return self.exact_requests == self.requests

    def as_dict(self) -> dict:
        d = asdict(self)
        d["exact"] = self.exact
        return d


def agreement(got: list[list[int]], ref: list[list[int]]) -> Agreement:
    """Compares token lists request by request; a missing or extra token counts as different."""
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} outputs vs {len(ref)} references")
    tokens = identical = exact = 0
    firsts = []
    for g, r in zip(got, ref):
        n = max(len(g), len(r))
        same = sum(1 for a, b in zip(g, r) if a == b)
        first = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if first is None and len(g) != len(r):
            first = min(len(g), len(r))
        tokens += n
        identical += same
        exact += first is None
        firsts.append(first)
    return Agreement(len(ref), tokens, identical, identical / tokens if tokens else 1.0, exact, firsts)


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate`, one request at a time on the model's device, EOS
    ignored (so both sides produce exactly max_new_tokens)."""
    import torch

    outs = []
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=dev)
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                num_beams=1,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs
