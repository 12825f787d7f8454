"""Verification of draft tokens against the target's logits: greedy (accept while the draft is
the argmax; the first mismatch is replaced by it; all accepted -> one bonus token) and rejection
sampling for temperature > 0 (accept x with probability min(1, p(x)/q(x)); on rejection sample
from normalize(max(0, p - q)); all accepted -> the bonus is sampled from p of the last row), which
keeps the emitted tokens distributed exactly as sampling from p. p is the sampler's distribution
(temperature, top-k, top-p); the request's own seeded generator draws every random number."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.observe.snapshot import ACCEPTED, BONUS, REPLACED


class Verdict(NamedTuple):
    """The verifier's word on one emitted token. kind: accepted | replaced | bonus; rejected_id:
    the draft a replaced token stands in for. Rejection sampling also records the numbers behind
    the decision: for an accepted or replaced mark, p and q are the target's and the drafter's
    probabilities of the judged draft token and u the uniform draw (accepted iff u * q < p); for a
    bonus, p is the target's probability of the bonus token. Greedy leaves them None."""

    kind: str
    rejected_id: int | None = None
    p: float | None = None
    q: float | None = None
    u: float | None = None


def verify_greedy(
    drafts: list[int], logits: torch.Tensor, argmax: list[int] | None = None
) -> tuple[list[int], list[Verdict], int]:
    """logits [len(drafts)+1, V]; argmax: their rows' argmax (the first of equal maxima) where the
    caller computed it already. Returns (tokens, verdicts, num_accepted)."""
    target = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
    out, marks = [], []
    for j, x in enumerate(drafts):
        if x == target[j]:
            out.append(x)
            marks.append(Verdict(ACCEPTED))
        else:
            out.append(target[j])
            marks.append(Verdict(REPLACED, x))
            return out, marks, j
    out.append(target[len(drafts)])
    marks.append(Verdict(BONUS))
    return out, marks, len(drafts)


def verify_sampling(
    drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[list[int], list[Verdict], int]:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
    p: target probabilities [len(drafts)+1, V]; q: draft probabilities [len(drafts), V] the
    drafts were sampled from, or None for deterministic drafts (q = point mass on the draft).
    The emitted tokens are distributed exactly as sampling from p one token at a time."""
    out, marks = [], []
    dev = p.device
    for j, x in enumerate(drafts):
        px = float(p[j, x])
        qx = float(q[j, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator, device=dev))
        if u * qx < px:  # accept with probability min(1, p(x)/q(x))
            out.append(x)
            marks.append(Verdict(ACCEPTED, None, px, qx, u))
            continue
        if q is not None:
            resid = (p[j] - q[j]).clamp_min(0)
        else:
            resid = p[j].clone()
            resid[x] = 0
        s = float(resid.sum())
        if not s > 0:  # only reachable through rounding (p == q)
            resid, s = p[j], float(p[j].sum())
        y = int(torch.multinomial(resid / s, 1, generator=generator))
        out.append(y)
        marks.append(Verdict(REPLACED, x, px, qx, u))
        return out, marks, j
    y = int(torch.multinomial(p[len(drafts)], 1, generator=generator))
    out.append(y)
    marks.append(Verdict(BONUS, None, float(p[len(drafts), y])))
    return out, marks, len(drafts)
