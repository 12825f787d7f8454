"""The Paged vs contiguous page's numbers and figures: allocated vs filled KV slots per step, waste
and concurrency, read from the two allocator runs' records (engine.recording.RunRecord)."""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.observe.recording import RunRecord
from engine.observe.snapshot import Snapshot
from engine.observe.trace_events import ADMIT, PREEMPT, REJECT, WAIT
from ui.figures import theme

FILLED_COLOR, ALLOC_COLOR = theme.OKABE_ITO["blue"], theme.OKABE_ITO["orange"]


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
    theme.comparison_layout(fig, "Allocated vs filled KV slots, same workload, same budget", height=360)
    fig.update_layout(hovermode="x unified")
    return fig


def allocator_bars(sa: dict, sb: dict) -> go.Figure:
    """Waste % and concurrency side by side."""
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=("waste: slots reserved but empty (%)", "requests")
    )
    labels = [html.escape(str(sa["label"])), html.escape(str(sb["label"]))]
    for i, (s, c) in enumerate(((sa, theme.COMPARE_A), (sb, theme.COMPARE_B))):
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
    theme.comparison_layout(fig, "Waste and concurrency", height=340, barmode="group")
    return fig
