"""The pure half of `bench scaling` (engine/bench/scaling.py): its grids, the shape of its stored
result, and the point-by-point table read back from it (kvscope beside each peer and beside the
machine's limit). No torch, no timing: the suite, scripts/scaling_figure.py, ui/figures/scaling.py
and the Claims page all read a result through these functions.

A result's fields (results/scaling-<UTC>.json, "fields"):
- grid: {"lengths": [...], "concurrency": [...], "new_tokens": n, "conc_prompt_len": p, "conc_new_tokens": m,
  "rounds": r} (r: how many times each point was measured; results from before it had one round)
- roofs: {"peak_matmul_gflops", "matmul_kernel", "mem_bw_gb_s", "weight_bytes_read_per_step", "kv_bytes_per_token"}
- points: [{"axis", "x", "engine", "value", "load_1m", "round"}] measured values (see AXES for units),
  one per engine, point and round
- limits: [{"axis", "x", "value", "basis"}] the machine's limit at each point, same units
- peers: {engine: "ok" | why it was not measured}
- isa, threads, segments ([{"name", "load_1m", "wall_s"}], each timed segment's load and length)
"""

from __future__ import annotations

ENGINES = ("kvscope", "llamacpp", "vllm")
ENGINE_LABELS = {"kvscope": "kvscope", "llamacpp": "llama.cpp", "vllm": "vLLM CPU"}
# axis -> (what is measured, unit, True where lower is better)
AXES = {
    "prefill": ("TTFT against prompt length", "s", True),
    "decode": ("decode tokens/s against context", "tok/s", False),
    "concurrency": ("output tokens/s against concurrent requests", "tok/s", False),
}
GOALS = {"vs_best_peer": 1.0, "prefill_8k_of_limit": 0.6, "decode_8k_of_limit": 0.6}
MAX_ROUNDS = 5  # each round is a whole grid's time (the full one: about 7-9 minutes at 1 thread)


def grid(quick: bool = False, smoke: bool = False) -> dict:
    """The points a run measures. Full: prompt lengths 128 -> 8k (8,000 + 32 new tokens fit the
    model's 8,192), concurrency 1 -> 64; quick: a few minutes on 2 cores; smoke: the tiny model."""
    if smoke:
        return {
            "lengths": [16, 48],
            "concurrency": [1, 2],
            "new_tokens": 4,
            "conc_prompt_len": 16,
            "conc_new_tokens": 4,
            "rounds": 1,
        }
    if quick:
        return {
            "lengths": [128, 512, 2048],
            "concurrency": [1, 8, 32],
            "new_tokens": 16,
            "conc_prompt_len": 128,
            "conc_new_tokens": 32,
            "rounds": 1,
        }
    return {
        "lengths": [128, 512, 1024, 2048, 4096, 8000],
        "concurrency": [1, 4, 16, 64],
        "new_tokens": 32,
        "conc_prompt_len": 128,
        "conc_new_tokens": 64,
        "rounds": 1,
    }


def with_overrides(
    g: dict, lengths: str | None = None, concurrency: str | None = None, rounds: str | None = None
) -> dict:
    """The grid with its lengths / concurrency levels replaced by comma lists (the suite reads
    $KVSCOPE_SCALING_LENGTHS and $KVSCOPE_SCALING_CONCURRENCY: a run of some points only) and its
    number of rounds ($KVSCOPE_SCALING_ROUNDS: every point measured that many times, each engine
    alike, on prompts of their own; the table keeps each engine's best)."""
    out = dict(g)
    if rounds:
        try:
            n = int(rounds)
        except ValueError:
            raise ValueError(f"rounds must be an integer from 1 to {MAX_ROUNDS}, got {rounds!r}") from None
        if not 1 <= n <= MAX_ROUNDS:
            raise ValueError(f"rounds must be an integer from 1 to {MAX_ROUNDS}, got {rounds!r}")
        out["rounds"] = n
    for key, text in (("lengths", lengths), ("concurrency", concurrency)):
        if text:
            try:
                vals = sorted({int(v) for v in text.split(",") if v.strip()})
            except ValueError:
                raise ValueError(f"{key} must be comma-separated integers, got {text!r}") from None
            if not vals or vals[0] < 1:
                raise ValueError(f"{key} must be integers >= 1, got {text!r}")
            out[key] = vals
    return out


def merge(results: list[dict]) -> dict:
    """Several stored results' fields as one (runs of different points, e.g. a --quick grid and
    an 8k-only run): grid points united, each point and limit kept from its own run (its own
    roofs), the peers' states and segments listed per run. Where two runs measured the same point,
    `value` keeps the better one."""
    if len(results) == 1:
        return results[0]
    g = dict(results[0].get("grid") or {})
    for key in ("lengths", "concurrency"):
        g[key] = sorted({x for r in results for x in (r.get("grid") or {}).get(key, [])})
    g["rounds"] = min((r.get("grid") or {}).get("rounds", 1) for r in results)  # each point had at least these
    out = {
        "grid": g,
        "points": [p for r in results for p in r.get("points") or []],
        "limits": [],
        "peers": {},
        "isa": results[0].get("isa"),
        "threads": results[0].get("threads"),
        "segments": [s for r in results for s in r.get("segments") or []],
        "runs": len(results),
    }
    seen = set()
    for r in results:  # one limit per point: the first run that measured it
        for lim in r.get("limits") or []:
            if (lim["axis"], lim["x"]) not in seen:
                seen.add((lim["axis"], lim["x"]))
                out["limits"].append(lim)
        for e, why in (r.get("peers") or {}).items():
            out["peers"].setdefault(e, [])
            out["peers"][e].append(why)
    out["peers"] = {e: "; ".join(dict.fromkeys(v)) for e, v in out["peers"].items()}
    return out


def max_len_needed(g: dict) -> int:
    """The longest sequence the grid asks any engine to hold (its max_model_len must cover it)."""
    return max(max(g["lengths"]) + g["new_tokens"], g["conc_prompt_len"] + g["conc_new_tokens"])


def value(points: list[dict], axis: str, x: int, engine: str) -> float | None:
    """The best measured value at a point (lowest TTFT, highest rate), None where not measured."""
    vals = [p["value"] for p in points if p["axis"] == axis and p["x"] == x and p["engine"] == engine]
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return min(vals) if AXES[axis][2] else max(vals)


def limit(limits: list[dict], axis: str, x: int) -> float | None:
    return next((lim["value"] for lim in limits if lim["axis"] == axis and lim["x"] == x), None)


def _speed(axis: str, v: float | None) -> float | None:
    """A value as a rate (higher is better): TTFT inverted."""
    if v is None or v <= 0:
        return None
    return 1.0 / v if AXES[axis][2] else v


def table(fields: dict) -> list[dict]:
    """One row per (axis, x): each engine's value, the limit, kvscope / best peer and kvscope /
    limit, both as speed ratios (> 1 = kvscope faster; of_limit <= 1 unless the limit is wrong)."""
    pts, lims, g = fields.get("points") or [], fields.get("limits") or [], fields.get("grid") or {}
    rows = []
    for axis, xs in (
        ("prefill", g.get("lengths")),
        ("decode", g.get("lengths")),
        ("concurrency", g.get("concurrency")),
    ):
        for x in xs or ():
            row = {"axis": axis, "x": x, "limit": limit(lims, axis, x)}
            for e in ENGINES:
                row[e] = value(pts, axis, x, e)
            peers = [_speed(axis, row[e]) for e in ENGINES[1:]]
            peers = [s for s in peers if s is not None]
            k = _speed(axis, row["kvscope"])
            row["best_peer"] = None
            if peers:
                best = max(peers)
                row["best_peer"] = next(e for e in ENGINES[1:] if _speed(axis, row[e]) == best)
            row["vs_best_peer"] = k / max(peers) if (k is not None and peers) else None
            lim = _speed(axis, row["limit"])
            row["of_limit"] = k / lim if (k is not None and lim) else None
            rows.append(row)
    return rows


def goals(rows: list[dict], fields: dict) -> dict:
    """The issue's goals, each with its measured value: every point >= 1.0x the best peer; the
    longest prompt's prefill and decode at >= 0.6 of their limits."""
    longest = max((fields.get("grid") or {}).get("lengths") or [0])
    ratios = [r["vs_best_peer"] for r in rows if r["vs_best_peer"] is not None]
    pre = next((r["of_limit"] for r in rows if r["axis"] == "prefill" and r["x"] == longest), None)
    dec = next((r["of_limit"] for r in rows if r["axis"] == "decode" and r["x"] == longest), None)
    return {
        "points_vs_best_peer": len(ratios),
        "points_at_or_above_best_peer": sum(v >= GOALS["vs_best_peer"] for v in ratios),
        "worst_vs_best_peer": min(ratios) if ratios else None,
        f"prefill_{longest}_of_limit": pre,
        f"decode_{longest}_of_limit": dec,
    }


def fmt(v, unit: str = "") -> str:
    if v is None:
        return "–"
    if unit == "s":
        return f"{v:.3g} s" if v < 10 else f"{v:.1f} s"
    if unit == "x":
        return f"{v:.2f}×"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def markdown_table(fields: dict) -> str:
    """The point-by-point table as Markdown (docs/BENCHMARKS.md's opening table)."""
    lines = [
        "| measure | x | kvscope | llama.cpp | vLLM CPU | limit | kvscope / best peer | kvscope / limit |",
        "| --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    names = {
        "prefill": "TTFT, prompt tokens",
        "decode": "decode tok/s, context",
        "concurrency": "output tok/s, requests",
    }
    for r in table(fields):
        unit = AXES[r["axis"]][1]
        lines.append(
            f"| {names[r['axis']]} | {r['x']} | "
            + " | ".join(fmt(r[e], unit) for e in (*ENGINES, "limit"))
            + f" | {fmt(r['vs_best_peer'], 'x')} | {fmt(r['of_limit'], 'x')} |"
        )
    return "\n".join(lines)
