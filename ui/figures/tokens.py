"""The token strip: a request's generated tokens as escaped HTML chips.

Kinds (ui.figures.theme.TOKEN_STYLES): plain, accepted, bonus, replaced (shown after the rejected draft
token it replaced, which is struck through), evicted (K/V dropped and recomputed). Every token
text goes through `visible_text`, which HTML-escapes it and makes invisible characters visible:
spaces-only tokens, newlines, tabs, control characters, zero-width and bidi-control characters;
each chip is bidi-isolated so right-to-left text cannot reorder the strip.
"""

from __future__ import annotations

import html
import unicodedata
from collections import Counter

from engine.observe.rates import accept_probability

from . import theme
from .theme import ACCEPTED, BONUS, EVICTED, PLAIN, REJECTED, REPLACED, TOKEN_STYLES

MAX_TOKEN_CHARS = 40  # longer token texts are cut (full text in the tooltip)
MAX_STRIP_TOKENS = 1500  # the strip shows the most recent tokens beyond this

_WS = {" ": "␣", "\n": "↵", "\r": "␍", "\t": "⇥"}


def _marker(text: str) -> str:
    return (
        '<span style="font-size:0.75em;color:#6B4E00;background:#FFF5CC;border-radius:2px;'
        f'padding:0 1px">{html.escape(text)}</span>'
    )


def visible_text(text: str, max_chars: int = MAX_TOKEN_CHARS) -> str:
    """Escaped HTML for one token's text, with invisible characters made visible."""
    if text is None:
        text = ""
    text = str(text)
    if text == "":
        return _marker("∅")
    cut = len(text) > max_chars
    shown = text[:max_chars] if cut else text
    only_space = shown.strip(" ") == ""
    out = []
    for ch in shown:
        cat = unicodedata.category(ch)
        if ch == " ":
            out.append(_marker("␣") if only_space else " ")
        elif ch in _WS:
            out.append(_marker(_WS[ch]))
        elif cat == "Cc":
            out.append(_marker(f"\\x{ord(ch):02x}"))
        elif cat in ("Cf", "Zl", "Zp", "Co", "Cs", "Cn") or ch in "\u034f\u115f\u1160\u3164\uffa0":
            # zero-width, bidi controls (LRO/RLO/isolates), separators, private/unassigned:
            # never passed through raw; shown as their code point.
            out.append(_marker(f"U+{ord(ch):04X}"))
        elif cat == "Zs":  # other spaces (no-break, em space, ...)
            out.append(_marker(f"U+{ord(ch):04X}"))
        else:
            out.append(html.escape(ch))
    if cut:
        out.append(_marker(f"…+{len(text) - max_chars}"))
    return "".join(out)


def _title(text: str) -> str:
    """Tooltip text: the raw token as a Python literal (shows escapes), attribute-escaped."""
    return html.escape(repr(str(text))[:300], quote=True)


def _chip(kind: str, text: str, extra_title: str = "") -> str:
    s = TOKEN_STYLES[kind]
    sym = (
        f'<span aria-hidden="true" style="font-size:0.75em;margin-right:2px">{html.escape(s["symbol"])}</span>'
        if s["symbol"]
        else ""
    )
    title = html.escape(s["label"], quote=True) + ": " + _title(text) + extra_title
    return (
        f'<span class="tok tok-{kind}" title="{title}" style="display:inline-block;margin:2px 2px;'
        f"padding:0 3px;border:{s['border']};border-radius:3px;background:{s['bg']};color:{s['color']};"
        f"white-space:pre;font-family:ui-monospace,monospace;font-size:0.85rem;line-height:1.5;"
        f'unicode-bidi:isolate;direction:ltr">{sym}<bdi style="text-decoration:{s["deco"]}">'
        f"{visible_text(text)}</bdi></span>"
    )


def _num(x) -> str:
    return f"{float(x):.3g}"


def decision_text(mark) -> tuple[str, str]:
    """(judged draft's hover text, emitted token's hover text) from a TokenMark's rejection-sampling
    numbers; ("", "") when it has none (greedy, plain decoding, traces recorded before them)."""
    p, q, u = getattr(mark, "p", None), getattr(mark, "q", None), getattr(mark, "u", None)
    if p is None:
        return "", ""
    if mark.kind == BONUS:
        return "", f" — sampled from the target's distribution after the last accepted draft: p = {_num(p)}"
    if q is None or u is None:
        return "", ""
    a = accept_probability(p, q)
    judged = f" — target p = {_num(p)}, draft q = {_num(q)}, accept with min(1, p/q) = {_num(a)}; drew u = {_num(u)}"
    if mark.kind == ACCEPTED:
        return "", judged + " → accepted"
    if mark.kind == REPLACED:
        return judged + " → rejected", " — sampled from the residual max(0, p − q), renormalised"
    return "", ""


def token_chips(mark, evicted: bool = False) -> str:
    """HTML for one TokenMark: a replaced token renders as the struck-through rejected draft
    followed by the target's replacement. With rejection sampling each chip's tooltip holds the
    p, q and draw behind its verdict."""
    kind = mark.kind if mark.kind in TOKEN_STYLES else PLAIN
    judged_title, own_title = (html.escape(t, quote=True) for t in decision_text(mark))
    parts = []
    if kind == REPLACED:
        rejected = (
            mark.rejected_text
            if mark.rejected_text is not None
            else (f"#{mark.rejected_id}" if mark.rejected_id is not None else "?")
        )
        parts.append(_chip(REJECTED, rejected, extra_title=judged_title))
    if evicted:
        parts.append(
            _chip(EVICTED, mark.text, extra_title=" (" + html.escape(TOKEN_STYLES[kind]["label"]) + ")" + own_title)
        )
    else:
        parts.append(_chip(kind, mark.text, extra_title=own_title))
    if "\n" in (mark.text or ""):
        parts.append("<br>")
    return "".join(parts)


def recomputed_before_step(evict_steps) -> int | None:
    """`evicted_before_step` for the strip from the steps of a request's evictions: an eviction
    happens between two engine steps, after its event's step, so every token made at or before
    the last one had its K/V dropped and recomputed."""
    steps = list(evict_steps)
    return max(steps) + 1 if steps else None


def token_strip_html(
    tokens,
    *,
    evicted_before_step: int | None = None,
    max_tokens: int = MAX_STRIP_TOKENS,
    prompt_evicted_tokens: int = 0,
) -> str:
    """The whole strip. Tokens produced before `evicted_before_step` had their K/V evicted and
    recomputed; they are marked as such (their speculative kind stays in the tooltip)."""
    tokens = tuple(tokens)
    parts = ['<div class="kvscope-tokens" dir="ltr" style="line-height:1.9;unicode-bidi:isolate">']
    if prompt_evicted_tokens:
        s = TOKEN_STYLES[EVICTED]
        parts.append(
            f'<span class="tok tok-evicted-prompt" style="display:inline-block;margin:2px;padding:0 4px;'
            f'border:{s["border"]};background:{s["bg"]};border-radius:3px;font-size:0.8rem">'
            f"{html.escape(s['symbol'])} prompt: {int(prompt_evicted_tokens)} tokens recomputed</span>"
        )
    hidden = max(0, len(tokens) - max_tokens)
    if hidden:
        parts.append(f'<span style="color:#666;font-size:0.8rem">… {hidden} earlier tokens not drawn … </span>')
    for m in tokens[hidden:]:
        ev = evicted_before_step is not None and m.step < evicted_before_step
        parts.append(token_chips(m, evicted=ev))
    if not tokens:
        parts.append('<span style="color:#666;font-size:0.85rem">no tokens yet</span>')
    parts.append("</div>")
    return "".join(parts)


def token_counts(tokens) -> dict[str, int]:
    """Counts per kind; `rejected` counts replaced tokens (one rejection each)."""
    c = Counter(getattr(m, "kind", PLAIN) for m in tokens)
    return {PLAIN: c[PLAIN], ACCEPTED: c[ACCEPTED], BONUS: c[BONUS], REPLACED: c[REPLACED], REJECTED: c[REPLACED]}


def strip_with_legend(tokens, **kw) -> str:
    return theme.token_legend_html() + token_strip_html(tokens, **kw)
