"""Side-by-side measurements on private engines: paged vs contiguous allocation, KV cache vs no
cache, and the seed's 50-growing-sequences exercise (no eviction vs LRU preemption).

Pure figure builders and summaries over the records engine/recording.py makes (RunRecord,
CostPoint), unit-tested for their numbers; no Streamlit, and nothing here drives an engine.
"""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.experiments import PrefixRow
from engine.rates import prefix_hit_rate
from engine.recording import CostPoint, RunRecord
from engine.snapshot import Snapshot
from engine.trace_events import ADMIT, PREEMPT, REJECT, SWAP_OUT, WAIT
from ui.figures import theme

_O = theme.OKABE_ITO
A_COLOR, B_COLOR = _O["blue"], _O["vermillion"]  # the two sides of every comparison
FILLED_COLOR, ALLOC_COLOR = _O["blue"], _O["orange"]
LIVE_STATES = ("waiting", "running", "preempted", "swapped")


def _layout(fig: go.Figure, title: str, height: int = 320, **kw) -> go.Figure:
    """Figure title at the top, subplot titles under it, the legend below the x axes (so neither
    covers the other), fixed height."""
    fig.update_layout(**theme.base_layout(height, title, margin=dict(l=60, r=15, t=64, b=100), **kw))
    fig.update_layout(
        title=dict(y=0.99, yref="container", yanchor="top"),
        legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0, font=dict(size=11)),
    )
    fig.update_annotations(font=dict(size=12))  # subplot titles
    fig.update_xaxes(gridcolor=theme.GRID, zerolinecolor=theme.GRID)
    fig.update_yaxes(gridcolor=theme.GRID, zerolinecolor=theme.GRID)
    return fig


# ==================================================================== paged vs contiguous


def slots_over_time(series: Sequence[Snapshot]) -> dict[str, list]:
    return {
        "step": [s.step for s in series],
        "allocated": [s.metrics.slots_allocated for s in series],
        "filled": [s.metrics.slots_filled for s in series],
        "waste": [s.metrics.waste_fraction for s in series],
        "running": [s.metrics.num_running for s in series],
    }


def allocator_summary(rec: RunRecord) -> dict:
    """Numbers for one allocator run, all read from its Snapshots/Events:
    peak allocated/filled slots, waste at the allocation peak, slot-weighted mean waste
    (1 - Σfilled / Σallocated over the run's steps), requests admitted, peak concurrency,
    preemptions, waits and steps to drain the workload."""
    so = slots_over_time(rec.series)
    alloc, filled = so["allocated"], so["filled"]
    tot_a, tot_f = sum(alloc), sum(filled)
    i_peak = max(range(len(alloc)), key=lambda i: (alloc[i], -i)) if alloc else None
    kinds: dict[str, set] = {}
    counts: dict[str, int] = {}
    for e in rec.events:
        counts[e.kind] = counts.get(e.kind, 0) + 1
        if e.request_id is not None:
            kinds.setdefault(e.kind, set()).add(e.request_id)
    last = rec.series[-1] if rec.series else None
    return {
        "label": rec.label,
        "allocator": last.info.allocator if last else None,
        "budget_slots": (last.info.num_blocks * last.info.block_size) if last else 0,
        "peak_allocated": alloc[i_peak] if i_peak is not None else 0,
        "filled_at_peak": filled[i_peak] if i_peak is not None else 0,
        "waste_at_peak": (so["waste"][i_peak] if i_peak is not None else 0.0),
        "mean_waste": (1 - tot_f / tot_a) if tot_a else 0.0,
        "admitted": len(kinds.get(ADMIT, ())),
        "peak_running": max(so["running"], default=0),
        "preemptions": counts.get(PREEMPT, 0),
        "waits": counts.get(WAIT, 0),
        "rejected": len(kinds.get(REJECT, ())) + len(rec.add_errors),
        "finished": len(rec.outputs),
        "steps": rec.steps,
        "truncated": rec.truncated,
    }


def allocator_figure(a: RunRecord, b: RunRecord) -> go.Figure:
    """Allocated vs filled slots per step, one panel per allocator, same y scale."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.04,
        subplot_titles=(html.escape(a.label), html.escape(b.label)),
    )
    for col, rec in ((1, a), (2, b)):
        so = slots_over_time(rec.series)
        fig.add_trace(
            go.Scatter(
                x=so["step"],
                y=so["allocated"],
                name="allocated slots",
                mode="lines",
                line=dict(color=ALLOC_COLOR, width=1.5, shape="hv"),
                fill="tozeroy",
                fillcolor="rgba(230,159,0,0.18)",
                showlegend=col == 1,
                legendgroup="alloc",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=so["step"],
                y=so["filled"],
                name="filled slots (tokens held)",
                mode="lines",
                line=dict(color=FILLED_COLOR, width=2, shape="hv"),
                fill="tozeroy",
                fillcolor="rgba(0,114,178,0.55)",
                showlegend=col == 1,
                legendgroup="filled",
            ),
            row=1,
            col=col,
        )
        if rec.series:
            budget = rec.series[-1].info.num_blocks * rec.series[-1].info.block_size
            fig.add_trace(
                go.Scatter(
                    x=[so["step"][0], so["step"][-1]],
                    y=[budget, budget],
                    mode="lines",
                    name="budget (slots)",
                    line=dict(color=theme.INK, width=1.5, dash="dot"),
                    showlegend=col == 1,
                    legendgroup="budget",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="engine step", row=1, col=col)
    fig.update_yaxes(title_text="KV slots (tokens)", row=1, col=1)
    _layout(fig, "Allocated vs filled KV slots, same workload, same budget", height=360)
    fig.update_layout(hovermode="x unified")
    return fig


def allocator_bars(sa: dict, sb: dict) -> go.Figure:
    """Waste % and concurrency side by side."""
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=("waste: slots reserved but empty (%)", "requests")
    )
    labels = [html.escape(str(sa["label"])), html.escape(str(sb["label"]))]
    for i, (s, c) in enumerate(((sa, A_COLOR), (sb, B_COLOR))):
        fig.add_trace(
            go.Bar(
                x=["mean over run", "at allocation peak"],
                y=[100 * s["mean_waste"], 100 * s["waste_at_peak"]],
                name=labels[i],
                marker=dict(color=c, pattern_shape="" if i == 0 else "/"),
                legendgroup=labels[i],
                text=[f"{100 * s['mean_waste']:.1f}%", f"{100 * s['waste_at_peak']:.1f}%"],
                textposition="outside",
                cliponaxis=False,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=["admitted", "peak running", "preemptions"],
                y=[s["admitted"], s["peak_running"], s["preemptions"]],
                name=labels[i],
                marker=dict(color=c, pattern_shape="" if i == 0 else "/"),
                legendgroup=labels[i],
                showlegend=False,
                text=[s["admitted"], s["peak_running"], s["preemptions"]],
                textposition="outside",
                cliponaxis=False,
            ),
            row=1,
            col=2,
        )
    fig.update_yaxes(range=[0, 105], row=1, col=1)
    _layout(fig, "Waste and concurrency", height=340, barmode="group")
    return fig


# ==================================================================== KV cache vs no cache


def cumulative(points: Sequence[CostPoint]) -> list[float]:
    out, acc = [], 0.0
    for p in points:
        acc += p.step_s
        out.append(acc)
    return out


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept); (0, mean) when x does not vary."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def _median(v: Sequence[float]) -> float:
    v = sorted(v)
    n = len(v)
    if not n:
        return 0.0
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def cost_summary(points: Sequence[CostPoint]) -> dict:
    """Per-step cost growth: least-squares slope of step time vs context length (s per extra
    context token), median step time of the first and last quarter (medians: a shared CPU adds
    outliers), total time, total tokens fed."""
    if not points:
        return {
            "tokens": 0,
            "total_s": 0.0,
            "slope_s_per_ctx_token": 0.0,
            "early_step_s": 0.0,
            "late_step_s": 0.0,
            "growth": 1.0,
            "fed_tokens": 0,
        }
    slope, _ = fit_line([p.context_len for p in points], [p.step_s for p in points])
    q = max(1, len(points) // 4)
    early = _median([p.step_s for p in points[:q]])
    late = _median([p.step_s for p in points[-q:]])
    return {
        "tokens": len(points),
        "total_s": sum(p.step_s for p in points),
        "slope_s_per_ctx_token": slope,
        "early_step_s": early,
        "late_step_s": late,
        "growth": (late / early) if early > 0 else 1.0,
        "fed_tokens": sum(p.fed_tokens for p in points),
    }


def cost_figure(with_cache: Sequence[CostPoint], without_cache: Sequence[CostPoint]) -> go.Figure:
    """Left: measured time per decode step vs context length. Middle: cumulative decode time vs
    tokens generated — a line with the cache, a parabola without. Right: cumulative tokens the
    model had to process (from the engine's events)."""
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        subplot_titles=(
            "time per generated token (ms)",
            "cumulative decode time (s)",
            "cumulative tokens run through the model",
        ),
    )
    for pts, name, c, dash in (
        (with_cache, "with KV cache", A_COLOR, "solid"),
        (without_cache, "no KV cache (recompute the prefix)", B_COLOR, "dash"),
    ):
        fig.add_trace(
            go.Scatter(
                x=[p.context_len for p in pts],
                y=[1000 * p.step_s for p in pts],
                name=name,
                mode="markers",
                marker=dict(color=c, size=4, symbol="circle" if dash == "solid" else "x"),
                legendgroup=name,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[p.generated for p in pts],
                y=cumulative(pts),
                name=name,
                mode="lines",
                line=dict(color=c, width=2.5, dash=dash),
                legendgroup=name,
                showlegend=False,
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=[p.generated for p in pts],
                y=cumulative_fed(pts),
                name=name,
                mode="lines",
                line=dict(color=c, width=2.5, dash=dash),
                legendgroup=name,
                showlegend=False,
            ),
            row=1,
            col=3,
        )
    fig.update_xaxes(title_text="context length (tokens)", row=1, col=1)
    fig.update_xaxes(title_text="tokens generated", row=1, col=2)
    fig.update_xaxes(title_text="tokens generated", row=1, col=3)
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, "Measured decode cost with and without the KV cache", height=370)


def cumulative_fed(points: Sequence[CostPoint]) -> list[int]:
    out, acc = [], 0
    for p in points:
        acc += p.fed_tokens
        out.append(acc)
    return out


# ==================================================================== 50 sequences vs a fixed budget


def demand_tokens(snap: Snapshot) -> int:
    """Tokens a server that never evicts would hold right now: every live sequence's full
    context (prompt + generated so far), whether or not the engine currently caches it."""
    return sum(r.prompt_len + r.output_len for r in snap.requests if r.state in LIVE_STATES)


def exercise_rows(rec: RunRecord) -> dict[str, list]:
    """Per step: demand vs budget (tokens), KV slots the engine has in use (blocks owned by
    requests × block size: physical, so it can never exceed the budget), queue counts,
    cumulative preemptions, finished."""
    rows = {
        k: []
        for k in (
            "step",
            "demand",
            "budget",
            "held",
            "running",
            "waiting",
            "preempted",
            "swapped",
            "finished",
            "preemptions",
        )
    }
    for s in rec.series:
        rows["step"].append(s.step)
        rows["demand"].append(demand_tokens(s))
        rows["budget"].append(
            rec.budget_tokens if rec.budget_tokens is not None else s.info.num_blocks * s.info.block_size
        )
        rows["held"].append(s.metrics.num_blocks_used * s.info.block_size)
        rows["running"].append(s.metrics.num_running)
        rows["waiting"].append(s.metrics.num_waiting)
        rows["preempted"].append(s.metrics.num_preempted)
        rows["swapped"].append(s.metrics.num_swapped)
        rows["finished"].append(s.metrics.num_finished)
        rows["preemptions"].append(s.metrics.num_preemptions_total)
    return rows


def first_over_budget(rec: RunRecord) -> int | None:
    """The first step at which demand exceeds the budget: where a server that keeps every
    sequence's cache would raise MemoryBudgetExceeded. None if it never does."""
    r = exercise_rows(rec)
    for step, d, b in zip(r["step"], r["demand"], r["budget"]):
        if d > b:
            return step
    return None


def first_held_over_budget(rec: RunRecord) -> int | None:
    """The first step at which the KV slots the engine actually had in use exceeded the budget
    (only possible when the engine ran with a bigger pool than the budget: run A)."""
    r = exercise_rows(rec)
    for step, h, b in zip(r["step"], r["held"], r["budget"]):
        if h > b:
            return step
    return None


def exercise_summary(rec: RunRecord) -> dict:
    r = exercise_rows(rec)
    counts: dict[str, int] = {}
    for e in rec.events:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    n_req = len({x.request_id for s in rec.series for x in s.requests}) or 0
    return {
        "label": rec.label,
        "requests": n_req,
        "finished": len(rec.outputs),
        "peak_demand": max(r["demand"], default=0),
        "budget": r["budget"][-1] if r["budget"] else 0,
        "peak_held": max(r["held"], default=0),
        "over_budget_step": first_over_budget(rec),
        "held_over_budget_step": first_held_over_budget(rec),
        "preemptions": counts.get(PREEMPT, 0),
        "swaps": counts.get(SWAP_OUT, 0),
        "waits": counts.get(WAIT, 0),
        "rejections": counts.get(REJECT, 0) + len(rec.add_errors),
        "steps": rec.steps,
        "truncated": rec.truncated,
    }


def exercise_figure(runs: Sequence[RunRecord]) -> go.Figure:
    """One panel per run: demand (what no-eviction would need) vs the budget vs what the engine
    actually holds, plus finished requests on a second axis."""
    n = max(1, len(runs))
    fig = make_subplots(
        rows=1,
        cols=n,
        shared_yaxes=True,
        horizontal_spacing=0.05,
        subplot_titles=[html.escape(r.label) for r in runs] or [""],
        specs=[[{"secondary_y": True}] * n],
    )
    for col, rec in enumerate(runs, 1):
        r = exercise_rows(rec)
        first = col == 1
        fig.add_trace(
            go.Scatter(
                x=r["step"],
                y=r["demand"],
                name="demand: every live sequence's context",
                mode="lines",
                line=dict(color=B_COLOR, width=2, dash="dash", shape="hv"),
                showlegend=first,
                legendgroup="demand",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=r["step"],
                y=r["held"],
                name="KV slots in use (engine)",
                mode="lines",
                line=dict(color=A_COLOR, width=2, shape="hv"),
                fill="tozeroy",
                fillcolor="rgba(0,114,178,0.2)",
                showlegend=first,
                legendgroup="held",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=r["step"],
                y=r["budget"],
                name="KV budget (tokens)",
                mode="lines",
                line=dict(color=theme.INK, width=1.5, dash="dot", shape="hv"),
                showlegend=first,
                legendgroup="budget",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=r["step"],
                y=r["finished"],
                name="finished requests (right axis)",
                mode="lines",
                line=dict(color=_O["bluish_green"], width=2, dash="dashdot", shape="hv"),
                showlegend=first,
                legendgroup="finished",
            ),
            row=1,
            col=col,
            secondary_y=True,
        )
        over = first_held_over_budget(rec)
        if over is not None:
            fig.add_vline(x=over, line=dict(color=B_COLOR, width=1.5, dash="dot"), row=1, col=col)
            fig.add_annotation(
                x=over,
                y=1,
                yref="y domain" if col == 1 else f"y{2 * col - 1} domain",
                xref="x" if col == 1 else f"x{col}",
                text=f" KV use > budget at step {over}",
                showarrow=False,
                xanchor="left",
                yanchor="top",
                font=dict(size=11, color=B_COLOR),
            )
        fig.update_xaxes(title_text="engine step", row=1, col=col)
    fig.update_yaxes(title_text="tokens", row=1, col=1, secondary_y=False, rangemode="tozero")
    n_max = max((max(exercise_rows(r)["finished"], default=0) for r in runs), default=0)
    step = next((d for d in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500) if n_max / d <= 6), 1000)
    fig.update_yaxes(rangemode="tozero", secondary_y=True, showgrid=False, tick0=0, dtick=step)
    return _layout(fig, "Growing sequences vs a fixed KV budget", height=390)


# ==================================================================== prefix cache: with vs forced misses


def prefix_summary(rows: Sequence[PrefixRow]) -> dict:
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    return {
        "requests": len(rows),
        "mean_ttft_s": (sum(ttfts) / len(ttfts)) if ttfts else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": prefix_hit_rate(cached, prompt),
    }


def ttft_saved_ms(with_cache: Sequence[PrefixRow], forced_miss: Sequence[PrefixRow]) -> float | None:
    """Mean TTFT of the later turns (2..n) with forced misses minus with the cache, in ms (cold − warm).
    None without a later turn timed on both sides."""
    warm = [r.ttft_s for r in with_cache[1:] if r.ttft_s is not None]
    cold = [r.ttft_s for r in forced_miss[1:] if r.ttft_s is not None]
    if not warm or not cold:
        return None
    return 1000 * (sum(cold) / len(cold) - sum(warm) / len(warm))


def prefix_figure(with_cache: Sequence[PrefixRow], forced_miss: Sequence[PrefixRow]) -> go.Figure:
    """Left: TTFT per user turn, prefix cache vs forced misses. Right: prompt tokens per turn,
    split into served-from-cache and computed."""
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=("time to first token (ms)", "prompt tokens: from cache vs computed"),
    )
    for rows, name, c, pat in (
        (with_cache, "prefix cache on", A_COLOR, ""),
        (forced_miss, "forced misses (fresh cache_salt)", B_COLOR, "/"),
    ):
        fig.add_trace(
            go.Bar(
                x=[f"turn {r.turn}" for r in rows],
                y=[None if r.ttft_s is None else 1000 * r.ttft_s for r in rows],
                name=name,
                marker=dict(color=c, pattern_shape=pat),
                legendgroup=name,
                text=["" if r.ttft_s is None else f"{1000 * r.ttft_s:.0f}" for r in rows],
                textposition="outside",
                cliponaxis=False,
            ),
            row=1,
            col=1,
        )
    rows = list(with_cache)
    fig.add_trace(
        go.Bar(
            x=[f"turn {r.turn}" for r in rows],
            y=[r.cached_tokens for r in rows],
            name="served from the prefix cache",
            marker=dict(color=_O["bluish_green"]),
            legendgroup="cached",
        ),
        row=1,
        col=2,
    )
    fig.add_trace(
        go.Bar(
            x=[f"turn {r.turn}" for r in rows],
            y=[r.prompt_tokens - r.cached_tokens for r in rows],
            name="computed (prefill)",
            marker=dict(color=_O["orange"], pattern_shape="x"),
            legendgroup="computed",
        ),
        row=1,
        col=2,
    )
    fig.update_layout(barmode="group")
    # stack only the right panel's two traces
    fig.update_traces(offsetgroup="tok", selector=dict(legendgroup="cached"))
    fig.update_traces(offsetgroup="tok", base=[r.cached_tokens for r in rows], selector=dict(legendgroup="computed"))
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, "Shared system prompt: TTFT with the prefix cache vs forced misses", height=360)


def waiting_reasons(rec: RunRecord, limit: int = 6) -> list[tuple[str, int]]:
    """The engine's waiting reasons seen during the run, with the most requests waiting for
    that reason at any one step (so the numbers are never double-counted across steps). The
    bare "queued" of a request not yet considered by the scheduler is left out."""
    peak: dict[str, int] = {}
    for s in rec.series:
        now: dict[str, int] = {}
        for r in s.requests:
            if r.state in ("waiting", "preempted", "swapped") and r.waiting_reason and r.waiting_reason != "queued":
                key = r.waiting_reason.split(":")[0] if r.waiting_reason.startswith("preempted") else r.waiting_reason
                now[key] = now.get(key, 0) + 1
        for k, v in now.items():
            peak[k] = max(peak.get(k, 0), v)
    return sorted(peak.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
