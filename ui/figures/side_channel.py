"""The Prefix cache page's side-channel section (seed 002's warning): figures and summary rows,
pure functions of engine.side_channel probes (the section is ui/widgets/side_channel_view.py)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.lab import side_channel as sc
from ui.figures import theme

_O = theme.OKABE_ITO
CELL_STYLE = {
    True: ("victim's prefix cached", _O["bluish_green"], "circle"),
    False: ("prefix never seen", _O["vermillion"], "x"),
}
MODE_TITLES = {"shared": "one cache namespace for both tenants", "salted": "per-tenant cache_salt"}


def ttft_figure(probes: list[sc.Probe], thr: float | None) -> go.Figure:
    """Each probe's TTFT (ms) by mode and truth, as box + points; the attacker's threshold as a line."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.06,
        subplot_titles=tuple(MODE_TITLES[m] for m in sc.MODES),
    )
    for col, mode in enumerate(sc.MODES, start=1):
        for cached in (True, False):
            name, color, symbol = CELL_STYLE[cached]
            ys = [1000 * p.ttft_s for p in probes if p.mode == mode and p.cached == cached]
            fig.add_trace(
                go.Box(
                    y=ys,
                    name=name,
                    marker=dict(color=color, symbol=symbol),
                    boxpoints="all",
                    jitter=0.4,
                    pointpos=0,
                    legendgroup=name,
                    showlegend=col == 1,
                    hovertemplate="%{y:.1f} ms<extra>" + name + "</extra>",
                ),
                row=1,
                col=col,
            )
        if thr is not None:
            fig.add_hline(
                y=1000 * thr,
                line=dict(color=theme.INK, dash="dash", width=1),
                row=1,
                col=col,
                annotation_text="attacker's threshold" if col == 1 else None,
                annotation_position="top left",
            )
    fig.update_yaxes(title_text="attacker's TTFT (ms)", row=1, col=1, rangemode="tozero", gridcolor=theme.GRID)
    fig.update_layout(
        **theme.base_layout(360, "Can a second tenant tell from its own TTFT?", margin=dict(l=60, r=15, t=64, b=80))
    )
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.12, xanchor="left", x=0))
    return fig


def summary_rows(probes: list[sc.Probe], prefix_tokens: int) -> list[dict]:
    """One row per mode: medians and spread of each truth, the threshold guess's accuracy, the
    cross-tenant hit rate (the sharing a salt gives up), contended probes."""
    thr = sc.threshold(probes)
    rows = []
    for mode in sc.MODES:
        row = {"setting": MODE_TITLES[mode]}
        for cached, key in ((True, "cached"), (False, "fresh")):
            vals = [p.ttft_s for p in probes if p.mode == mode and p.cached == cached]
            if vals:
                s = sc.spread(vals)
                row[f"TTFT {key}: median (IQR) ms"] = (
                    f"{1000 * s.median:.1f} ({1000 * s.q1:.1f}–{1000 * s.q3:.1f}), n={s.n}"
                )
        acc = sc.accuracy(probes, mode, thr)
        hr = sc.hit_rate(probes, mode, prefix_tokens)
        row["threshold guess right"] = "—" if acc is None else f"{100 * acc:.0f}%"
        row["victim's prefix served from cache"] = "—" if hr is None else f"{100 * hr:.0f}%"
        ps = [p for p in probes if p.mode == mode]
        row["contended probes"] = f"{sum(p.contended for p in ps)} / {len(ps)}"
        rows.append(row)
    return rows
