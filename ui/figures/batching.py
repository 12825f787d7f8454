"""Continuous batching, step by step: which requests were in each forward pass, and as what.

Built from the engine's SCHEDULE events (one per forward pass; rows [request_id, kind,
num_tokens, start]) plus the events that make a request leave the batch (finish, abort,
preempt, swap out, evict). Pure functions; no Streamlit.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import plotly.graph_objects as go

from engine.observe.trace_events import ABORT, EVICT, FINISH, PREEMPT, SCHEDULE, SWAP_OUT, Event
from ui.figures import theme

ROW_KINDS = ("prefill", "decode", "verify")
KIND_COLORS = {
    "prefill": theme.PHASE_COLORS["prefill"],
    "decode": theme.PHASE_COLORS["decode"],
    "verify": theme.OKABE_ITO["bluish_green"],
}
KIND_SYMBOLS = {"prefill": "square", "decode": "square", "verify": "diamond"}
LEAVE_KINDS = {FINISH: "finished", ABORT: "aborted", PREEMPT: "preempted", SWAP_OUT: "swapped out", EVICT: "evicted"}
LEAVE_SYMBOLS = {
    "finished": "line-ns-open",
    "aborted": "x-thin-open",
    "preempted": "x-thin-open",
    "swapped out": "x-thin-open",
    "evicted": "x-thin-open",
}
MAX_STEPS = 160  # the figure shows at most the last MAX_STEPS forward passes
MAX_REQUESTS = 40  # and at most this many requests (the most recent to join)


@dataclass(frozen=True, slots=True)
class Cell:
    step: int
    request_id: str
    kind: str  # prefill | decode | verify
    num_tokens: int
    start: int


@dataclass(frozen=True, slots=True)
class BatchGrid:
    steps: tuple[int, ...]  # steps that ran a forward pass, ascending
    request_ids: tuple[str, ...]  # in the order they first joined a batch
    cells: tuple[Cell, ...]
    leaves: tuple[tuple[int, str, str], ...]  # (step, request_id, why)
    forward_s: tuple[float, ...]  # forward time of each step in `steps`
    dropped_steps: int = 0  # earlier steps not shown
    dropped_requests: int = 0

    def batch_size(self, step: int) -> int:
        return sum(1 for c in self.cells if c.step == step)


def batch_grid(events: Sequence[Event], max_steps: int = MAX_STEPS, max_requests: int = MAX_REQUESTS) -> BatchGrid:
    """The step x request grid from a run's events (any order; other kinds are ignored)."""
    sched = sorted((e for e in events if e.kind == SCHEDULE), key=lambda e: (e.step, e.seq))
    all_steps = sorted({e.step for e in sched})
    shown = set(all_steps[-max_steps:]) if max_steps > 0 else set()
    cells: list[Cell] = []
    fwd: dict[int, float] = {}
    for e in sched:
        if e.step not in shown:
            continue
        fwd[e.step] = fwd.get(e.step, 0.0) + float(e.data.get("forward_s") or 0.0)
        for row in e.data.get("rows") or ():
            if not isinstance(row, (list, tuple)) or len(row) < 3:
                continue
            rid, kind, n = str(row[0]), str(row[1]), int(row[2])
            start = int(row[3]) if len(row) > 3 else 0
            cells.append(Cell(e.step, rid, kind if kind in ROW_KINDS else "prefill", n, start))
    order: list[str] = []
    for c in cells:
        if c.request_id not in order:
            order.append(c.request_id)
    dropped_req = max(0, len(order) - max_requests)
    keep = set(order[dropped_req:])
    cells = [c for c in cells if c.request_id in keep]
    lo = min(shown) if shown else 0
    hi = max(shown) if shown else -1
    leaves = tuple(
        (e.step, e.request_id, LEAVE_KINDS[e.kind])
        for e in sorted(events, key=lambda e: e.seq)
        if e.kind in LEAVE_KINDS and e.request_id in keep and lo <= e.step <= hi
    )
    steps = tuple(sorted(shown))
    return BatchGrid(
        steps,
        tuple(order[dropped_req:]),
        tuple(cells),
        leaves,
        tuple(fwd.get(s, 0.0) for s in steps),
        len(all_steps) - len(shown),
        dropped_req,
    )


def batching_figure(grid: BatchGrid, height: int | None = None, title: str | None = None) -> go.Figure:
    """One row per request, one column per forward pass; a mark where the request was in that
    pass, coloured and shaped by what it did there, with leave marks one column to the right."""
    n_req = len(grid.request_ids)
    h = height or max(260, min(640, 120 + 16 * n_req))
    fig = go.Figure()
    for kind in ROW_KINDS:
        cs = [c for c in grid.cells if c.kind == kind]
        if not cs:
            continue
        fig.add_trace(
            go.Scatter(
                x=[c.step for c in cs],
                y=[c.request_id for c in cs],
                mode="markers",
                name=kind,
                marker=dict(
                    symbol=KIND_SYMBOLS[kind],
                    color=KIND_COLORS[kind],
                    size=9 if kind != "prefill" else 11,
                    line=dict(width=0),
                ),
                customdata=[[c.num_tokens, c.start] for c in cs],
                hovertemplate=f"step %{{x}} · %{{y}}<br>{kind}: %{{customdata[0]}} token(s) from position "
                "%{customdata[1]}<extra></extra>",
            )
        )
    if grid.leaves:
        for why in sorted({w for _, _, w in grid.leaves}):
            ls = [lv for lv in grid.leaves if lv[2] == why]
            fig.add_trace(
                go.Scatter(
                    x=[s + 0.5 for s, _, _ in ls],
                    y=[r for _, r, _ in ls],
                    mode="markers",
                    name=f"leaves: {why}",
                    marker=dict(
                        symbol=LEAVE_SYMBOLS.get(why, "x-thin-open"),
                        size=10,
                        color=theme.PHASE_COLORS["preempted"] if why != "finished" else theme.INK,
                        line=dict(width=2),
                    ),
                    hovertemplate=f"step %{{x:.0f}} · %{{y}} {why}<extra></extra>",
                )
            )
    t = title or "Continuous batching: who was in each forward pass"
    if grid.dropped_steps:
        t += f" (last {len(grid.steps)} steps)"
    fig.update_layout(**theme.base_layout(h, t, margin=dict(l=70, r=15, t=78, b=45)))
    fig.update_layout(
        title=dict(y=0.985, yref="container", yanchor="top"),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0, font=dict(size=11)),
    )
    fig.update_xaxes(title_text="engine step (one forward pass each)", gridcolor=theme.GRID, zerolinecolor=theme.GRID)
    fig.update_yaxes(
        title_text="request",
        type="category",
        categoryorder="array",
        categoryarray=list(reversed(grid.request_ids)),
        gridcolor=theme.GRID,
        tickfont=dict(size=10),
    )
    if not grid.cells:
        fig.add_annotation(
            text="no forward pass recorded yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
    return fig


def batch_summary(grid: BatchGrid) -> str:
    """One escaped sentence: passes shown, largest batch, mix of row kinds."""
    if not grid.steps:
        return "No forward pass recorded."
    sizes = [grid.batch_size(s) for s in grid.steps]
    counts = {k: sum(1 for c in grid.cells if c.kind == k) for k in ROW_KINDS}
    mixed = sum(1 for s in grid.steps if len({c.kind for c in grid.cells if c.step == s}) > 1)
    parts = ", ".join(f"{v} {k} row(s)" for k, v in counts.items() if v)
    return html.escape(
        f"{len(grid.steps)} forward passes shown (steps {grid.steps[0]}–{grid.steps[-1]}); up to {max(sizes)} "
        f"requests in one pass; {parts}; {mixed} pass(es) mixed prefill chunks with decode rows."
    )
