"""The Prefix cache page's side-channel section (seed 002's warning): figures and summary rows,
pure functions of engine.side_channel probes (the timing channel) and of an
engine.lab.packet_channel result (the packet-size channel); the section is
ui/widgets/side_channel_view.py."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.lab import packet_channel as pc
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


# ------------------------------------------------------------------ the packet-size channel
SHORT = {"none": "no defence", "obfuscation": "obfuscation", "coalesce": "coalesced", "fixed": "fixed size"}
DEFENCE_COLORS = {
    "none": _O["vermillion"],
    "obfuscation": _O["blue"],
    "coalesce": _O["orange"],
    "fixed": _O["bluish_green"],
}


def packet_trace_figure(res: pc.PacketResult) -> go.Figure:
    """What the observer sees, one panel per defence (its first trial): each content record's
    length less the calibrated overhead, beside the bytes of each token of the answer streamed."""
    shown = [d for d in pc.DEFENCES if any(t.defence == d for t in res.trials)]
    fig = make_subplots(
        rows=1,
        cols=max(1, len(shown)),
        horizontal_spacing=0.05,
        subplot_titles=tuple(SHORT.get(d, d) for d in shown),
    )
    for col, d in enumerate(shown, start=1):
        t = next(t for t in res.trials if t.defence == d)
        seen = pc.recover_lengths(list(t.record_lengths), res.k, res.k_last)
        truth = list(res.candidate_sizes[t.truth]) if res.candidate_sizes else []
        fig.add_trace(
            go.Bar(
                x=list(range(1, len(seen) + 1)),
                y=seen,
                name="record length − overhead (observer)",
                marker_color=DEFENCE_COLORS[d],
                legendgroup="seen",
                showlegend=col == 1,
                hovertemplate="record %{x}: %{y} B<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(truth) + 1)),
                y=truth,
                mode="markers",
                name="token's text bytes (the answer)",
                marker=dict(color=theme.INK, symbol="line-ew-open", size=12, line=dict(width=2)),
                legendgroup="truth",
                showlegend=col == 1,
                hovertemplate="token %{x}: %{y} B<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="record / token", row=1, col=col, gridcolor=theme.GRID)
    fig.update_yaxes(title_text="bytes", row=1, col=1, gridcolor=theme.GRID)
    fig.update_layout(
        **theme.base_layout(
            370, "What an on-path observer reads from encrypted records", margin=dict(l=60, r=15, t=64, b=120)
        )
    )
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.32, xanchor="left", x=0), barmode="overlay")
    return fig


def packet_accuracy_figure(summaries: list[pc.DefenceSummary]) -> go.Figure:
    """The attack's two scores per defence as bars, each with its chance level as a tick."""
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=("answer picked among the candidates", "token lengths read right"),
    )
    for col, (val, chance) in enumerate((("accuracy", "chance"), ("length_accuracy", "length_chance")), start=1):
        xs = [SHORT.get(s.defence, s.label) for s in summaries]
        fig.add_trace(
            go.Bar(
                x=xs,
                y=[100 * getattr(s, val) for s in summaries],
                marker_color=[DEFENCE_COLORS[s.defence] for s in summaries],
                showlegend=False,
                hovertemplate="%{x}: %{y:.0f}%<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[100 * getattr(s, chance) for s in summaries],
                mode="markers",
                marker=dict(color=theme.INK, symbol="line-ew-open", size=28, line=dict(width=2)),
                name="chance",
                showlegend=col == 1,
                hovertemplate="chance %{y:.0f}%<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_yaxes(range=[0, 105], title_text="%" if col == 1 else None, row=1, col=col, gridcolor=theme.GRID)
    fig.update_layout(
        **theme.base_layout(340, "The same attack under each defence", margin=dict(l=60, r=15, t=64, b=80))
    )
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.15, xanchor="left", x=0))
    return fig


def packet_rows(summaries: list[pc.DefenceSummary]) -> list[dict]:
    """One row per defence: the attack's scores with chance, bits per token, and the defence's cost
    in bytes and time against no defence."""
    base = next((s for s in summaries if s.defence == "none"), None)
    rows = []
    for s in summaries:
        rows.append(
            {
                "defence": s.label,
                "answer guessed": f"{100 * s.accuracy:.0f}% (chance {100 * s.chance:.0f}%)",
                "token lengths read": f"{100 * s.length_accuracy:.0f}% (chance {100 * s.length_chance:.0f}%)",
                "bits per token": f"{s.bits_per_token:.2f}",
                "bytes per answer": f"{s.bytes_per_answer:,.0f}"
                + (f" ({s.bytes_per_answer / base.bytes_per_answer:.2f}×)" if base and s is not base else ""),
                "first content record, median ms": f"{1000 * s.first_s:.0f}"
                + (f" ({1000 * (s.first_s - base.first_s):+.0f})" if base and s is not base else ""),
                "whole answer, median ms": f"{1000 * s.total_s:.0f}"
                + (f" ({1000 * (s.total_s - base.total_s):+.0f})" if base and s is not base else ""),
                "trials": s.trials,
            }
        )
    return rows
