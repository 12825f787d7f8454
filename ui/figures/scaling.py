"""`bench scaling`'s figure (engine/bench/scaling.py): three panels from a stored result's fields —
TTFT against prompt length, decode tokens/s against context, output tokens/s against concurrent
requests — one line per engine and the machine's limit dashed beside them. Pure: a result's fields
in, a Plotly figure out (the Claims page and scripts/scaling_figure.py for docs/ both call it)."""

from __future__ import annotations

import re

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.bench import scaling_points as SP
from engine.model.kernel_isa import AMX_NOTE
from ui.figures import theme

ENGINE_COLORS = {
    "kvscope": theme.OKABE_ITO["blue"],
    "llamacpp": theme.OKABE_ITO["orange"],
    "vllm": theme.OKABE_ITO["bluish_green"],
}
ENGINE_SYMBOLS = {"kvscope": "circle", "llamacpp": "square", "vllm": "diamond"}
PANELS = (
    ("prefill", "TTFT (s) by prompt length", "prompt tokens"),
    ("decode", "decode tokens/s by context", "context tokens"),
    ("concurrency", "output tokens/s by requests", "concurrent requests"),
)


def subtitle(fields: dict, machine: dict | None = None, short: bool = False) -> str:
    """What the figure was measured on: CPU, cores, ISA (short: without the extension list, which
    the caption carries: "AVX-512", "AVX-512 + AMX for Q4_1"), threads."""
    m = machine or {}
    cpu = f"{m.get('cpu', '?')}, {m.get('nproc', '?')} cpus, " if m else ""
    isa = str(fields.get("isa", "?"))
    if short:
        head, _, rest = isa.partition(" (")
        isa = head + (rest.partition(")")[2] if rest else "")
    return f"{cpu}ISA {isa}, {fields.get('threads', '?')} thread(s)"


def scaling_figure(fields: dict, machine: dict | None = None, height: int = 420) -> go.Figure:
    rows = SP.table(fields)
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t, _ in PANELS], horizontal_spacing=0.08)
    for col, (axis, _, xlabel) in enumerate(PANELS, start=1):
        pts = [r for r in rows if r["axis"] == axis]
        for e in SP.ENGINES:
            xy = [(r["x"], r[e]) for r in pts if r[e] is not None]
            if not xy:
                continue
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in xy],
                    y=[y for _, y in xy],
                    name=SP.ENGINE_LABELS[e],
                    legendgroup=e,
                    showlegend=col == 1 or not any(r[e] is not None for r in rows if r["axis"] == "prefill"),
                    mode="lines+markers",
                    line=dict(color=ENGINE_COLORS[e], width=2),
                    marker=dict(symbol=ENGINE_SYMBOLS[e], size=8),
                    hovertemplate=f"{SP.ENGINE_LABELS[e]}: %{{y:.3g}} at %{{x}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        lim = [(r["x"], r["limit"]) for r in pts if r["limit"] is not None]
        if lim:
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in lim],
                    y=[y for _, y in lim],
                    name="machine limit (measured fp32 matmul rate, read bandwidth)",
                    legendgroup="limit",
                    showlegend=col == 1,
                    mode="lines",
                    line=dict(color=theme.INK, width=1.5, dash="dash"),
                    hovertemplate="limit: %{y:.3g} at %{x}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(type="log", title_text=xlabel, row=1, col=col)
        fig.update_yaxes(type="log", row=1, col=col)
    theme.comparison_layout(fig, f"Cost as work grows — {subtitle(fields, machine, short=True)}", height=height)
    return fig


def caption(fields: dict, source: str) -> str:
    """Plain text under the figure: where it came from, the goals measured, why a peer is missing."""
    rows = SP.table(fields)
    g = SP.goals(rows, fields)
    parts = [f"From {source}; {subtitle(fields)}."]
    rounds = (fields.get("grid") or {}).get("rounds", 1)
    if rounds > 1:
        times = f"at least {rounds}" if fields.get("runs", 1) > 1 else f"{rounds}"
        parts.append(f"Each point measured {times} times per engine, minutes apart; each engine's best is shown.")
    n, ok = g.get("points_vs_best_peer"), g.get("points_at_or_above_best_peer")
    if n:
        parts.append(
            f"kvscope at or above the best peer at {ok} of {n} points "
            f"(goal: all; worst {g['worst_vs_best_peer']:.2f}x)."
        )
    for k, v in g.items():
        if k.endswith("_of_limit") and v is not None:
            what, x = k.split("_")[:2]
            parts.append(f"{what} at {x} tokens: {v:.2f} of its limit (goal >= 0.6).")
    for e, why in (fields.get("peers") or {}).items():
        if not str(why).startswith("ok"):
            parts.append(f"{SP.ENGINE_LABELS.get(e, e)}: {why}.")
    parts.append("Limits are the machine's measured fp32 matmul rate (prefill) and read bandwidth (decode), dashed.")
    isa = str(fields.get("isa", ""))
    if AMX_NOTE in isa:
        rows = re.search(r"from (\d+) rows", isa)
        which = f" of {rows.group(1)} rows or more (prompts, batches)" if rows else ""
        parts.append(f"kvscope's Q4_1 Linears{which} ran on AMX tiles, which the fp32 rate does not bound.")
    return " ".join(parts)
