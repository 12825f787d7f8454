"""Pool map and block table figures: pure functions of a Snapshot.

Pool map: every physical block of the K/V pool is one cell, coloured by the request that owns it;
shared blocks carry their ref count; cached-free and free blocks differ in shade and symbol. Above
`max_cells` blocks, consecutive blocks are aggregated into one cell (the title says how many) so
the browser never draws more than `max_cells` cells.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import plotly.graph_objects as go

from . import theme
from .theme import CACHED, FREE, SHARED, USED

MAX_CELLS = 4096

# Heatmap categories: 0 free, 1 cached, 2.. one per palette colour.
_N_CAT = 2 + len(theme.REQUEST_COLORS)


def _colorscale():
    colors = [theme.BLOCK_STATES[FREE].color, theme.BLOCK_STATES[CACHED].color, *theme.REQUEST_COLORS]
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):  # discrete steps
        scale.append([i / n, c])
        scale.append([(i + 1) / n, c])
    return scale


def _block_heatmap(z, text, hover, textfont: dict, **kw) -> go.Heatmap:
    """A grid of blocks: z the category (0 free, 1 cached, 2.. a request's palette colour), text
    drawn in each cell, hover its tooltip (HTML)."""
    return go.Heatmap(
        z=z,
        text=text,
        texttemplate="%{text}",
        textfont=textfont,
        customdata=hover,
        hovertemplate="%{customdata}<extra></extra>",
        colorscale=_colorscale(),
        zmin=-0.5,
        zmax=_N_CAT - 0.5,
        showscale=False,
        xgap=2,
        ygap=2,
        **kw,
    )


@dataclass(frozen=True, slots=True)
class PoolCell:
    """One drawn cell: `blocks` physical blocks starting at `first_block`."""

    first_block: int
    blocks: int
    state: str  # free | cached | used | shared (dominant state among its blocks)
    owner: str | None  # request owning most of its used blocks
    ref_count: int  # max ref count among its blocks
    fill: int  # slots holding tokens (sum over its blocks)
    n_used: int
    n_cached: int
    n_free: int
    owners: tuple[str, ...]


def pool_cells(snapshot, max_cells: int = MAX_CELLS) -> tuple[list[PoolCell], int]:
    """Group the pool's blocks into at most `max_cells` cells. Returns (cells, blocks_per_cell)."""
    blocks = sorted(snapshot.blocks, key=lambda b: b.block_id)
    n = len(blocks)
    group = max(1, math.ceil(n / max_cells)) if n else 1
    cells: list[PoolCell] = []
    for start in range(0, n, group):
        chunk = blocks[start : start + group]
        n_used = sum(1 for b in chunk if b.state == USED)
        n_cached = sum(1 for b in chunk if b.state == CACHED)
        n_free = len(chunk) - n_used - n_cached
        owner_count: dict[str, int] = {}
        all_owners: list[str] = []
        for b in chunk:
            if b.state == USED:
                for o in b.owners[:1] or ("?",):
                    owner_count[o] = owner_count.get(o, 0) + 1
            for o in b.owners:
                if o not in all_owners:
                    all_owners.append(o)
        ref = max((b.ref_count for b in chunk), default=0)
        if n_used and n_used >= max(n_cached, n_free):
            state = SHARED if ref > 1 else USED
            owner = max(owner_count, key=lambda k: (owner_count[k], k)) if owner_count else None
        elif n_cached and n_cached >= n_free:
            state, owner = CACHED, None
        else:
            state, owner = FREE, None
        cells.append(
            PoolCell(
                chunk[0].block_id,
                len(chunk),
                state,
                owner,
                ref,
                sum(b.fill for b in chunk),
                n_used,
                n_cached,
                n_free,
                tuple(all_owners),
            )
        )
    return cells, group


def _grid_cols(n_cells: int) -> int:
    if n_cells <= 0:
        return 1
    return max(16, min(64, int(math.ceil(math.sqrt(n_cells * 4)))))


def pool_map_figure(
    snapshot,
    colors: theme.RequestColors | None = None,
    *,
    max_cells: int = MAX_CELLS,
    height: int | None = None,
    title: str | None = "KV block pool",
    highlight: str | None = None,
    mine=(),
) -> go.Figure:
    """Every physical block as a cell. `highlight` (a request id) outlines that request's blocks;
    `mine` (request ids: this browser session's other requests) outlines theirs dotted, so one
    person picks out their own requests in the engine-wide pool."""
    mine = set(mine) - {highlight}
    colors = colors or theme.request_colors_for(snapshot)
    cells, group = pool_cells(snapshot, max_cells)
    n = len(cells)
    cols = _grid_cols(n)
    rows = max(1, math.ceil(n / cols))
    z = [[None] * cols for _ in range(rows)]
    text = [[""] * cols for _ in range(rows)]
    hover = [[""] * cols for _ in range(rows)]
    bs = snapshot.info.block_size
    bpt, kv_dtype = snapshot.info.bytes_per_token, html.escape(snapshot.info.kv_cache_dtype)  # the pool's real bytes
    shared_x, shared_y, shared_t = [], [], []
    hl_x, hl_y = [], []
    mine_x, mine_y = [], []
    for i, c in enumerate(cells):
        r, col = divmod(i, cols)
        if c.state in (USED, SHARED):
            z[r][col] = 2 + colors.index(c.owner or "?")
        elif c.state == CACHED:
            z[r][col] = 1
        else:
            z[r][col] = 0
        if group == 1:
            head = f"block {c.first_block}"
            body = (
                f"state: {theme.BLOCK_STATES[c.state].label}<br>ref count: {c.ref_count}"
                f"<br>fill: {c.fill}/{bs} slots · {c.fill * bpt:,} of {bs * bpt:,} bytes ({kv_dtype})"
            )
        else:
            head = f"blocks {c.first_block}–{c.first_block + c.blocks - 1}"
            body = f"used {c.n_used}, cached-free {c.n_cached}, free {c.n_free}<br>max ref count: {c.ref_count}"
        if c.owners:
            names = ", ".join(html.escape(theme.short_id(o, 24)) for o in c.owners[:4])
            more = f" +{len(c.owners) - 4}" if len(c.owners) > 4 else ""
            body += f"<br>owners: {names}{more}"
        hover[r][col] = f"<b>{head}</b><br>{body}"
        if c.state == CACHED:
            text[r][col] = "c"
        if c.state == SHARED:
            shared_x.append(col)
            shared_y.append(r)
            shared_t.append(f"×{c.ref_count}")
        if highlight is not None and highlight in c.owners:
            hl_x.append(col)
            hl_y.append(r)
        elif mine and mine.intersection(c.owners):
            mine_x.append(col)
            mine_y.append(r)

    fig = go.Figure()
    fig.add_trace(_block_heatmap(z, text, hover, dict(size=9, color="#444444"), name="blocks", showlegend=False))
    if highlight is not None and hl_x:
        fig.add_trace(
            go.Scatter(
                x=hl_x,
                y=hl_y,
                mode="markers",
                hoverinfo="skip",
                marker=dict(symbol="square-open", size=_marker_size(cols), color=theme.INK, line=dict(width=2)),
                name=f"{html.escape(theme.short_id(highlight, 24))}'s blocks",
                showlegend=True,
            )
        )
    if mine_x:
        fig.add_trace(
            go.Scatter(
                x=mine_x,
                y=mine_y,
                mode="markers",
                hoverinfo="skip",
                marker=dict(symbol="square-open-dot", size=_marker_size(cols), color=theme.INK, line=dict(width=1)),
                name="your other requests' blocks",
                showlegend=True,
            )
        )
    if shared_x:
        fig.add_trace(
            go.Scatter(
                x=shared_x,
                y=shared_y,
                mode="text",
                text=shared_t,
                hoverinfo="skip",
                textfont=dict(size=10, color="#000000", family="monospace"),
                name="shared (×ref count)",
                showlegend=False,
            )
        )
    # Legend entries (the heatmap itself has none): block states, then requests present.
    for key in (FREE, CACHED):
        s = theme.BLOCK_STATES[key]
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=s.label,
                marker=dict(symbol="square", size=12, color=s.color, line=dict(color="#888888", width=1)),
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[None],
            y=[None],
            mode="text",
            name="×n: block shared by n requests",
            text=["×n"],
            textfont=dict(color="#000000"),
        )
    )
    owners_present = []
    for c in cells:
        if c.owner and c.owner not in owners_present:
            owners_present.append(c.owner)
    for rid in owners_present[:10]:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=html.escape(theme.short_id(rid, 16)),
                marker=dict(symbol="square", size=12, color=colors.color(rid)),
            )
        )
    if len(owners_present) > 10:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=f"+{len(owners_present) - 10} more requests",
                marker=dict(symbol="square", size=12, color="#FFFFFF"),
            )
        )
    m = snapshot.metrics
    if title is not None:
        unit = "one cell = one block" if group == 1 else f"one cell = {group} blocks (pool has {len(snapshot.blocks)})"
        title = (
            f"{title}: {m.num_blocks_used} used · {m.num_blocks_cached} cached-free · "
            f"{m.num_blocks_free} free of {len(snapshot.blocks)} — {unit}"
        )
    cell_px = 22 if cols <= 16 else 16 if cols <= 32 else 10
    n_legend = 3 + min(len(owners_present), 11)
    legend_px = 24 * math.ceil(n_legend / 5)
    fig.update_layout(**theme.base_layout(height or max(150, 50 + legend_px + rows * cell_px), None))
    fig.update_layout(
        margin=dict(l=10, r=10, t=34 if title is not None else 6, b=legend_px + 6),
        legend=dict(
            orientation="h", yanchor="top", y=-0.01, x=0, font=dict(size=11), itemclick=False, itemdoubleclick=False
        ),
    )
    if title is not None:
        fig.update_layout(title=dict(text=html.escape(title), x=0, y=0.99, yanchor="top", font=dict(size=13)))
    fig.update_xaxes(visible=False, range=[-0.5, cols - 0.5], fixedrange=True)
    fig.update_yaxes(visible=False, autorange="reversed", fixedrange=True, scaleanchor=None)
    return fig


def _marker_size(cols: int) -> int:
    return 14 if cols <= 32 else 9


# --------------------------------------------------------------------------- block table

MAX_TABLE_BLOCKS = 1024


def block_table_figure(
    snapshot,
    request_id: str,
    colors: theme.RequestColors | None = None,
    *,
    per_row: int = 16,
    height: int | None = None,
    max_blocks: int = MAX_TABLE_BLOCKS,
) -> go.Figure:
    """One request's block table: logical block i (position in the sequence) → physical block id.
    Cells are laid out in logical order, labelled with the physical id; shared blocks show ×ref."""
    colors = colors or theme.request_colors_for(snapshot)
    req = snapshot.request(request_id)
    table = tuple(req.block_table) if req else ()
    shown = table[:max_blocks]
    by_id = {b.block_id: b for b in snapshot.blocks}
    bs = snapshot.info.block_size
    n = len(shown)
    cols = per_row
    rows = max(1, math.ceil(n / cols))
    z = [[None] * cols for _ in range(rows)]
    text = [[""] * cols for _ in range(rows)]
    hover = [[""] * cols for _ in range(rows)]
    color_idx = colors.index(request_id) if req else 0
    for i, phys in enumerate(shown):
        r, c = divmod(i, cols)
        b = by_id.get(phys)
        ref = b.ref_count if b else 0
        fill = b.fill if b else 0
        z[r][c] = 2 + color_idx
        label = f"{phys}"
        if ref > 1:
            label += f" ×{ref}"
        text[r][c] = label
        tok0 = i * bs
        hover[r][c] = (
            f"<b>logical {i} → physical {phys}</b><br>tokens {tok0}–{tok0 + bs - 1}"
            f"<br>fill: {fill}/{bs}<br>ref count: {ref}"
        )
    font = dict(size=11, color=theme.text_color_on(theme.REQUEST_COLORS[color_idx]))
    fig = go.Figure(_block_heatmap(z, text, hover, font))
    rid = html.escape(theme.short_id(request_id, 24))
    if req is None:
        title = f"block table of {rid}: request not in the engine"
    elif not table:
        title = f"block table of {rid}: no blocks held ({req.state})"
    else:
        title = f"block table of {rid}: {len(table)} logical blocks → physical ids (label = physical block)"
        if len(table) > max_blocks:
            title += f"; first {max_blocks} shown"
    fig.update_layout(**theme.base_layout(height or (70 + 26 * rows), None))
    fig.update_layout(title=dict(text=title, x=0, font=dict(size=13)), margin=dict(l=40, r=10, t=36, b=24))
    fig.update_xaxes(
        range=[-0.5, cols - 0.5],
        tickmode="array",
        tickvals=list(range(cols)),
        ticktext=[str(i) for i in range(cols)],
        fixedrange=True,
        title=None,
        showgrid=False,
        zeroline=False,
        tickfont=dict(size=9),
    )
    fig.update_yaxes(
        autorange="reversed",
        tickmode="array",
        tickvals=list(range(rows)),
        ticktext=[f"{r * cols}+" for r in range(rows)],
        fixedrange=True,
        showgrid=False,
        zeroline=False,
        tickfont=dict(size=9),
    )
    return fig


def block_table_rows(snapshot, request_id: str) -> list[dict]:
    """The block table as rows (logical, physical, fill, ref count) for st.dataframe / tests."""
    req = snapshot.request(request_id)
    if req is None:
        return []
    by_id = {b.block_id: b for b in snapshot.blocks}
    out = []
    for i, phys in enumerate(req.block_table):
        b = by_id.get(phys)
        out.append({"logical": i, "physical": phys, "fill": b.fill if b else 0, "ref_count": b.ref_count if b else 0})
    return out


def kv_bar_html(snap) -> str:
    """KV blocks used (and cached-free) against the budget, as one bar with the numbers in words."""
    m, info = snap.metrics, snap.info
    n = max(1, info.num_blocks)
    used, cached = m.num_blocks_used, m.num_blocks_cached
    pu, pc = 100 * used / n, 100 * cached / n
    text = (
        f"KV: {used} of {info.num_blocks} blocks used ({used * info.bytes_per_block / 2**20:,.2f} of "
        f"{info.num_blocks * info.bytes_per_block / 2**20:,.2f} MiB), {cached} cached-free"
    )
    return (
        '<div class="kvscope-kvbar" style="font-size:0.85rem">'
        '<div style="display:flex;height:14px;border:1px solid #888;border-radius:3px;overflow:hidden">'
        f'<div style="width:{pu:.2f}%;background:#0072B2"></div>'
        f'<div style="width:{pc:.2f}%;background:#BDBDBD"></div></div>'
        f"<div>{html.escape(text)}</div></div>"
    )
