"""The long-range recall grid of a quantized K/V cache, read from its stored measurement: a needle
at several depths of prompts of several lengths, per pool format (scripts/kv_recall_grid.py
measures it; assets/measurements/kvquant.json keeps it as "recall_grid"). Pure functions of that
dict, shared by the kv_quant Claims row (engine/lab/claims.py) and the Memory calculator's caption.

The grid: {"contexts": [1024, ...], "depths": [0.1, 0.5, 0.9], "dtypes": [...],
"hit": {dtype: {"1024": [bool per depth], ...}}, "logprob": {dtype: {"1024": [float per depth]}}}.
A format "misses" a needle only where fp32 (the reference) finds it; what fp32 itself misses
is the model's limit, not the format's loss.
"""

from __future__ import annotations


def is_grid(grid) -> bool:
    """True for a grid with fp32 and at least one measured context."""
    return (
        isinstance(grid, dict)
        and isinstance(grid.get("hit"), dict)
        and isinstance(grid["hit"].get("fp32"), dict)
        and isinstance(grid.get("depths"), list)
        and bool(contexts(grid))
    )


def contexts(grid: dict) -> list[str]:
    """The measured contexts (keys of fp32's hits), shortest first."""
    return sorted((grid.get("hit") or {}).get("fp32") or {}, key=int)


def recall(grid: dict, dtype: str) -> dict[str, float]:
    """{context: fraction of the depths whose needle the format recalls} over measured contexts."""
    hits = (grid.get("hit") or {}).get(dtype) or {}
    return {c: sum(map(bool, hits[c])) / len(hits[c]) for c in contexts(grid) if hits.get(c)}


def misses(grid: dict, dtype: str) -> list[tuple[int, float]]:
    """(context, depth) of every needle fp32 recalls and the format does not, shortest first."""
    hits = (grid.get("hit") or {}).get(dtype) or {}
    ref = grid["hit"]["fp32"]
    out = []
    for c in contexts(grid):
        for depth, r, h in zip(grid["depths"], ref.get(c) or [], hits.get(c) or []):
            if r and not h:
                out.append((int(c), depth))
    return out


def breaks_at(grid: dict, dtype: str) -> tuple[int, list[float]] | None:
    """The shortest context at which the format misses a needle fp32 recalls, with the depths it
    misses there; None when it keeps every such needle of the grid."""
    m = misses(grid, dtype)
    if not m:
        return None
    first = m[0][0]
    return first, [d for c, d in m if c == first]


def longest(grid: dict) -> int:
    return int(contexts(grid)[-1])


def ctx_name(c) -> str:
    c = int(c)
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def summary(grid: dict, dtype: str) -> str:
    """'loses a needle from 2k tokens (depth 0.5)' or 'keeps every needle fp32 recalls, to 8k tokens', for one
    format: where its recall breaks first."""
    b = breaks_at(grid, dtype)
    if b is None:
        return f"keeps every needle fp32 recalls, to {ctx_name(longest(grid))} tokens"
    c, depths = b
    what, dw = ("a needle", "depth") if len(depths) == 1 else ("needles", "depths")
    return f"loses {what} from {ctx_name(c)} tokens ({dw} {'/'.join(f'{d:g}' for d in depths)})"
