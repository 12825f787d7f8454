"""The Claims page's table: one row per claim (engine.claims.ClaimRow) with its measurement, its
source, the verdict and why, as escaped HTML. Pure functions; no Streamlit."""

from __future__ import annotations

import html
from collections.abc import Iterable

VERDICT = {True: ("holds here", "#009E73"), False: ("does not hold here", "#D55E00"), None: ("not measured", "#7F7F7F")}


def row_html(r) -> str:
    """One ClaimRow as a table row; every text escaped (claims and sources name files and models)."""
    word, colour = VERDICT[r.holds]
    e = html.escape
    return (
        f"<tr><td style='vertical-align:top'><b>{e(r.claim)}</b><br><span style='color:#666;font-size:0.8rem'>"
        f"seeds {e(r.seeds)}</span></td>"
        f"<td style='vertical-align:top'>{e(r.measured)}<br><span style='color:#666;font-size:0.8rem'>"
        f"{e(r.source)}</span></td>"
        f"<td style='vertical-align:top;white-space:nowrap'><b style='color:{colour}'>{word}</b></td>"
        f"<td style='vertical-align:top;font-size:0.9rem'>{e(r.why)}</td></tr>"
    )


def claims_table_html(rows: Iterable) -> str:
    return (
        "<table style='width:100%;border-collapse:collapse;font-size:0.92rem' class='kv-claims'>"
        "<thead><tr><th style='text-align:left;width:28%'>claim</th><th style='text-align:left;width:30%'>"
        "measured here</th><th style='text-align:left'>verdict</th><th style='text-align:left'>why</th></tr></thead>"
        "<tbody>" + "".join(row_html(r) for r in rows) + "</tbody></table>"
        "<style>.kv-claims td,.kv-claims th{border-top:1px solid #ddd;padding:6px 8px}</style>"
    )
