"""The Fleet page's views: several serving instances behind one gateway, drawn from a
`engine.fleet.state.FleetSnapshot` (one moment) or a `FleetTrace` (a recorded session).

Pure functions, no Streamlit and no network: a snapshot in, escaped HTML or a Plotly figure out.
Everything shown comes from the snapshot's fields; nothing here computes a measurement. The what-if
rows are replays of recorded events and every view of them says so.

- `instances_html`: one row per instance (its /metrics and the health of its KV-event stream);
- `merged_tree_figure` + `holders_legend_html`: the fleet's merged prefix tree, each block marked
  with the instances that hold it; `holdings_figure`: per instance, blocks held only there vs
  held elsewhere too (the duplicated ones);
- `ledger_html`: each request sent through the gateway against what every instance held;
- `policy_figure` / `policy_table_html`: measured runs of one workload under several policies;
- `whatif_html`: rules replayed offline over the recorded stream (labelled as replays);
- `timeline_figure`: KV usage per instance and duplicated blocks over a trace's snapshots.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.fleet.state import (
    NO_HIT_ELSEWHERE,
    NO_HIT_EVICTED,
    NO_HIT_NEVER_STORED,
    FleetSnapshot,
    FleetTrace,
    InstanceStatus,
    PolicyRun,
    PrefixTree,
    RequestRow,
    WhatIfRow,
)
from ui.figures import theme
from ui.figures.prefix_tree import icicle_figure

E = html.escape
ROOT = "fleet"
UNKNOWN_PARENT = "unknown-parent"
MAX_DRAWN = 1_200  # tree nodes drawn (the first ones, in the collector's order: roots before children)
SHARED_COLOR = theme.OKABE_ITO["vermillion"]
DOWN_COLOR = theme.OKABE_ITO["vermillion"]
UP_COLOR = theme.OKABE_ITO["bluish_green"]
REPLAY_LABEL = "replay of recorded events, not a measurement"

NO_HIT_SHORT = {
    NO_HIT_NEVER_STORED: "no hit: never stored",
    NO_HIT_EVICTED: "no hit: evicted first",
    NO_HIT_ELSEWHERE: "no hit: held elsewhere",
}
NO_HIT_TEXT = {
    NO_HIT_NEVER_STORED: "no hit: no instance had ever stored its first block",
    NO_HIT_EVICTED: "no hit: stored before, evicted before it arrived",
    NO_HIT_ELSEWHERE: "no hit here: another instance held its prefix",
}

RULE_SHORT = {
    "round_robin": "round robin",
    "dynamo_overlap_cost": "Dynamo cost",
    "llmd_longest_prefix": "llm-d prefix",
    "kv_aware": "kv_aware",
    "recorded": "the gateway's own choices",
}
RULE_TEXT = {
    "round_robin": "round robin: the next instance in turn, caches ignored",
    "dynamo_overlap_cost": "Dynamo's cost: prefill blocks left after the overlap, plus the instance's load",
    "llmd_longest_prefix": "llm-d: the instance holding the longest run of consecutive prefix blocks",
    "kv_aware": "kv_aware: the instance holding the longest prefix, load as a tie-break",
}


# ----------------------------------------------------------------------------- helpers


def instance_ids(snap: FleetSnapshot | None) -> list[str]:
    """Engine ids in the snapshot's order (the order every view uses)."""
    return [i.engine_id or i.url for i in snap.instances] if snap is not None else []


def instance_colors(ids: Iterable[str]) -> dict[str, str]:
    """One colour per instance, in the given order (the request palette, cycling)."""
    pal = theme.REQUEST_COLORS
    return {e: pal[k % len(pal)] for k, e in enumerate(ids)}


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _num(x, fmt: str = "{:,}") -> str:
    return "—" if x is None else fmt.format(x)


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{1000 * s:,.0f} ms"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n:,} B"


_TABLE_CSS = (
    "<style>.kv-fleet{width:100%;border-collapse:collapse;font-size:0.84rem}"
    ".kv-fleet td,.kv-fleet th{border-top:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}"
    ".kv-fleet th{font-weight:600;background:#FAFAFA}.kv-fleet .n{text-align:right;white-space:nowrap}"
    ".kv-fleet .sub{color:#666;font-size:0.76rem}.kv-fleet th .kv-chip{font-size:0.8rem}"
    ".kv-chip{display:inline-block;padding:0 6px;border-radius:3px;color:#fff;font-weight:600}"
    ".kv-replay{display:inline-block;padding:0 6px;border:1px dashed #7A3300;color:#7A3300;border-radius:3px;"
    "font-size:0.78rem;font-weight:600}</style>"
)


def chip(engine_id: str, colors: dict[str, str]) -> str:
    """An instance's name on its colour (escaped)."""
    c = colors.get(engine_id, "#7F7F7F")
    return f"<span class='kv-chip' style='background:{c}'>{E(engine_id)}</span>"


# ----------------------------------------------------------------------------- instances


def stream_text(i: InstanceStatus) -> str:
    """The KV-event stream's health in a few words (plain text, not escaped)."""
    s = i.stream
    if not s.connected and not s.batches:
        return "not connected" + (f": {s.error}" if s.error else "")
    parts = [
        "connected" if s.connected else "disconnected",
        f"{s.batches:,} batches, {s.events:,} events, last seq {s.last_seq}",
        f"{s.seq_gaps} gaps" + (f" ({s.missed} seq numbers missed)" if s.missed else ""),
        f"{s.replays} replays ({s.replayed_batches} batches)",
        f"{s.clears} clears",
        s.encoding or "encoding not seen",
    ]
    if s.error:
        parts.append(f"error: {s.error}")
    return " · ".join(parts)


def _stream_cells(i: InstanceStatus) -> str:
    s = i.stream
    if not s.connected and not s.batches:
        return "<td colspan='4' class='sub'>not connected</td>"
    missed = f"<br><span class='sub'>{s.missed} missed</span>" if s.missed else ""
    return (
        f"<td class='n'>{s.batches:,}<br><span class='sub'>seq {s.last_seq} · {E(s.encoding or '—')}</span></td>"
        f"<td class='n'>{s.seq_gaps}{missed}</td><td class='n'>{s.replays}<br><span class='sub'>"
        f"{s.replayed_batches} batches</span></td><td class='n'>{s.clears}</td>"
    )


def _stream_note(i: InstanceStatus) -> str:
    """Under the state: an event stream that is down or in error (escaped HTML)."""
    s = i.stream
    if s.connected and not s.error:
        return ""
    what = "events: " + ("connected" if s.connected else "not connected")
    return f"<br><span class='sub'>{E(what + (': ' + s.error if s.error else ''))}</span>"


def instances_html(snap: FleetSnapshot) -> str:
    """One row per instance: up or down (with the reason), KV usage, queues, prefix hit rate,
    preemptions, block size, blocks rebuilt from its events, and its event stream's health
    (encoding, batches and last sequence number, gaps, replays, clears)."""
    colors = instance_colors(instance_ids(snap))
    head = (
        "<tr><th rowspan='2'>instance</th><th rowspan='2'>state</th><th class='n' rowspan='2'>KV usage</th>"
        "<th class='n' rowspan='2'>running<br>waiting</th><th class='n' rowspan='2'>prefix<br>hit rate</th>"
        "<th class='n' rowspan='2'>preempt&shy;ions</th><th class='n' rowspan='2'>block<br>size</th>"
        "<th class='n' rowspan='2'>cached<br>blocks</th>"
        "<th colspan='4' style='text-align:center'>KV-event stream</th></tr>"
        "<tr><th class='n'>batches</th><th class='n'>gaps</th><th class='n'>replays</th><th class='n'>clears</th></tr>"
    )
    body = []
    for i in snap.instances:
        eid = i.engine_id or i.url
        state = (
            f"<b style='color:{UP_COLOR}'>▲ up</b>"
            if i.up
            else f"<b style='color:{DOWN_COLOR}'>▼ down</b><br><span class='sub'>{E(i.reason or 'no reason')}</span>"
        )
        hits = (
            f"<br><span class='sub'>{i.prefix_hits:,.0f} / {i.prefix_queries:,.0f} tok</span>"
            if i.prefix_hits is not None and i.prefix_queries
            else ""
        )
        rw = "—" if i.running is None and i.waiting is None else f"{_num(i.running)} · {_num(i.waiting)}"
        pool = f"<br><span class='sub'>of {i.num_blocks:,}</span>" if i.num_blocks else ""
        if not i.up and i.cached_blocks:
            pool += "<br><span class='sub'>as last seen</span>"
        body.append(
            f"<tr><td style='white-space:nowrap'>{chip(eid, colors)} <span class='sub'>{E(i.kind)}</span><br>"
            f"<span class='sub'>{E(i.url)}</span></td>"
            f"<td style='min-width:8rem;max-width:13rem'>{state}{_stream_note(i)}</td>"
            f"<td class='n'>{_pct(i.kv_usage)}</td><td class='n'>{rw}</td>"
            f"<td class='n'>{_pct(i.prefix_hit_rate)}{hits}</td><td class='n'>{_num(i.preemptions)}</td>"
            f"<td class='n'>{_num(i.block_size)}</td><td class='n'>{i.cached_blocks:,}{pool}</td>"
            f"{_stream_cells(i)}</tr>"
        )
    return _TABLE_CSS + f"<table class='kv-fleet'><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


# ----------------------------------------------------------------------------- merged tree


def tree_counts(tree: PrefixTree) -> dict:
    """Blocks in the merged tree, copies held over all instances, blocks on more than one instance,
    duplicated copies (extra copies beyond the first, the collector's count) and their bytes."""
    copies = sum(len(n.holders) for n in tree.nodes)
    multi = sum(1 for n in tree.nodes if len(n.holders) > 1)
    return dict(
        blocks=len(tree.nodes),
        copies=copies,
        shared_blocks=multi,
        duplicated_blocks=tree.duplicated_blocks,
        duplicated_bytes=tree.duplicated_bytes,
        bytes_per_block=tree.bytes_per_block,
    )


def duplication_text(tree: PrefixTree) -> str:
    """One sentence on duplication (plain text)."""
    c = tree_counts(tree)
    if not c["blocks"]:
        return "No cached blocks on any instance."
    s = (
        f"{c['blocks']:,} distinct blocks cached across the fleet, {c['copies']:,} copies in all; "
        f"{c['shared_blocks']:,} blocks are held on more than one instance: {c['duplicated_blocks']:,} "
        "duplicated blocks (copies beyond the first)"
    )
    if c["duplicated_bytes"] is not None:
        s += f", {fmt_bytes(c['duplicated_bytes'])} of KV memory holding the same prefix twice"
        if c["bytes_per_block"]:
            s += f" ({c['bytes_per_block']:,} bytes per block)"
    return s + "."


def _holders_label(holders: Sequence[str]) -> str:
    if not holders:
        return "held nowhere"
    return "+".join(holders) + (f" ×{len(holders)}" if len(holders) > 1 else "")


def merged_tree_figure(
    tree: PrefixTree, ids: Sequence[str], max_drawn: int = MAX_DRAWN, height: int = 460
) -> go.Figure:
    """Icicle of the merged prefix tree: one cell per distinct block, each labelled with the
    instances holding it; a block on one instance takes that instance's colour, a block on several
    the shared colour (the label names them, so colour is never the only cue)."""
    colors = instance_colors(ids)
    keep = tree.nodes[:max_drawn]
    kept = {n.block_hash for n in keep}
    fids, parents, labels, hover, cols = [ROOT], [""], ["fleet cache"], ["every instance's cached chains"], ["#FFFFFF"]
    unknown = False
    for n in keep:
        if n.parent and n.parent in kept:
            pid = n.parent
        elif not n.parent and n.depth >= 0:
            pid = ROOT
        else:
            pid, unknown = UNKNOWN_PARENT, True
        fids.append(n.block_hash)
        parents.append(pid)
        lab = _holders_label(n.holders)
        labels.append(E(lab))
        hover.append(f"block {E(n.block_hash[:16])}<br>{n.token_count} tokens · depth {n.depth}<br>held by {E(lab)}")
        cols.append(colors.get(n.holders[0], "#9E9E9E") if len(n.holders) == 1 else SHARED_COLOR)
    if unknown:
        fids.append(UNKNOWN_PARENT)
        parents.append(ROOT)
        labels.append("(parent not cached)")
        hover.append("blocks whose parent block is not cached on any instance")
        cols.append("#E0E0E0")
    shown = f"{len(keep):,} of {len(tree.nodes):,}" if len(keep) < len(tree.nodes) else f"{len(tree.nodes):,}"
    return icicle_figure(
        fids,
        parents,
        labels,
        hover,
        dict(colors=cols, line=dict(color="white", width=1)),
        f"Merged prefix tree from every instance's KV events: {shown} blocks, {tree.duplicated_blocks:,} duplicated",
        height,
    )


def holders_legend_html(ids: Sequence[str]) -> str:
    colors = instance_colors(ids)
    items = [f"{chip(e, colors)} held only on {E(e)}" for e in ids]
    items.append(f"<span class='kv-chip' style='background:{SHARED_COLOR}'>A+B ×n</span> held on n instances")
    return _TABLE_CSS + "<div style='font-size:0.85rem'>" + " &nbsp; ".join(items) + "</div>"


def holdings_figure(snap: FleetSnapshot, height: int = 260) -> go.Figure:
    """Per instance: blocks it alone holds vs blocks another instance holds too (from the merged tree)."""
    ids = instance_ids(snap)
    only = dict.fromkeys(ids, 0)
    shared = dict.fromkeys(ids, 0)
    for n in snap.tree.nodes:
        for h in n.holders:
            d = shared if len(n.holders) > 1 else only
            d[h] = d.get(h, 0) + 1
    names = list(dict.fromkeys(ids + sorted(set(only) | set(shared))))
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            y=names,
            x=[only.get(e, 0) for e in names],
            name="held only here",
            orientation="h",
            marker_color=theme.OKABE_ITO["blue"],
            text=[only.get(e, 0) for e in names],
            textposition="inside",
        )
    )
    fig.add_trace(
        go.Bar(
            y=names,
            x=[shared.get(e, 0) for e in names],
            name="also held on another instance",
            orientation="h",
            marker=dict(color=SHARED_COLOR, pattern=dict(shape="/", fgcolor=SHARED_COLOR, bgcolor="#FBE3D0")),
            text=[shared.get(e, 0) for e in names],
            textposition="inside",
            insidetextfont=dict(color=theme.INK),
        )
    )
    fig.update_layout(
        barmode="stack",
        title=dict(text="Cached blocks per instance: unique vs duplicated", x=0, font=dict(size=14)),
        height=height,
        margin=dict(l=60, r=10, t=40, b=40),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.25, traceorder="normal"),
        xaxis_title="blocks",
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(gridcolor="#EEE", rangemode="tozero")
    return fig


# ----------------------------------------------------------------------------- ledger


def outcome_text(r: RequestRow) -> str:
    """A request's prefix outcome in a few words (plain text): the hit, or why there was none."""
    if r.error:
        return f"error: {r.error}"
    if r.cached_tokens:
        return f"hit {r.cached_tokens:,} / {r.prompt_tokens:,}"
    if r.no_hit_reason == NO_HIT_ELSEWHERE and r.best_holder:
        return f"held on {r.best_holder} ({r.best_tokens:,}), sent elsewhere"
    if r.no_hit_reason in NO_HIT_SHORT:
        return NO_HIT_SHORT[r.no_hit_reason]
    if r.cached_tokens is None:
        return "cached tokens not reported"
    return "no hit"


def ledger_html(rows: Sequence[RequestRow], ids: Sequence[str], limit: int = 25) -> str:
    """The request ledger, newest first (rows in send order, run after run, read backwards): per request
    the instance that served it, the prefix tokens
    each instance held when it arrived (★ the best holder, the server's cell shaded and bold), the
    cached tokens the server reported, the router's credited tokens where known (= or ≠ the
    reported ones), TTFT, and the outcome."""
    colors = instance_colors(ids)
    shown = list(rows)[::-1][:limit]  # rows come in send order, run after run (t_sent restarts per run)
    cols = list(ids) or sorted({k for r in shown for k in r.held_at_arrival})
    mixed = len({r.policy for r in rows}) > 1  # the policy column only when rows of several runs mix
    head = (
        "<tr><th rowspan='2'>request</th>"
        + ("<th rowspan='2'>policy</th>" if mixed else "")
        + "<th rowspan='2'>served<br>by</th>"
        "<th class='n' rowspan='2'>prompt<br>tokens</th>"
        f"<th colspan='{len(cols)}' style='text-align:center'>prefix tokens held<br>at arrival</th>"
        "<th class='n' rowspan='2'>cached<br>(reported)</th><th class='n' rowspan='2'>router<br>credited</th>"
        "<th class='n' rowspan='2'>TTFT</th><th rowspan='2'>outcome</th></tr><tr>"
        + "".join(f"<th class='n'>{chip(e, colors)}</th>" for e in cols)
        + "</tr>"
    )
    body = []
    for r in shown:
        who = f"{E(r.conversation)} · turn {r.turn}" if r.conversation else E(r.request_id)
        cells = []
        for e in cols:
            v = r.held_at_arrival.get(e)
            star = " ★" if e == r.best_holder and r.best_tokens else ""
            served = e == r.served_by
            style = " style='background:#EDEDED;font-weight:700'" if served else ""
            cells.append(f"<td class='n'{style}>{_num(v)}{star}</td>")
        credited = _num(r.router_credited)
        if r.router_credited is not None and r.cached_tokens is not None:
            credited += " =" if r.router_credited == r.cached_tokens else " ≠"
        served = chip(r.served_by, colors) if r.served_by else "—"
        colour = "" if r.cached_tokens else f";color:{theme.OKABE_ITO['vermillion']}"
        wrap = "min-width:12rem;max-width:16rem;font-size:0.76rem" if r.error else "white-space:nowrap"
        body.append(
            f"<tr title='{E(r.request_id)} sent at t={r.t_sent:.1f} s'><td style='white-space:nowrap'>{who}</td>"
            + (f"<td>{E(r.policy)}</td>" if mixed else "")
            + f"<td>{served}</td><td class='n'>{r.prompt_tokens:,}</td>{''.join(cells)}"
            f"<td class='n'>{_num(r.cached_tokens)}</td><td class='n'>{credited}</td><td class='n'>{_ms(r.ttft_s)}</td>"
            f"<td style='{wrap}{colour}'>{E(outcome_text(r))}</td></tr>"
        )
    more = (
        f"<p style='font-size:0.8rem;color:#666;margin:2px 0'>newest {len(shown)} of {len(rows)} requests shown</p>"
        if len(rows) > len(shown)
        else ""
    )
    return _TABLE_CSS + f"<table class='kv-fleet'><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>" + more


def ledger_counts(rows: Sequence[RequestRow]) -> dict:
    """Requests, hits, no-hits by reason, and (where both are known) router credit vs reported."""
    both = [r for r in rows if r.router_credited is not None and r.cached_tokens is not None]
    return dict(
        requests=len(rows),
        hits=sum(1 for r in rows if r.cached_tokens),
        never_stored=sum(1 for r in rows if not r.cached_tokens and r.no_hit_reason == NO_HIT_NEVER_STORED),
        evicted=sum(1 for r in rows if not r.cached_tokens and r.no_hit_reason == NO_HIT_EVICTED),
        held_elsewhere=sum(1 for r in rows if not r.cached_tokens and r.no_hit_reason == NO_HIT_ELSEWHERE),
        errors=sum(1 for r in rows if r.error),
        credit_known=len(both),
        credit_equal=sum(1 for r in both if r.router_credited == r.cached_tokens),
        on_best=sum(1 for r in rows if r.best_tokens and r.served_by == r.best_holder),
        with_holder=sum(1 for r in rows if r.best_tokens),
    )


# ----------------------------------------------------------------------------- policy runs


def policy_table_html(runs: Sequence[PolicyRun]) -> str:
    """Measured runs side by side, one column per policy."""
    if not runs:
        return ""
    e = E
    metrics = [
        ("fleet prefix hit rate", lambda r: _pct(r.fleet_hit_rate)),
        ("TTFT p50", lambda r: _ms(r.ttft_p50_s)),
        ("TTFT p99", lambda r: _ms(r.ttft_p99_s)),
        ("output tokens/s", lambda r: _num(r.output_tok_s, "{:,.1f}")),
        ("landed on the best holder", lambda r: _pct(r.landed_on_best, 0)),
        ("duplicated blocks at the end", lambda r: f"{r.duplicated_blocks:,}"),
        ("preemptions", lambda r: f"{r.preemptions:,}"),
        ("requests (errors)", lambda r: f"{r.requests:,} ({r.errors})"),
        (
            "requests per instance",
            lambda r: " · ".join(f"{e(k)} {v}" for k, v in r.per_instance_requests.items()) or "—",
        ),
        ("wall time", lambda r: _num(r.wall_s, "{:,.1f} s")),
    ]
    head = "<tr><th>measured</th>" + "".join(f"<th class='n'>{e(r.policy)}</th>" for r in runs) + "</tr>"
    body = "".join(
        f"<tr><td>{name}</td>" + "".join(f"<td class='n'>{f(r)}</td>" for r in runs) + "</tr>" for name, f in metrics
    )
    wl = sorted({r.workload for r in runs if r.workload})
    models = sorted({r.model for r in runs if r.model})
    foot = (
        f"<p style='font-size:0.8rem;color:#666;margin:2px 0'>workload {e(', '.join(wl) or '—')} · model "
        f"{e(', '.join(models) or '—')}</p>"
    )
    return _TABLE_CSS + f"<table class='kv-fleet'><thead>{head}</thead><tbody>{body}</tbody></table>" + foot


def hit_rate_figure(
    runs: Sequence[PolicyRun], whatif: Sequence[WhatIfRow] = (), height: int | None = None
) -> go.Figure:
    """Fleet prefix hit rate: one bar per measured run (solid, "measured: policy") and, below them,
    one per what-if rule (hatched, "replay: rule"), so the replays sit beside the measurements
    without passing for them."""
    o = theme.OKABE_ITO
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            y=[f"measured: {r.policy}" for r in runs],
            x=[None if r.fleet_hit_rate is None else 100 * r.fleet_hit_rate for r in runs],
            orientation="h",
            marker_color=o["bluish_green"],
            text=[_pct(r.fleet_hit_rate) for r in runs],
            textposition="outside",
            name="measured: cached tokens the servers reported / prompt tokens",
            cliponaxis=False,
        )
    )
    if whatif:
        fig.add_trace(
            go.Bar(
                y=[f"replay: {RULE_SHORT.get(w.rule, w.rule)}" for w in whatif],
                x=[None if w.hit_rate is None else 100 * w.hit_rate for w in whatif],
                orientation="h",
                marker=dict(
                    color="#FFFFFF",
                    line=dict(color=o["bluish_green"], width=1.5),
                    pattern=dict(shape="/", fgcolor=o["bluish_green"], bgcolor="#FFFFFF"),
                ),
                text=[_pct(w.hit_rate) for w in whatif],
                textposition="outside",
                name=REPLAY_LABEL,
                cliponaxis=False,
            )
        )
    n = len(runs) + len(whatif)
    fig.update_layout(
        title=dict(
            text="Fleet prefix hit rate (% of prompt tokens): measured runs, then replays", x=0, font=dict(size=14)
        ),
        height=height or 120 + 30 * n,
        margin=dict(l=10, r=40, t=40, b=60),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.1, yanchor="top"),
        xaxis=dict(range=[0, 100], gridcolor="#EEE"),
        yaxis=dict(autorange="reversed", automargin=True),
        bargap=0.25,
    )
    return fig


def policy_figure(runs: Sequence[PolicyRun], ids: Sequence[str] = (), height: int = 320) -> go.Figure:
    """Three panels, one bar group per measured policy: TTFT p50 / p99, requests per instance
    (stacked), duplicated blocks at the end and preemptions."""
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("TTFT (ms)", "requests per instance", "duplicated blocks · preemptions"),
        horizontal_spacing=0.08,
    )
    pol = [r.policy for r in runs]
    o = theme.OKABE_ITO
    for q, name, col in (("ttft_p50_s", "p50", "#9E9E9E"), ("ttft_p99_s", "p99", theme.INK)):
        ys = [None if getattr(r, q) is None else 1000 * getattr(r, q) for r in runs]
        fig.add_trace(go.Bar(x=pol, y=ys, name=f"TTFT {name}", marker_color=col, legendgroup="ttft"), 1, 1)
    inst = list(dict.fromkeys(list(ids) + sorted({k for r in runs for k in r.per_instance_requests})))
    colors = instance_colors(inst)
    for e in inst:
        fig.add_trace(
            go.Bar(
                x=pol,
                y=[r.per_instance_requests.get(e, 0) for r in runs],
                name=e,
                marker_color=colors[e],
                legendgroup="inst",
                text=[r.per_instance_requests.get(e, 0) or "" for r in runs],
                textposition="inside",
            ),
            1,
            2,
        )
    fig.add_trace(
        go.Bar(x=pol, y=[r.duplicated_blocks for r in runs], name="duplicated blocks", marker_color=SHARED_COLOR),
        1,
        3,
    )
    fig.add_trace(
        go.Bar(
            x=pol,
            y=[r.preemptions for r in runs],
            name="preemptions",
            marker=dict(color=o["reddish_purple"], pattern=dict(shape="x")),
        ),
        1,
        3,
    )
    fig.update_layout(
        barmode="group",
        height=height,
        margin=dict(l=40, r=10, t=50, b=40),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.22),
        font=dict(size=11),
    )
    _stack(fig, runs)
    fig.update_yaxes(gridcolor="#EEE", rangemode="tozero")
    for a in fig.layout.annotations:
        a.font = dict(size=12)
    return fig


def _stack(fig: go.Figure, runs: Sequence[PolicyRun]) -> None:
    """Stack the per-instance bars of panel 2 (barmode is one per figure, "group" for the others):
    one offset group, each trace starting where the previous ended."""
    base = [0] * len(runs)
    for tr in fig.data:
        if tr.legendgroup == "inst":
            tr.base = list(base)
            tr.offsetgroup = "inst"
            base = [b + (y or 0) for b, y in zip(base, tr.y)]


# ----------------------------------------------------------------------------- what-if


def whatif_html(rows: Sequence[WhatIfRow]) -> str:
    """Rules replayed offline over a recorded request stream and its event log. Labelled as a
    replay in the header and on every row: these are never measurements."""
    if not rows:
        return ""
    head = (
        "<tr><th>rule</th><th class='n'>requests</th>"
        "<th class='n'>prefix tokens the chosen instance held</th><th class='n'>hit rate (replayed)</th>"
        "<th>requests per instance</th><th>replays</th></tr>"
    )
    body = []
    for w in rows:
        per = " · ".join(f"{E(k)} {v}" for k, v in w.per_instance_requests.items()) or "—"
        desc = "" if w.note else RULE_TEXT.get(w.rule, "")
        note = f"<br><span class='sub'>{E(w.note)}</span>" if w.note else ""
        body.append(
            f"<tr><td><span class='kv-replay'>replay</span> <b>{E(w.rule)}</b>"
            + (f"<br><span class='sub'>{E(desc)}</span>" if desc else "")
            + note
            + f"</td><td class='n'>{w.requests:,}</td><td class='n'>{w.hit_tokens:,} of {w.prompt_tokens:,}</td>"
            f"<td class='n'>{_pct(w.hit_rate)}</td><td class='sub'>{per}</td><td class='sub'>{E(w.source)}</td></tr>"
        )
    cap = (
        "<caption style='caption-side:top;text-align:left;padding:2px 0'>"
        f"<span class='kv-replay'>{E(REPLAY_LABEL)}</span></caption>"
    )
    return _TABLE_CSS + f"<table class='kv-fleet'>{cap}<thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


# ----------------------------------------------------------------------------- timeline


def timeline_figure(snapshots: Sequence[FleetSnapshot], height: int = 280) -> go.Figure:
    """KV usage per instance (%) and the fleet's duplicated blocks (right axis) over a trace."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    ids = list(dict.fromkeys(e for s in snapshots for e in instance_ids(s)))
    colors = instance_colors(ids)
    ts = [s.t for s in snapshots]
    for e in ids:
        ys = []
        for s in snapshots:
            i = s.instance(e) or next((x for x in s.instances if x.url == e), None)
            ys.append(None if i is None or i.kv_usage is None or not i.up else 100 * i.kv_usage)
        fig.add_trace(
            go.Scatter(x=ts, y=ys, name=f"{e} KV usage", mode="lines", line=dict(color=colors[e]), connectgaps=False),
            secondary_y=False,
        )
    fig.add_trace(
        go.Scatter(
            x=ts,
            y=[s.tree.duplicated_blocks for s in snapshots],
            name="duplicated blocks",
            mode="lines",
            line=dict(color=SHARED_COLOR, dash="dot"),
        ),
        secondary_y=True,
    )
    fig.update_layout(
        title=dict(text="KV usage per instance and duplicated blocks over the session", x=0, font=dict(size=14)),
        height=height,
        margin=dict(l=50, r=50, t=40, b=70),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.4),
        xaxis_title="time since the session began (s)",
    )
    fig.update_yaxes(title="KV usage (%)", range=[0, 100], gridcolor="#EEE", secondary_y=False)
    fig.update_yaxes(title="duplicated blocks", rangemode="tozero", showgrid=False, tickformat=",d", secondary_y=True)
    fig.update_xaxes(gridcolor="#EEE")
    return fig


# ----------------------------------------------------------------------------- recorded traces

MAX_TRACE_BYTES = 64 * 1024 * 1024


def fleet_traces(folder) -> dict[str, Path]:
    """The recorded fleet traces in a folder (fleet_*.json), by name without the prefix."""
    p = Path(folder)
    return {f.stem.removeprefix("fleet_"): f for f in sorted(p.glob("fleet_*.json"))} if p.is_dir() else {}


def load_fleet_trace_bytes(data: bytes, *, max_bytes: int = MAX_TRACE_BYTES) -> FleetTrace:
    """A FleetTrace from JSON bytes; ValueError naming what is wrong (size, JSON, fields)."""
    if len(data) > max_bytes:
        raise ValueError(f"fleet trace: larger than {max_bytes // 2**20} MiB")
    try:
        trace = FleetTrace.from_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("fleet trace: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"fleet trace: not JSON ({e.msg} at line {e.lineno})") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"fleet trace: a field is missing or has the wrong type ({type(e).__name__}: {e})") from None
    if not trace.snapshots:
        raise ValueError("fleet trace: it holds no snapshot")
    return trace


def trace_caption(trace: FleetTrace) -> str:
    """What a recorded trace holds, in one line (plain text)."""
    m = trace.meta
    span = trace.snapshots[-1].t - trace.snapshots[0].t if trace.snapshots else 0.0
    bits = [
        f"{len(trace.snapshots)} snapshots over {span:,.1f} s",
        f"{len(trace.requests)} requests",
        f"{len(trace.runs)} measured runs",
        f"{len(trace.whatif)} what-if replays",
    ]
    for k in ("model", "cpu", "router", "recorded", "fault"):
        if m.get(k):
            bits.append(f"{k} {m[k]}")
    return " · ".join(bits)
