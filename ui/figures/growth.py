"""Per-request cache growth and prefill/decode phases: pure functions of a RequestInfo.

x axes count engine steps since the request arrived (deterministic for a given workload), so a
recorded or test run draws the same picture every time; wall-clock numbers (TTFT, tokens/s) are
reported beside the figures by `phase_stats`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.observe import rates
from engine.observe.snapshot import HistoryPoint

from . import theme

PHASES = ("waiting", "prefill", "decode", "preempted", "swapped", "finished")


@dataclass(frozen=True, slots=True)
class PhaseStats:
    ttft_s: float | None  # arrival → first generated token
    decode_tok_s: float | None  # tokens after the first / time from the first to the newest (1 / TPOT)
    e2e_s: float | None  # arrival → finish (None while running)
    prefill_steps: int
    decode_steps: int
    output_tokens: int
    prompt_tokens: int


def phase_stats(req, now: float | None = None) -> PhaseStats:
    ttft = rates.ttft(req.arrival_time, req.first_token_time)
    # the decode rate as the engine's TPOT defines it (rates.decode_rate): up to the newest token
    # (snapshots without token times: the finish, or `now` while it runs)
    end = next((t for t in (req.last_token_time, req.finish_time, now) if t is not None), None)
    tps = rates.decode_rate(req.first_token_time, end, req.output_len)
    e2e = rates.e2e_latency(req.arrival_time, req.finish_time)
    steps = {}
    for p in req.history:
        steps.setdefault(p.phase, set()).add(p.step)
    return PhaseStats(
        ttft, tps, e2e, len(steps.get("prefill", ())), len(steps.get("decode", ())), req.output_len, req.prompt_len
    )


def phase_segments(history) -> list[tuple[str, int, int]]:
    """Consecutive runs of one phase as (phase, first step, last step), steps relative to the
    first history point."""
    segs: list[list] = []
    if not history:
        return []
    s0 = history[0].step
    for p in history:
        rel = p.step - s0
        if segs and segs[-1][0] == p.phase:
            segs[-1][2] = rel
        else:
            segs.append([p.phase, rel, rel])
    return [tuple(s) for s in segs]


def _with_drops(hist, evict_steps):
    """History plus a zero point at each eviction step (from the engine's evict events: its
    blocks were freed and its cached tokens dropped there), after that step's own points, so
    the lines fall to zero and the recompute shows as regrowth."""
    if not evict_steps:
        return list(hist)
    out = list(hist)
    for s in sorted(set(evict_steps)):
        i = 0
        while i < len(out) and out[i].step <= s:
            i += 1
        out.insert(i, HistoryPoint(s, out[i - 1].time if i else 0.0, 0, 0, 0, "evicted"))
    return out


def growth_figure(req, block_size: int, *, evict_steps=(), height: int = 430, title: str | None = None) -> go.Figure:
    """Top: tokens whose K/V are in the pool, and slots allocated (whole blocks) per step.
    Bottom: K/V bytes held. Background bands: the phase at each step. Evictions (engine steps of
    its evict events): dashed lines, where the lines drop to zero before the recompute."""
    hist = tuple(req.history)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4])
    if not hist:
        fig.add_annotation(text="no history yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        fig.update_layout(**theme.base_layout(height, title))
        return fig
    s0 = hist[0].step
    line = _with_drops(hist, evict_steps)
    x = [p.step - s0 for p in line]
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[p.num_cached_tokens for p in line],
            name="tokens in cache",
            mode="lines+markers",
            marker=dict(size=4),
            line=dict(color=theme.INK, width=2),
            hovertemplate="step +%{x}: %{y} tokens<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[p.num_blocks * block_size for p in line],
            name="slots allocated (whole blocks)",
            mode="lines",
            line=dict(color=theme.OKABE_ITO["blue"], width=2, dash="dot", shape="hv"),
            hovertemplate="step +%{x}: %{y} slots<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[p.kv_bytes for p in line],
            name="K/V bytes",
            mode="lines",
            line=dict(color=theme.OKABE_ITO["vermillion"], width=2),
            fill="tozeroy",
            fillcolor="rgba(213,94,0,0.12)",
            hovertemplate="step +%{x}: %{y:,} bytes<extra></extra>",
        ),
        row=2,
        col=1,
    )
    seen = set()
    for phase, a, b in phase_segments(hist):
        color = theme.PHASE_COLORS.get(phase, "#EEEEEE")
        for yref in ("y domain", "y2 domain"):
            fig.add_shape(
                type="rect",
                xref="x",
                yref=yref,
                x0=a - 0.5,
                x1=b + 0.5,
                y0=0,
                y1=1,
                fillcolor=color,
                opacity=0.13,
                line_width=0,
                layer="below",
            )
        if phase not in seen:
            seen.add(phase)
            fig.add_trace(
                go.Scatter(
                    x=[None],
                    y=[None],
                    mode="markers",
                    name=f"phase: {phase}",
                    marker=dict(symbol="square", size=11, color=color, opacity=0.5),
                ),
                row=1,
                col=1,
            )
    for s in evict_steps:
        rel = s - s0
        if rel < 0:
            continue
        fig.add_vline(x=rel, line=dict(color=theme.OKABE_ITO["reddish_purple"], width=2, dash="dash"))
        fig.add_annotation(
            x=rel,
            y=1,
            xref="x",
            yref="y domain",
            text="↻ evicted",
            showarrow=False,
            yanchor="bottom",
            font=dict(size=10, color="#7A3D66"),
        )
    t = title if title is not None else f"cache growth of {theme.short_id(req.request_id, 24)}"
    fig.update_layout(**theme.base_layout(height, t, margin=dict(l=60, r=15, t=36, b=110)))
    fig.update_layout(legend=dict(orientation="h", y=-0.2, yanchor="top", x=0, font=dict(size=10)))
    fig.update_yaxes(title_text="tokens / slots", row=1, col=1, gridcolor=theme.GRID, rangemode="tozero")
    fig.update_yaxes(title_text="bytes", row=2, col=1, gridcolor=theme.GRID, rangemode="tozero", tickformat="~s")
    fig.update_xaxes(title_text="engine steps since arrival", row=2, col=1, gridcolor=theme.GRID)
    fig.update_xaxes(gridcolor=theme.GRID, row=1, col=1)
    return fig


def phase_figure(req, *, height: int = 150, stats: PhaseStats | None = None) -> go.Figure:
    """One horizontal bar per phase run (steps since arrival), prefill hatched, decode solid."""
    segs = phase_segments(tuple(req.history))
    fig = go.Figure()
    seen = set()
    for phase, a, b in segs:
        fig.add_trace(
            go.Bar(
                y=["phases"],
                x=[b - a + 1],
                base=[a - 0.5],
                orientation="h",
                name=phase,
                marker=dict(
                    color=theme.PHASE_COLORS.get(phase, "#EEEEEE"),
                    line=dict(color=theme.INK, width=1),
                    pattern=dict(
                        shape=theme.PHASE_PATTERNS.get(phase, ""), fgcolor="#FFFFFF", size=6, fillmode="overlay"
                    ),
                ),
                text=[phase if b - a >= 2 else ""],
                textposition="inside",
                insidetextanchor="middle",
                showlegend=phase not in seen,
                hovertemplate=f"{phase}: steps +{a}…+{b}<extra></extra>",
            )
        )
        seen.add(phase)
    title = "prefill vs decode (engine steps since arrival)"
    if stats is not None:
        bits = []
        bits.append(f"{stats.prefill_steps} prefill step(s) for {stats.prompt_tokens} prompt tokens")
        bits.append(f"{stats.decode_steps} decode step(s) for {stats.output_tokens} generated tokens")
        title += ": " + ", ".join(bits)
    fig.update_layout(**theme.base_layout(height, title, margin=dict(l=60, r=15, t=36, b=36)))
    fig.update_layout(
        barmode="overlay", bargap=0.35, showlegend=True, legend=dict(orientation="h", y=-0.45, yanchor="top", x=0)
    )
    fig.update_xaxes(title_text=None, gridcolor=theme.GRID, rangemode="tozero")
    fig.update_yaxes(showticklabels=False)
    return fig


def format_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def summary_line(req, stats: PhaseStats) -> str:
    """Escaped one-line HTML summary (request ids are user data)."""
    return (
        f"<b>{html.escape(theme.short_id(req.request_id, 32))}</b> · {html.escape(req.state)} · "
        f"prompt {req.prompt_len} tok · output {req.output_len} tok · "
        f"TTFT {format_seconds(stats.ttft_s)} · decode "
        f"{'—' if stats.decode_tok_s is None else f'{stats.decode_tok_s:.1f} tok/s'}"
    )
