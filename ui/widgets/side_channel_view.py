"""The Prefix cache page's side-channel section: its controls (`controls`) and the drawing of a
measurement's result (`result`, figures from ui/figures/side_channel.py). The page runs the
measurement itself (engine.side_channel.measure) between the two."""

from __future__ import annotations

import streamlit as st

from engine.lab import side_channel as sc
from ui.figures import side_channel as F
from ui.widgets import engine_access as ea


def controls(*, small: bool) -> tuple[int, int] | None:
    """The section's heading, explanation and form; (prefix tokens, rounds) when Measure was pressed."""
    st.subheader("The timing side channel, and per-tenant salts")
    st.caption(
        "A shared prefix cache is visible from outside: a request whose prompt starts with blocks someone "
        "else already computed gets its first token sooner. Here a second tenant (the attacker) probes "
        "whether a victim's prompt prefix is cached by timing only its own requests. Each trial uses a fresh "
        "random prefix; in half of them the victim ran it just before. The attacker's rule: a TTFT below the "
        "midpoint of the two medians (fitted in the shared setting) means cached. Then the same probes with a "
        "cache_salt per tenant: the victim's blocks are no longer reachable from the attacker's requests."
    )
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
    return (int(prefix_tokens), int(rounds)) if go_ else None


def result(res: dict | None) -> None:
    """A measurement's result ({"probes", "prefix"}: the probes and the prefix length they probed)
    as numbers, the TTFT figure, the summary table and the conditions; a hint before any."""
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
    ea.chart(F.ttft_figure(probes, thr), key="sc_fig")
    st.dataframe(F.summary_rows(probes, prefix), hide_index=True, width="stretch")
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
