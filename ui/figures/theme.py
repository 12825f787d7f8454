"""One colour palette and one legend for every page.

Colours come from the Okabe-Ito palette (distinguishable with the common colour-vision
deficiencies), and no meaning is carried by hue alone: every token kind and block state also
has a symbol, a border style or a text decoration, so the views read in greyscale too.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

# Okabe & Ito (2008), "Color Universal Design".
OKABE_ITO = {
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
    "black": "#000000",
}

# Per-request colours, in the order requests are assigned them. Black is kept for text/outlines,
# yellow last because it is the weakest on white.
REQUEST_COLORS: tuple[str, ...] = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#D55E00",  # vermillion
    "#F0E442",  # yellow
    "#6F4E7C",  # dark purple (beyond Okabe-Ito; lightness differs from all above)
    "#8C6D31",  # brown
    "#3B7D7D",  # teal grey
)

INK = "#222222"  # text, outlines
GRID = "#D9D9D9"

# --------------------------------------------------------------------------- block states
FREE, CACHED, USED, SHARED = "free", "cached", "used", "shared"


@dataclass(frozen=True, slots=True)
class Style:
    key: str
    label: str
    color: str  # fill
    symbol: str  # shown in the legend and, where space allows, on the element itself
    description: str


BLOCK_STATES: dict[str, Style] = {
    FREE: Style(FREE, "free", "#F4F4F4", "·", "empty block, never used or its prefix-cache entry was dropped"),
    CACHED: Style(
        CACHED,
        "cached-free",
        "#BDBDBD",
        "c",
        "no owner (ref count 0) but its K/V are still indexed by the prefix cache and can be reused",
    ),
    USED: Style(USED, "used", REQUEST_COLORS[0], "■", "held by one request; coloured by that request"),
    SHARED: Style(
        SHARED,
        "shared",
        REQUEST_COLORS[0],
        "×n",
        "held by n requests at once (prefix sharing); the cell shows its ref count n",
    ),
}

# --------------------------------------------------------------------------- token kinds
PLAIN, ACCEPTED, REJECTED, BONUS, REPLACED, EVICTED = ("plain", "accepted", "rejected", "bonus", "replaced", "evicted")

# Each kind: fill, border, text decoration and a leading symbol, so hue is never the only cue.
TOKEN_STYLES: dict[str, dict] = {
    PLAIN: dict(
        label="plain decode",
        symbol="",
        bg="#FFFFFF",
        border="1px solid #C8C8C8",
        deco="none",
        color=INK,
        description="one token from one pass of the target model (no speculation)",
    ),
    ACCEPTED: dict(
        label="draft accepted",
        symbol="✓",
        bg="#D4ECF9",
        border="1px solid #0072B2",
        deco="none",
        color=INK,
        description="guessed by the drafter and confirmed by the target's verify pass",
    ),
    REJECTED: dict(
        label="draft rejected",
        symbol="✗",
        bg="#FBE3D0",
        border="1px dashed #D55E00",
        deco="line-through",
        color="#7A3300",
        description="guessed by the drafter, refused by the target; the run of accepted tokens stops here",
    ),
    REPLACED: dict(
        label="target's replacement",
        symbol="→",
        bg="#FFF3C4",
        border="2px solid #E69F00",
        deco="none",
        color=INK,
        description="the target model's own token, emitted in place of the rejected draft",
    ),
    BONUS: dict(
        label="bonus token",
        symbol="+",
        bg="#CDEFE3",
        border="2px solid #009E73",
        deco="underline",
        color=INK,
        description="every draft token was accepted, so the verify pass yields one extra token",
    ),
    EVICTED: dict(
        label="KV evicted, recomputed",
        symbol="↻",
        bg="#F2E1EC",
        border="2px dotted #CC79A7",
        deco="none",
        color=INK,
        description="its keys and values were dropped from the cache and had to be recomputed",
    ),
}

# --------------------------------------------------------------------------- phases
PHASE_COLORS = {
    "waiting": "#E0E0E0",
    "prefill": "#E69F00",
    "decode": "#0072B2",
    "preempted": "#CC79A7",
    "swapped": "#56B4E9",
    "finished": "#9E9E9E",
}
PHASE_PATTERNS = {  # Plotly bar pattern shapes, so phases differ without colour too
    "waiting": "",
    "prefill": "/",
    "decode": "",
    "preempted": "x",
    "swapped": ".",
    "finished": "",
}


class RequestColors:
    """Stable request → colour assignment: requests get palette colours in first-seen order.
    With more requests than colours the palette repeats; hover text always names the request."""

    def __init__(self, request_ids=()):
        self._index: dict[str, int] = {}
        for rid in request_ids:
            self.index(rid)

    def index(self, request_id: str) -> int:
        if request_id not in self._index:
            self._index[request_id] = len(self._index) % len(REQUEST_COLORS)
        return self._index[request_id]

    def color(self, request_id: str) -> str:
        return REQUEST_COLORS[self.index(request_id)]

    def __contains__(self, request_id) -> bool:
        return request_id in self._index

    def items(self):
        return [(rid, REQUEST_COLORS[i]) for rid, i in self._index.items()]


def request_colors_for(snapshot) -> RequestColors:
    """The colour map every page uses for a snapshot: requests in arrival order."""
    reqs = sorted(snapshot.requests, key=lambda r: (r.arrival_time, r.request_id))
    return RequestColors(r.request_id for r in reqs)


def text_color_on(bg: str) -> str:
    """Black or white, whichever reads better on `bg` (#RRGGBB), by WCAG relative luminance."""
    r, g, b = (int(bg[i : i + 2], 16) / 255 for i in (1, 3, 5))
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    lum = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#FFFFFF"


def short_id(request_id: str, n: int = 10) -> str:
    s = str(request_id)
    return s if len(s) <= n else s[: n - 1] + "…"


# --------------------------------------------------------------------------- legends (HTML)


def _chip(bg: str, border: str, text: str, deco: str = "none", color: str = INK) -> str:
    return (
        f'<span style="display:inline-block;min-width:1.6em;padding:0 4px;margin-right:4px;'
        f"background:{bg};border:{border};border-radius:3px;text-decoration:{deco};"
        f'color:{color};font-family:monospace;text-align:center">{html.escape(text)}</span>'
    )


def token_legend_html(kinds=(ACCEPTED, REJECTED, REPLACED, BONUS, EVICTED, PLAIN)) -> str:
    items = []
    for k in kinds:
        s = TOKEN_STYLES[k]
        sample = (s["symbol"] + "tok") if s["symbol"] else "tok"
        items.append(
            f'<span title="{html.escape(s["description"])}" style="margin-right:14px;white-space:nowrap">'
            f"{_chip(s['bg'], s['border'], sample, s['deco'], s['color'])}{html.escape(s['label'])}</span>"
        )
    return '<div class="kvscope-legend" style="font-size:0.85rem;line-height:2">' + "".join(items) + "</div>"


def block_legend_html() -> str:
    items = []
    for key in (FREE, CACHED, USED, SHARED):
        s = BLOCK_STATES[key]
        border = (
            "1px solid #888" if key in (FREE, CACHED) else f"2px solid {INK}" if key == SHARED else "1px solid #888"
        )
        fg = INK if key in (FREE, CACHED) else "#FFFFFF"
        items.append(
            f'<span title="{html.escape(s.description)}" style="margin-right:14px;white-space:nowrap">'
            f"{_chip(s.color, border, s.symbol, color=fg)}{html.escape(s.label)}</span>"
        )
    return '<div class="kvscope-legend" style="font-size:0.85rem;line-height:2">' + "".join(items) + "</div>"


def base_layout(height: int, title: str | None = None, **kw) -> dict:
    """Common Plotly layout: fixed height, no animation, white background, readable fonts."""
    lay = dict(
        height=height,
        margin=dict(l=50, r=20, t=40 if title else 16, b=40),
        plot_bgcolor="#FFFFFF",
        paper_bgcolor="#FFFFFF",
        font=dict(family="sans-serif", size=12, color=INK),
        transition=dict(duration=0),
        hoverlabel=dict(namelength=-1),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
    )
    if title:
        lay["title"] = dict(text=html.escape(title), x=0, font=dict(size=14))
    lay.update(kw)
    return lay


COMPARE_A, COMPARE_B = OKABE_ITO["blue"], OKABE_ITO["vermillion"]  # the two sides of every comparison


def comparison_layout(fig, title: str, height: int = 320, **kw):
    """Lay out a comparison page's Plotly figure: its title at the top, subplot titles under it,
    the legend below the x axes (so neither covers the other), fixed height."""
    fig.update_layout(**base_layout(height, title, margin=dict(l=60, r=15, t=64, b=100), **kw))
    fig.update_layout(
        title=dict(y=0.99, yref="container", yanchor="top"),
        legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0, font=dict(size=11)),
    )
    fig.update_annotations(font=dict(size=12))  # subplot titles
    fig.update_xaxes(gridcolor=GRID, zerolinecolor=GRID)
    fig.update_yaxes(gridcolor=GRID, zerolinecolor=GRID)
    return fig
