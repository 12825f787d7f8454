"""Concurrent-load views: pure figure builders over a bounded series of Snapshots (the feeder
that submits a workload and the recorder live in engine/observe/recording.py).

Figures here take `Snapshot`s (and `Event`s) and return Plotly figures; no Streamlit. The same
functions draw the live page and the replay page, so everything shown can be rebuilt from a trace.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import plotly.graph_objects as go

from engine.observe.snapshot import RequestState, Snapshot
from ui.figures import theme

MAX_GROWTH_LINES = 24  # per-request cache-growth lines drawn at most
PERCENTILES = (50, 90, 99)


def _t(series: Sequence[Snapshot], t0: float | None) -> tuple[list[float], float]:
    base = series[0].time if (t0 is None and series) else (t0 or 0.0)
    return [s.time - base for s in series], base


def _layout(
    fig: go.Figure, title: str, ytitle: str, xtitle: str = "time since start (s)", height: int = 330
) -> go.Figure:
    """Title at the top of the figure, legend in its own band under it (never over the title or
    the data), fixed height."""
    fig.update_layout(**theme.base_layout(height, title, margin=dict(l=55, r=15, t=78, b=45)))
    fig.update_layout(
        title=dict(y=0.985, yref="container", yanchor="top"),
        xaxis_title=xtitle,
        yaxis_title=ytitle,
        hovermode="x unified",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0, font=dict(size=11)),
    )
    fig.update_xaxes(gridcolor=theme.GRID, zerolinecolor=theme.GRID)
    fig.update_yaxes(gridcolor=theme.GRID, zerolinecolor=theme.GRID)
    return fig


# Line colours for request states: the phase colours of ui.figures.theme, except "waiting", whose
# light-grey phase fill is too faint for a line. Each state also has its own dash pattern.
STATE_COLORS = {
    "running": theme.PHASE_COLORS["decode"],
    "waiting": "#7F7F7F",
    "preempted": theme.PHASE_COLORS["preempted"],
    "swapped": theme.PHASE_COLORS["swapped"],
}
STATE_DASH = {"running": "solid", "waiting": "dash", "preempted": "dot", "swapped": "dashdot"}
PERCENTILE_COLORS = {50: theme.OKABE_ITO["blue"], 90: theme.OKABE_ITO["orange"], 99: theme.OKABE_ITO["vermillion"]}
USED_COLOR = theme.REQUEST_COLORS[0]
CACHED_COLOR = theme.BLOCK_STATES[theme.CACHED].color


# ------------------------------------------------------------------ queue counts

COUNT_FIELDS = (
    ("running", "num_running"),
    ("waiting", "num_waiting"),
    ("preempted", "num_preempted"),
    ("swapped", "num_swapped"),
)


def counts_over_time(series: Sequence[Snapshot]) -> dict[str, list[int]]:
    return {name: [getattr(s.metrics, attr) for s in series] for name, attr in COUNT_FIELDS}


def counts_figure(series: Sequence[Snapshot], t0: float | None = None) -> go.Figure:
    xs, _ = _t(series, t0)
    counts = counts_over_time(series)
    fig = go.Figure()
    for name, _attr in COUNT_FIELDS:
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=counts[name],
                name=name,
                mode="lines",
                line=dict(color=STATE_COLORS[name], width=2, dash=STATE_DASH[name], shape="hv"),
            )
        )
    return _layout(fig, "Requests by state", "requests")


# ------------------------------------------------------------------ KV usage vs budget


def kv_usage_over_time(series: Sequence[Snapshot]) -> dict[str, list[float]]:
    return {
        "used": [s.metrics.num_blocks_used for s in series],
        "cached": [s.metrics.num_blocks_cached for s in series],
        "budget": [s.info.num_blocks for s in series],
        "usage_perc": [s.metrics.kv_cache_usage_perc for s in series],
    }


def kv_usage_figure(series: Sequence[Snapshot], t0: float | None = None) -> go.Figure:
    xs, _ = _t(series, t0)
    u = kv_usage_over_time(series)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=u["used"],
            name="used by requests",
            mode="lines",
            stackgroup="kv",
            line=dict(color=USED_COLOR, width=1.5, shape="hv"),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=u["cached"],
            name="cached (free, reusable)",
            mode="lines",
            stackgroup="kv",
            line=dict(color=CACHED_COLOR, width=1.5, shape="hv"),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=u["budget"],
            name="budget (pool size)",
            mode="lines",
            line=dict(color=theme.INK, width=2, dash="dash", shape="hv"),
        )
    )
    ytitle = "blocks"
    if series:
        i = series[-1].info
        ytitle = f"blocks ({i.block_size} tokens, {format_bytes(i.bytes_per_block)} each)"
    fig = _layout(fig, "KV blocks in use vs budget", ytitle)
    fig.update_yaxes(rangemode="tozero")
    return fig


# ------------------------------------------------------------------ per-request cache growth


def growth_lines(
    series: Sequence[Snapshot], max_lines: int = MAX_GROWTH_LINES
) -> dict[str, tuple[list[float], list[int]]]:
    """request_id -> (times, cached tokens). Uses the request's own per-step history from the
    latest snapshot it appears in when it has one (full resolution); otherwise the sampled series,
    from the first snapshot where the request holds KV to the one where it finished (its drop to
    0). Keeps the `max_lines` requests with the largest peak (ties: most recent arrival)."""
    latest: dict[str, object] = {}
    sampled: dict[str, tuple[list[float], list[int]]] = {}
    done: set[str] = set()
    for s in series:
        for r in s.requests:
            if r.request_id in done:
                continue  # finished: its line ended with the drop to 0
            latest[r.request_id] = r
            xs, ys = sampled.setdefault(r.request_id, ([], []))
            if not ys and r.num_computed_tokens == 0 and (r.state == RequestState.WAITING or r.is_terminal):
                continue  # not started yet (or never started): no line until it holds KV
            xs.append(s.time)
            ys.append(r.num_computed_tokens)
            if r.is_terminal:
                done.add(r.request_id)
    lines: dict[str, tuple[list[float], list[int]]] = {}
    for rid, r in latest.items():
        if not r.history and not sampled.get(rid, ([], []))[1]:
            continue
        if r.history:
            lines[rid] = ([h.time for h in r.history], [h.num_cached_tokens for h in r.history])
        else:
            lines[rid] = sampled[rid]
    order = sorted(lines, key=lambda rid: (max(lines[rid][1], default=0), latest[rid].arrival_time, rid), reverse=True)
    return {rid: lines[rid] for rid in order[:max_lines]}


def growth_figure(series: Sequence[Snapshot], t0: float | None = None, max_lines: int = MAX_GROWTH_LINES) -> go.Figure:
    _, base = _t(series, t0)
    bpt = series[-1].info.bytes_per_token if series else 0
    all_lines = growth_lines(series, max_lines=1_000_000)
    lines = dict(list(all_lines.items())[:max_lines])
    colors = theme.RequestColors(sorted(lines, key=lambda rid: (lines[rid][0][:1], rid)))
    fig = go.Figure()
    for rid, (xs, ys) in sorted(lines.items()):
        fig.add_trace(
            go.Scatter(
                x=[x - base for x in xs],
                y=ys,
                name=_safe(rid),
                mode="lines",
                line=dict(color=colors.color(rid), width=1.5, shape="hv"),
                customdata=[y * bpt for y in ys],
                showlegend=False,
                hovertemplate=f"{_safe(rid)}<br>%{{y}} tokens = %{{customdata:,}} bytes<extra></extra>",
            )
        )
    n_all = len(all_lines)
    title = "KV cache per request (tokens held)"
    if n_all > len(lines):
        title += f" — {len(lines)} largest of {n_all} shown"
    fig = _layout(fig, title, f"tokens in cache ({bpt:,} bytes each)" if bpt else "tokens in cache")
    fig.update_layout(hovermode="closest")
    return fig


def format_bytes(n: int) -> str:
    return f"{n:,} B" if n < 1024 else f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def _safe(s: str) -> str:
    # Plotly renders a small HTML subset in hover/labels: escape request ids.
    import html

    return html.escape(s)


# ------------------------------------------------------------------ latency percentiles


def percentile(values: Sequence[float], p: float) -> float | None:
    """numpy's linear-interpolated percentile of the values (None and NaN skipped); None when empty."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    return float(np.percentile(v, p)) if v else None


def latency_percentiles(snap: Snapshot | None) -> dict[str, dict[int, float | None]]:
    """{"ttft": {50: s, 90: s, 99: s}, "e2e": {...}, "tpot": {...}} from the engine's metrics."""
    m = snap.metrics if snap is not None else None
    out = {}
    for name, attr in (("ttft", "ttft_s"), ("e2e", "e2e_latency_s"), ("tpot", "tpot_s")):
        vals = getattr(m, attr) if m is not None else ()
        out[name] = {p: percentile(vals, p) for p in PERCENTILES}
    return out


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{1000 * v:.0f} ms" if v < 10 else f"{v:.1f} s"


def percentile_table_html(pct: dict[str, dict[int, float | None]], counts: dict[str, int] | None = None) -> str:
    """p50/p90/p99 of TTFT, TPOT and end-to-end latency as a small HTML table (numbers only)."""
    names = (("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "end-to-end latency"))
    head = "".join(f"<th style='text-align:right;padding:2px 10px'>p{p}</th>" for p in PERCENTILES)
    rows = []
    for key, label in names:
        n = f" <span style='color:#666'>(n={counts[key]})</span>" if counts and key in counts else ""
        cells = "".join(
            f"<td style='text-align:right;padding:2px 10px'>{_fmt_s(pct[key][p])}</td>" for p in PERCENTILES
        )
        rows.append(f"<tr><td style='padding:2px 10px'>{label}{n}</td>{cells}</tr>")
    return (
        "<table style='border-collapse:collapse;font-size:0.9rem'><tr><th></th>"
        + head
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def percentile_counts(snap: Snapshot | None) -> dict[str, int]:
    if snap is None:
        return {"ttft": 0, "tpot": 0, "e2e": 0}
    m = snap.metrics
    return {"ttft": len(m.ttft_s), "tpot": len(m.tpot_s), "e2e": len(m.e2e_latency_s)}


def percentiles_over_time(series: Sequence[Snapshot], metric: str = "ttft") -> dict[int, list[float | None]]:
    return {p: [latency_percentiles(s)[metric][p] for s in series] for p in PERCENTILES}


def percentiles_figure(series: Sequence[Snapshot], t0: float | None = None) -> go.Figure:
    xs, _ = _t(series, t0)
    fig = go.Figure()
    for metric, label in (("ttft", "TTFT"), ("e2e", "latency")):
        pts = percentiles_over_time(series, metric)
        for p in PERCENTILES:
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=pts[p],
                    name=f"{label} p{p}",
                    mode="lines",
                    connectgaps=False,
                    line=dict(
                        color=PERCENTILE_COLORS[p], width=2, dash="solid" if metric == "ttft" else "dot", shape="hv"
                    ),
                )
            )
    fig = _layout(fig, "TTFT (solid) and end-to-end latency (dotted) percentiles", "seconds")
    fig.update_yaxes(rangemode="tozero")
    return fig


# ------------------------------------------------------------------ feeder


def run_request_ids_pending(snap: Snapshot | None, request_ids: Iterable[str]) -> int:
    """How many of `request_ids` are still waiting, running or swapped in `snap`."""
    if snap is None:
        return 0
    live = set(snap.waiting_ids) | set(snap.running_ids) | set(snap.swapped_ids)
    return sum(1 for r in request_ids if r in live)


# ------------------------------------------------------------------ requests from other doors


def origin_rows(snap: Snapshot | None, origin: str = "http") -> list:
    """The snapshot's requests submitted through `origin` ("http": the OpenAI API), live first."""
    if snap is None:
        return []
    return [r for r in snap.requests if getattr(r, "origin", "app") == origin]


def origin_html(snap: Snapshot | None, origin: str = "http", max_rows: int = 12) -> str:
    """One line per request that came in through the HTTP API (escaped), or "" when there are none."""
    import html

    rows = origin_rows(snap, origin)
    if not rows:
        return ""
    live = sum(1 for r in rows if not r.is_terminal)
    items = "".join(
        f"<li><code>{html.escape(r.request_id)}</code> · {html.escape(r.state)}"
        f"{' (' + html.escape(r.finish_reason) + ')' if r.finish_reason else ''} · prompt {r.prompt_len}, "
        f"output {r.output_len} tokens · {len(r.block_table)} blocks</li>"
        for r in rows[:max_rows]
    )
    more = f"<li>… and {len(rows) - max_rows} more</li>" if len(rows) > max_rows else ""
    return (
        f"<div class='kv-origin'><b>From the HTTP API ({html.escape(origin)})</b>: {live} live, "
        f"{len(rows) - live} recently ended<ul>{items}{more}</ul></div>"
    )
