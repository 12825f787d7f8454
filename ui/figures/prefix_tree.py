"""The prefix cache of a live server rebuilt from its KV events, as a tree of block-hash chains.

A `BlockStored` event carries a run of block hashes, the hash of the block before them
(`parent_block_hash`) and the tokens of those blocks; `BlockRemoved` drops hashes; `AllBlocksCleared`
empties the cache. Applied in order they give the set of cached blocks and, through the parent
links, the chains (one per cached prefix) that branch where requests diverged. A block whose parent
was evicted first hangs under "(parent not cached)".

Per block the tree keeps when it was stored (age) and its reuse: how many chains continue through it
beyond the first (requests that shared it and went on differently) plus repeated `BlockStored`
reports for it (vLLM reports hits this way when a request asks for kv_cache_report_mode="full").
Pure Python plus one Plotly figure builder; token text is HTML-escaped wherever it is shown.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import plotly.graph_objects as go

from engine.observe.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored

ROOT = "cache"
ORPHANS = "orphans"
MAX_NODES = 50_000  # beyond this the oldest blocks are dropped from the view (counted)
MAX_DRAWN = 1_500  # nodes drawn in the figure (the most recent chains)


@dataclass(slots=True)
class Node:
    parent: object | None
    tokens: tuple[int, ...]
    stored_at: float
    reports: int = 1
    children: set = field(default_factory=set)


def hash_label(h) -> str:
    """16 hex digits: a 64-bit int hash in full, the first 8 bytes of a bytes hash."""
    if isinstance(h, bytes):
        return h.hex()[:16]
    return f"{h & ((1 << 64) - 1):016x}"


class PrefixTree:
    def __init__(self, max_nodes: int = MAX_NODES):
        self.nodes: dict[object, Node] = {}
        self.max_nodes = max_nodes
        self.dropped = 0  # nodes forgotten past max_nodes
        self.removed = 0
        self.cleared = 0
        self.stored_events = 0
        self.block_size: int | None = None  # tokens per block, as the last BlockStored said

    def __len__(self) -> int:
        return len(self.nodes)

    def hashes(self) -> set:
        return set(self.nodes)

    def _remove(self, h) -> None:
        n = self.nodes.pop(h, None)
        if n is None:
            return
        p = self.nodes.get(n.parent)
        if p is not None:
            p.children.discard(h)

    def apply(self, events, t: float) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.stored_events += 1
                bs = e.block_size
                self.block_size = bs
                whole = len(e.token_ids) == bs * len(e.block_hashes)
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    toks = tuple(e.token_ids[i * bs : (i + 1) * bs]) if whole else ()
                    node = self.nodes.get(h)
                    if node is not None:
                        node.reports += 1
                    else:
                        self.nodes[h] = Node(parent, toks, t)
                        p = self.nodes.get(parent)
                        if p is not None:
                            p.children.add(h)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if h in self.nodes:
                        self.removed += 1
                    self._remove(h)
            elif isinstance(e, AllBlocksCleared):
                self.cleared += 1
                self.nodes.clear()
        while len(self.nodes) > self.max_nodes:
            self._remove(next(iter(self.nodes)))  # dicts keep insertion order: oldest first
            self.dropped += 1

    def leaves_under(self) -> dict:
        """Number of chain ends (leaves) at or below each node."""
        memo: dict = {}
        order = list(self.nodes)
        # children are stored after their parents (a child's event names an already stored parent)
        for h in reversed(order):
            n = self.nodes[h]
            kids = [memo[c] for c in n.children if c in memo]
            memo[h] = sum(kids) if kids else 1
        return memo

    def reuse(self) -> dict:
        leaves = self.leaves_under()
        return {h: (leaves.get(h, 1) - 1) + (n.reports - 1) for h, n in self.nodes.items()}

    def chains(self) -> int:
        return sum(1 for n in self.nodes.values() if not n.children)

    def roots(self) -> list:
        return [h for h, n in self.nodes.items() if n.parent is None or n.parent not in self.nodes]


def block_text(tokens, decode, limit: int = 200) -> str:
    """HTML-escaped text of a block's tokens, cut to `limit` characters before escaping (empty
    when there is no decoder or no tokens)."""
    if not tokens or decode is None:
        return ""
    try:
        s = decode(list(tokens))
    except Exception:  # a tokenizer that rejects ids (another vocabulary) just shows no text
        return ""
    return html.escape(s if len(s) <= limit else s[: limit - 1] + "…")


def tree_figure(
    tree: PrefixTree, now: float, color_by: str = "age", decode=None, max_drawn: int = MAX_DRAWN, height: int = 520
) -> go.Figure:
    """Icicle of the cached chains: one cell per block, the root at the top, each chain going down;
    coloured by age (seconds since stored) or by reuse."""
    if color_by not in ("age", "reuse"):
        raise ValueError("color_by must be 'age' or 'reuse'")
    keep = list(tree.nodes)[-max_drawn:]
    kept = set(keep)
    reuse = tree.reuse() if color_by == "reuse" or keep else {}
    ids, parents, labels, hover, colors = [ROOT], [""], ["cached blocks"], ["all cached chains"], [0.0]
    orphan_used = False
    for h in keep:
        n = tree.nodes[h]
        pid = hash_label(n.parent) if n.parent in kept else None
        if pid is None:
            pid = ROOT if n.parent is None else ORPHANS
            orphan_used = orphan_used or pid == ORPHANS
        text = block_text(n.tokens, decode)
        short = block_text(n.tokens, decode, 24)
        age = max(0.0, now - n.stored_at)
        ids.append(hash_label(h))
        parents.append(pid)
        labels.append(short or hash_label(h)[-8:])
        hover.append(
            f"block {hash_label(h)}<br>age {age:.1f} s · reuse {reuse.get(h, 0)}"
            f"<br>{len(n.tokens)} tokens" + (f": {text}" if text else "")
        )
        colors.append(age if color_by == "age" else float(reuse.get(h, 0)))
    if orphan_used:
        ids.append(ORPHANS)
        parents.append(ROOT)
        labels.append("(parent not cached)")
        hover.append("blocks whose parent block was evicted before them")
        colors.append(0.0)
    scale = "Viridis_r" if color_by == "age" else "YlOrRd"
    shown = f"{len(keep)} of {len(tree)} cached blocks" if len(keep) < len(tree) else f"{len(tree)} cached blocks"
    return icicle_figure(
        ids,
        parents,
        labels,
        hover,
        dict(
            colors=colors,
            colorscale=scale,
            showscale=True,
            colorbar=dict(title="age (s)" if color_by == "age" else "reuse"),
        ),
        f"Prefix cache rebuilt from KV events: {shown}, {tree.chains()} chains",
        height,
    )


def icicle_figure(ids, parents, labels, hover, marker: dict, title: str, height: int = 520) -> go.Figure:
    """The icicle every prefix tree is drawn as (one server's here, the fleet's merged one in
    ui/figures/fleet.py): one cell per block, the root at the top, each chain going down. Labels
    and hover texts must already be escaped."""
    fig = go.Figure(
        go.Icicle(
            ids=ids,
            parents=parents,
            labels=labels,
            hovertext=hover,
            hoverinfo="text",
            marker=marker,
            tiling=dict(orientation="v"),
            maxdepth=12,
        )
    )
    fig.update_layout(
        title=dict(text=title, x=0, font=dict(size=14)),
        height=height,
        margin=dict(l=10, r=10, t=40, b=10),
        paper_bgcolor="white",
    )
    return fig
