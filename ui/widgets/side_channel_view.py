"""The Prefix cache page's side-channel section: its controls (`controls`) and the drawing of a
measurement's result (`result`, figures from ui/figures/side_channel.py); the same pair for the
packet-size channel (`packet_controls`, `packet_result`). The page runs the measurements itself
(engine.lab.side_channel.measure, engine.lab.packet_channel.measure) between the two."""

from __future__ import annotations

import streamlit as st

from engine.lab import packet_channel as pc
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


# ------------------------------------------------------------------ the packet-size channel
def packet_controls(*, small: bool) -> dict | None:
    """The packet-size section's heading, explanation and form; measure()'s arguments when pressed."""
    st.subheader("The packet-size side channel, and padding")
    st.caption(
        "Encryption hides what a packet says, not how long it is. This server streams an answer one chunk "
        "per token, so each encrypted record is the token's text plus a fixed overhead. Here the engine is "
        "served over TLS on 127.0.0.1 (a certificate made for the run) and a relay between the victim's "
        "client and the server writes down only each record's length and time — it holds no key. The victim "
        "asks one of a few known questions; the attacker knows the possible answers (it can ask the same "
        "public model) and picks the one whose token lengths fit the records. Then the same attack against "
        "three defences: the `obfuscation` field (random padding in each chunk, `stream_options."
        "include_obfuscation`, on by default as in OpenAI's API), several tokens per chunk "
        "(`stream_options.coalesce_tokens`) and chunks padded to a fixed size (`stream_options.pad_chunks_to`)."
    )
    with st.form("pk_form", border=True):
        c = st.columns(4)
        trials = c[0].number_input(
            "Trials (each: every defence)",
            min_value=1,
            max_value=pc.MAX_TRIALS,
            value=3 if small else 12,
            key="pk_trials",
        )
        candidates = c[1].number_input(
            "Possible questions", min_value=2, max_value=len(pc.QUESTIONS), value=4 if small else 8, key="pk_cands"
        )
        new_tokens = c[2].number_input(
            "Answer length (tokens)", min_value=2, max_value=pc.MAX_NEW_TOKENS, value=12 if small else 24, key="pk_new"
        )
        seed = c[3].number_input("Seed", min_value=0, max_value=2**31 - 1, value=0, key="pk_seed")
        st.caption(
            "Runs on the shared engine through its own TLS server; answers are greedy, so each question has one answer."
        )
        go_ = st.form_submit_button("Measure the packet sizes")
    if not go_:
        return None
    return {"trials": int(trials), "candidates": int(candidates), "new_tokens": int(new_tokens), "seed": int(seed)}


def packet_result(res) -> None:
    """A packet-size measurement (engine.lab.packet_channel.PacketResult): the attack's scores per
    defence, what the observer saw, the cost table and the conditions; a hint before any."""
    if res is None:
        st.info("Press **Measure the packet sizes** to stream answers through the observer.")
        return
    sums = res.summaries()
    by = {s.defence: s for s in sums}
    with st.container(key="pk_numbers"):
        c = st.columns(len(sums))
        for col, s in zip(c, sums):
            col.metric(
                f"Answer guessed: {F.SHORT.get(s.defence, s.label)}",
                f"{100 * s.accuracy:.0f}%",
                help=f"{s.label}; chance: {100 * s.chance:.0f}% (one of {res.candidates} possible answers)",
            )
    ea.chart(F.packet_accuracy_figure(sums), key="pk_acc_fig")
    ea.chart(F.packet_trace_figure(res), key="pk_trace_fig")
    st.dataframe(F.packet_rows(sums), hide_index=True, width="stretch")
    mismatched = sum(not t.answer_matches for t in res.trials)
    none = by.get("none")
    st.caption(
        f"{len(res.trials)} streamed answers of {res.new_tokens} tokens ({res.model}, {res.cipher}), "
        f"{res.candidates} possible questions, defences in turning order each trial. The observer's constants "
        f"come from one stream of its own: a content record is its text + {res.k} bytes, the last one "
        f"{res.k_last} more. Token lengths narrow each token to the vocabulary's tokens of that length"
        + (f": {none.bits_per_token:.1f} bits per token without a defence. " if none else ". ")
        + "Coalescing hides each token's length but not the lengths of the groups and the whole answer, "
        "so telling known answers apart still works; only padding removes the signal, for the bytes shown. "
        + (f"{mismatched} stream(s) differed from the attacker's copy of the answer." if mismatched else "")
    )
