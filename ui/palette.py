"""TEMPORARY stand-in for ui/theme.py (owned by the app-shell engineer) so the memory pages can be
built and tested before it lands. Okabe-Ito colours (colour-blind safe). Replaced by imports from
ui.theme as soon as that module exists."""
from __future__ import annotations

import hashlib

import plotly.graph_objects as go

INK = "#222222"
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000")

_STATE = {"running": "#0072B2", "waiting": "#E69F00", "preempted": "#D55E00", "swapped": "#CC79A7",
          "finished": "#009E73", "rejected": "#000000", "aborted": "#999999"}
_DASH = {"running": "solid", "waiting": "dash", "preempted": "dot", "swapped": "dashdot"}
_BLOCK = {"used": "#0072B2", "cached": "#56B4E9", "free": "#E8E8E8"}
_EVENT = {"admit": "#0072B2", "reject": "#000000", "wait": "#E69F00", "preempt": "#D55E00",
          "swap_out": "#CC79A7", "swap_in": "#CC79A7", "evict": "#D55E00", "prefix_hit": "#009E73",
          "prefix_evict": "#56B4E9", "cow": "#F0E442", "finish": "#009E73", "abort": "#999999",
          "error": "#000000", "config": "#999999"}
_PCT = {50: "#0072B2", 90: "#E69F00", 99: "#D55E00"}


def apply_layout(fig: go.Figure, height: int = 300) -> go.Figure:
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=50, r=10, t=40, b=60),
                      font=dict(family="sans-serif", size=12), transition={"duration": 0})
    return fig


def state_colour(state: str) -> str:
    return _STATE.get(state, "#999999")


def state_dash(state: str) -> str:
    return _DASH.get(state, "solid")


def block_colour(state: str) -> str:
    return _BLOCK.get(state, "#999999")


def event_colour(kind: str) -> str:
    return _EVENT.get(kind, "#BBBBBB")


def percentile_colour(p: int) -> str:
    return _PCT.get(p, "#999999")


def request_colour(request_id: str) -> str:
    h = int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16)
    return OKABE_ITO[h % 7]
