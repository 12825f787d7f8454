"""The Prefix cache page's measurement: TTFT and cached tokens of the same turns with the prefix
cache and with forced misses (engine.experiments.PrefixRow), its summary and figure."""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.lab.experiments import PrefixRow
from engine.observe.rates import prefix_hit_rate
from ui.figures import theme


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
        (with_cache, "prefix cache on", theme.COMPARE_A, ""),
        (forced_miss, "forced misses (fresh cache_salt)", theme.COMPARE_B, "/"),
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
            marker=dict(color=theme.OKABE_ITO["bluish_green"]),
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
            marker=dict(color=theme.OKABE_ITO["orange"], pattern_shape="x"),
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
    return theme.comparison_layout(fig, "Shared system prompt: TTFT with the prefix cache vs forced misses", height=360)
