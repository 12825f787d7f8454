"""The Cache vs no-cache page's first half: the measured decode cost per token with and without the
KV cache (engine.recording.CostPoint), its summary, the straight-line fit and the figure."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.observe.recording import CostPoint
from ui.figures import theme


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
        (with_cache, "with KV cache", theme.COMPARE_A, "solid"),
        (without_cache, "no KV cache (recompute the prefix)", theme.COMPARE_B, "dash"),
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
    return theme.comparison_layout(fig, "Measured decode cost with and without the KV cache", height=370)


def cumulative_fed(points: Sequence[CostPoint]) -> list[int]:
    out, acc = [], 0
    for p in points:
        acc += p.fed_tokens
        out.append(acc)
    return out
