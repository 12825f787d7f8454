"""The Prefix cache page's side-channel section (seed 002's warning): figures and summary rows
over engine.side_channel probes (pure), and the section itself (Streamlit, `render`)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import side_channel as sc
from ui import theme

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


def render(st, th, *, small: bool, chart) -> None:
    """The section: controls, the measurement on the shared engine, the result."""
    st.subheader("The timing side channel, and per-tenant salts")
    st.caption(
        "A shared prefix cache is visible from outside: a request whose prompt starts with blocks someone "
        "else already computed gets its first token sooner. Here a second tenant (the attacker) probes "
        "whether a victim's prompt prefix is cached by timing only its own requests. Each trial uses a fresh "
        "random prefix; in half of them the victim ran it just before. The attacker's rule: a TTFT below the "
        "midpoint of the two medians (fitted in the shared setting) means cached. Then the same probes with a "
        "cache_salt per tenant: the victim's blocks are no longer reachable from the attacker's requests."
    )
    ss = st.session_state
    with st.form("sc_form", border=True):
        c = st.columns(3)
        prefix_tokens = c[0].number_input(
            "Prefix length (tokens)",
            min_value=8,
            max_value=sc.MAX_PREFIX_TOKENS,
            value=32 if small else 256,
            step=16,
            key="sc_prefix",
        )
        rounds = c[1].number_input(
            "Rounds (each: 4 probes, alternated)",
            min_value=1,
            max_value=sc.MAX_ROUNDS,
            value=3 if small else 8,
            key="sc_rounds",
        )
        c[2].caption("Runs on the shared engine: each probe records whether another request ran beside it.")
        go_ = st.form_submit_button("Measure the side channel")
    if go_:
        bar = st.progress(0.0, text="probing…")
        try:
            probes = sc.measure(
                th,
                prefix_tokens=int(prefix_tokens),
                rounds=int(rounds),
                on_probe=lambda p, i, n: bar.progress(i / n, text=f"probe {i} of {n}"),
            )
            bs = th.config.block_size
            ss["sc_result"] = {"probes": probes, "prefix": int(prefix_tokens) - int(prefix_tokens) % bs}
        except ValueError as e:
            st.error(f"Not measured: {e}")
        except Exception as e:  # noqa: BLE001 - engine down or timed out: a message, not a traceback
            st.error(f"Measurement failed: {type(e).__name__}: {e}")
        bar.empty()
    res = ss.get("sc_result")
    if not res:
        st.info("Press **Measure the side channel** to run the probes.")
        return
    probes, prefix = res["probes"], res["prefix"]
    thr = sc.threshold(probes)
    acc_shared, acc_salted = sc.accuracy(probes, "shared", thr), sc.accuracy(probes, "salted", thr)
    hr_shared, hr_salted = sc.hit_rate(probes, "shared", prefix), sc.hit_rate(probes, "salted", prefix)
    with st.container(key="sc_numbers"):
        c = st.columns(4)
        c[0].metric(
            "Guess right, shared cache",
            "—" if acc_shared is None else f"{100 * acc_shared:.0f}%",
            help="in-sample: the threshold is fitted on these same shared-cache probes",
        )
        c[1].metric(
            "Guess right, per-tenant salt",
            "—" if acc_salted is None else f"{100 * acc_salted:.0f}%",
            help="the same threshold on the salted probes; 50% is a coin toss",
        )
        c[2].metric(
            "Cross-tenant sharing, shared",
            "—" if hr_shared is None else f"{100 * hr_shared:.0f}%",
            help="share of the victim's prefix served from the cache to the other tenant",
        )
        c[3].metric(
            "Cross-tenant sharing, salted",
            "—" if hr_salted is None else f"{100 * hr_salted:.0f}%",
            help="what the salt costs: identical prefixes of different tenants are computed again",
        )
    chart(ttft_figure(probes, thr), key="sc_fig")
    st.dataframe(summary_rows(probes, prefix), hide_index=True, width="stretch")
    n_cont = sum(p.contended for p in probes)
    st.caption(
        f"{len(probes)} probes of a {prefix}-token prefix, rounds alternating the order of the four cells. "
        "TTFT is the engine's arrival → first token for the attacker's request; "
        + (
            f"{n_cont} probe(s) ran while another request was in the engine, which moves their TTFT."
            if n_cont
            else "no other request was in the engine during any probe."
        )
    )
