"""The Cache vs no-cache page's second half, the seed's exercise: growing sequences against a fixed
KV budget on three engines (no eviction, reservation, LRU preemption): demand vs held slots per
step, when each crossed the budget, the engine's waiting reasons (engine.recording.RunRecord)."""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.observe.recording import RunRecord
from engine.observe.snapshot import Snapshot
from engine.observe.trace_events import PREEMPT, REJECT, SWAP_OUT, WAIT
from ui.figures import theme

LIVE_STATES = ("waiting", "running", "preempted", "swapped")


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
                line=dict(color=theme.COMPARE_B, width=2, dash="dash", shape="hv"),
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
                line=dict(color=theme.COMPARE_A, width=2, shape="hv"),
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
                line=dict(color=theme.OKABE_ITO["bluish_green"], width=2, dash="dashdot", shape="hv"),
                showlegend=first,
                legendgroup="finished",
            ),
            row=1,
            col=col,
            secondary_y=True,
        )
        over = first_held_over_budget(rec)
        if over is not None:
            fig.add_vline(x=over, line=dict(color=theme.COMPARE_B, width=1.5, dash="dot"), row=1, col=col)
            fig.add_annotation(
                x=over,
                y=1,
                yref="y domain" if col == 1 else f"y{2 * col - 1} domain",
                xref="x" if col == 1 else f"x{col}",
                text=f" KV use > budget at step {over}",
                showarrow=False,
                xanchor="left",
                yanchor="top",
                font=dict(size=11, color=theme.COMPARE_B),
            )
        fig.update_xaxes(title_text="engine step", row=1, col=col)
    fig.update_yaxes(title_text="tokens", row=1, col=1, secondary_y=False, rangemode="tozero")
    n_max = max((max(exercise_rows(r)["finished"], default=0) for r in runs), default=0)
    step = next((d for d in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500) if n_max / d <= 6), 1000)
    fig.update_yaxes(rangemode="tozero", secondary_y=True, showgrid=False, tick0=0, dtick=step)
    return theme.comparison_layout(fig, "Growing sequences vs a fixed KV budget", height=390)


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
