"""The quantized-KV claim's rule (engine/lab/claims.py's `kv_quant` row): a quantized KV format
loses long-range recall while its short prompts are still intact. From the kvquant sweep
(recall by context) or the recall grid (needles at several depths, engine/lab/recall_grid.py),
with each format's teacher-forced short-prompt agreement with fp32. Returns the row's measured
text, verdict and reason; claims.py makes the row."""

from __future__ import annotations

from engine.config import QUANTIZED_KV_CACHE_DTYPES
from engine.lab import recall_grid as RG

QUANTIZED_KV = QUANTIZED_KV_CACHE_DTYPES  # highest precision first
SHORT_TOP1_MIN = 0.9  # short prompts "intact": >= 90 % of a format's next-token picks are fp32's


def recall_breaks_at(recall: dict, base: dict) -> int | None:
    """The shortest context (tokens) at which a format recalls fewer needles than fp32 does, among
    the contexts where fp32 recalls any; None when it keeps up at every one."""
    lost = [int(c) for c, b in base.items() if b > 0 and isinstance(recall.get(c), (int, float)) and recall[c] < b]
    return min(lost) if lost else None


def verdict(by_dtype: dict, grid: dict | None = None) -> tuple[str, bool | None, str]:
    """Holds if some quantized format loses long-range recall (a needle fp32 finds, at some
    context of the sweep) while its short prompts are still intact (teacher-forced top-1 agreement
    with fp32 >= SHORT_TOP1_MIN): recall breaks first as precision drops. Fails when every format
    that loses recall has lost short prompts too, or none loses recall. With `grid` (the recall
    grid to the model's context: engine/lab/recall_grid.py) the recall comes from it, and the row
    says for each format the shortest context where recall breaks beside its short-prompt agreement."""
    if RG.is_grid(grid):
        return grid_verdict(by_dtype, grid)
    base = by_dtype.get("fp32", {}).get("recall_by_context")
    got = {
        d: by_dtype[d]
        for d in QUANTIZED_KV
        if isinstance(by_dtype.get(d), dict)
        and isinstance(by_dtype[d].get("recall_by_context"), dict)
        and isinstance(by_dtype[d].get("short_top1_agreement"), (int, float))
    }
    if not isinstance(base, dict) or not base or not got:
        return (
            "—",
            None,
            "the kvquant result lacks the recall sweep (recall_by_context) or short-prompt agreement; "
            "run python -m engine bench kvquant",
        )
    ctxs = sorted(base, key=int)
    ctx_names = "/".join(f"{int(c) // 1024}k" if int(c) % 1024 == 0 else c for c in ctxs)

    def curve(rec):
        return "/".join(f"{rec[c]:.1f}" if isinstance(rec.get(c), (int, float)) else "—" for c in ctxs)

    parts = [f"fp32 recall {curve(base)}"]
    breaks = {}
    for d, r in got.items():
        breaks[d] = recall_breaks_at(r["recall_by_context"], base)
        parts.append(f"{d} recall {curve(r['recall_by_context'])}, short top-1 {r['short_top1_agreement']:.2f}")
    measured = f"needle recall at {ctx_names} tokens; " + "; ".join(parts)
    first = [d for d in got if breaks[d] is not None and got[d]["short_top1_agreement"] >= SHORT_TOP1_MIN]
    lost = [d for d in got if breaks[d] is not None]
    if not any(v > 0 for v in base.values()):
        return measured, None, "fp32 itself recalls no needle: the sweep cannot show a loss"
    rule = (
        f"holds if a format loses a needle fp32 recalls while ≥ {SHORT_TOP1_MIN:.0%} of its short-prompt "
        "next tokens (teacher-forced) are still fp32's; "
    )
    if first:
        d = first[0]
        why = (
            f"here {d} loses recall from {breaks[d]} tokens with short prompts intact "
            f"({got[d]['short_top1_agreement']:.0%}): recall breaks first"
        )
    elif lost:
        why = (
            "here every format that loses recall has lost short prompts too ("
            + ", ".join(f"{d} {got[d]['short_top1_agreement']:.0%}" for d in lost)
            + "): they break together"
        )
    else:
        why = "here no format down to " + list(got)[-1] + " loses a needle fp32 recalls"
    short_first = [d for d in got if breaks[d] is None and got[d]["short_top1_agreement"] < SHORT_TOP1_MIN]
    if short_first and not first:
        why += (
            "; "
            + ", ".join(
                f"{d} keeps every needle with short prompts at {got[d]['short_top1_agreement']:.0%}"
                for d in short_first
            )
            + ": short prompts degrade first"
        )
    return measured, bool(first), rule + why


def grid_verdict(by_dtype: dict, grid: dict) -> tuple[str, bool | None, str]:
    """verdict's rule on the recall grid (needles at several depths of prompts up to the
    model's context) and each format's short-prompt top-1 agreement from `by_dtype`."""
    got = {
        d: float(by_dtype[d]["short_top1_agreement"])
        for d in QUANTIZED_KV
        if d in grid["hit"]
        and isinstance(by_dtype.get(d), dict)
        and isinstance(by_dtype[d].get("short_top1_agreement"), (int, float))
    }
    ctxs = RG.contexts(grid)
    depths = "/".join(f"{d:g}" for d in grid["depths"])
    if not got:
        return "—", None, "the recall grid has no quantized format with short-prompt agreement"

    def curve(d):
        rec = RG.recall(grid, d)
        return "/".join(f"{rec[c]:.2f}" if c in rec else "—" for c in ctxs)

    measured = (
        f"share of needles (depths {depths}) recalled at {'/'.join(RG.ctx_name(c) for c in ctxs)} tokens: "
        f"fp32 {curve('fp32')}; " + "; ".join(f"{d} {curve(d)}, short top-1 {got[d]:.2f}" for d in got)
    )
    if not any(any(h) for h in grid["hit"]["fp32"].values()):
        return measured, None, "fp32 itself recalls no needle: the grid cannot show a loss"
    breaks = {d: RG.breaks_at(grid, d) for d in got}
    first = [d for d in got if breaks[d] is not None and got[d] >= SHORT_TOP1_MIN]
    lost = [d for d in got if breaks[d] is not None]
    rule = (
        f"holds if a format loses a needle fp32 recalls (prompts up to {RG.ctx_name(RG.longest(grid))} tokens) "
        f"while ≥ {SHORT_TOP1_MIN:.0%} of its short-prompt next tokens (teacher-forced) are still fp32's; here "
    )
    per = "; ".join(f"{d} {RG.summary(grid, d)}, short prompts {got[d]:.0%}" for d in got)
    if first:
        finding = f"{first[0]}'s recall breaks with its short prompts intact: recall breaks first"
    elif lost:
        finding = (
            "every format that loses a needle has lost short prompts too ("
            + ", ".join(f"{d} {got[d]:.0%}" for d in lost)
            + "): recall does not break first"
        )
    else:
        finding = "no format loses a needle fp32 recalls"
    short_first = [d for d in got if breaks[d] is None and got[d] < SHORT_TOP1_MIN]
    if short_first and not first:
        finding += (
            "; " + ", ".join(short_first) + " keeps every needle with short prompts degraded: short prompts first"
        )
    return measured, bool(first), rule + per + " — " + finding
