"""The event log as an HTML table: filtered by kind, newest first, capped, every text escaped.

Pure functions of `engine.observe.trace_events.Event`s; no Streamlit here. Event reasons, request ids and
detail values come from the engine (and from prompts, indirectly), so every cell goes through
`html.escape` — a request id like `<img onerror=…>` renders as text.
"""

from __future__ import annotations

import html
from typing import Iterable, Sequence

from engine.observe.trace_events import (
    ABORT,
    ADMIT,
    BLOCK_ALLOC,
    BLOCK_FREE,
    CONFIG,
    COW,
    DECODE,
    ERROR,
    EVICT,
    FINISH,
    PREEMPT,
    PREFILL,
    PREFIX_EVICT,
    PREFIX_HIT,
    REJECT,
    SPEC_FALLBACK,
    SPEC_VERIFY,
    SWAP_IN,
    SWAP_OUT,
    WAIT,
    Event,
)
from ui.figures import theme

_O = theme.OKABE_ITO
# Event kind -> bar colour. Dropped-KV decisions share the preempted/evicted colour of ui.figures.theme,
# swaps the swapped colour; the kind is always written out too, so colour is never the only cue.
EVENT_COLORS = {
    ADMIT: _O["blue"],
    REJECT: _O["black"],
    WAIT: _O["orange"],
    PREEMPT: theme.PHASE_COLORS["preempted"],
    EVICT: theme.PHASE_COLORS["preempted"],
    SWAP_OUT: theme.PHASE_COLORS["swapped"],
    SWAP_IN: theme.PHASE_COLORS["swapped"],
    PREFIX_HIT: _O["bluish_green"],
    PREFIX_EVICT: _O["yellow"],
    COW: _O["yellow"],
    FINISH: "#9E9E9E",
    ABORT: "#9E9E9E",
    ERROR: _O["vermillion"],
    CONFIG: theme.INK,
}


def event_colour(kind: str) -> str:
    return EVENT_COLORS.get(kind, "#C8C8C8")


# Kinds the memory pages offer in their filter, in the order a reader meets them.
MEMORY_KINDS = (
    ADMIT,
    REJECT,
    WAIT,
    PREEMPT,
    SWAP_OUT,
    SWAP_IN,
    EVICT,
    PREFIX_HIT,
    PREFIX_EVICT,
    COW,
    FINISH,
    ABORT,
    ERROR,
    CONFIG,
)
# Default selection: the memory decisions themselves (no per-step chatter).
DEFAULT_KINDS = (ADMIT, REJECT, PREEMPT, SWAP_OUT, SWAP_IN, EVICT, PREFIX_HIT, ABORT, ERROR, CONFIG)
# Noisy kinds (one per step or per block) — offered, not selected by default.
NOISY_KINDS = (PREFILL, DECODE, BLOCK_ALLOC, BLOCK_FREE, SPEC_VERIFY, SPEC_FALLBACK)

MAX_ROWS = 200
MAX_CELL = 160


def _clip(s: str, n: int = MAX_CELL) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_fmt_value(x) for x in list(v)[:8])
        return f"[{inner}{', …' if len(v) > 8 else ''}]"
    return str(v)


def event_details(ev: Event) -> str:
    """Every data field except the reason, as `k=v` pairs (plain text, not escaped yet)."""
    parts = [f"{k}={_fmt_value(v)}" for k, v in ev.data.items() if k != "reason"]
    return "; ".join(parts)


def filter_events(
    events: Iterable[Event], kinds: Iterable[str] | None = None, request_id: str | None = None, limit: int = MAX_ROWS
) -> list[Event]:
    """The newest `limit` events of the given kinds (all kinds when None), newest first."""
    ks = None if kinds is None else set(kinds)
    out = [e for e in events if (ks is None or e.kind in ks) and (request_id is None or e.request_id == request_id)]
    out.sort(key=lambda e: e.seq, reverse=True)
    return out[: max(0, limit)]


def event_rows(events: Sequence[Event]) -> list[dict]:
    """Plain-text rows (unescaped) — for tests and CSV-like views."""
    return [
        {
            "step": e.step,
            "time_s": round(e.time, 3),
            "kind": e.kind,
            "request": e.request_id or "",
            "reason": str(e.data.get("reason", "")),
            "details": event_details(e),
        }
        for e in events
    ]


def count_by_kind(events: Iterable[Event]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0) + 1
    return out


_STYLE = (
    "<style>"
    ".kvs-ev{border-collapse:collapse;width:100%;font-size:0.8rem;font-family:ui-monospace,monospace}"
    ".kvs-ev th{text-align:left;border-bottom:1px solid #999;padding:2px 6px;position:sticky;top:0;background:#fff}"
    ".kvs-ev td{border-bottom:1px solid #e4e4e4;padding:2px 6px;vertical-align:top;"
    "overflow-wrap:anywhere;unicode-bidi:plaintext}"
    ".kvs-ev .k{font-weight:600;white-space:nowrap}"
    ".kvs-ev .n{white-space:nowrap;text-align:right}"
    ".kvs-ev .r{min-width:9em;overflow-wrap:anywhere}"
    ".kvs-ev-wrap{max-height:360px;overflow-y:auto}"
    "</style>"
)


def events_html(events: Sequence[Event], *, empty: str = "No events of the selected kinds yet.") -> str:
    """An HTML table of the given events (already filtered/ordered), every cell escaped.
    The kind is shown as text with a coloured bar, so colour is never the only signal."""
    if not events:
        return f"<p><em>{html.escape(empty)}</em></p>"
    rows = []
    for r, e in zip(event_rows(events), events):
        colour = event_colour(e.kind)
        rows.append(
            "<tr>"
            f"<td class='n'>{r['step']}</td>"
            f"<td class='n'>{r['time_s']:.3f}</td>"
            f"<td class='k' style='border-left:4px solid {colour}'>{html.escape(r['kind'])}</td>"
            f"<td class='r'>{html.escape(_clip(r['request'], 64))}</td>"
            f"<td>{html.escape(_clip(r['reason']))}</td>"
            f"<td>{html.escape(_clip(r['details']))}</td>"
            "</tr>"
        )
    head = "<tr><th>step</th><th>t (s)</th><th>kind</th><th>request</th><th>reason</th><th>details</th></tr>"
    return _STYLE + "<div class='kvs-ev-wrap'><table class='kvs-ev'>" + head + "".join(rows) + "</table></div>"
