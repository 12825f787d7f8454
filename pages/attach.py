"""Attach: look inside a live server — a kvscope `serve` (everything, from its snapshot stream) or a
vLLM (its /metrics and KV events)."""

from __future__ import annotations

import time

import streamlit as st

from ui.figures import events_table as et
from ui.figures import load as L
from ui.figures import pool, theme
from ui.figures import prefix_tree as P
from ui.figures import vllm_metrics as vm
from ui.servers import attach as A
from ui.widgets import engine_access as ea
from ui.widgets import mode, shell

shell.enter_app()

SS = st.session_state
REFRESH_S = 2.0  # the page redraws every 2 s; the session scrapes /metrics every 1 s in the background

st.title("Attach to a live server")
st.caption(
    "Point kvscope at a running server. A kvscope server (`python -m engine serve`) streams its snapshots and "
    "events, so every chart of the live pages is drawn here. A vLLM server (or anything exposing vLLM's "
    "metric names) is read from its `/metrics` once a second, and, given its KV-events endpoint (vLLM started "
    "with `--kv-events-config`), its prefix cache is rebuilt block by block from the events."
)

with st.form("at_form"):
    base = st.text_input("Base URL", value=SS.get("at_base", "http://127.0.0.1:8000"), key="at_base_in")
    key = st.text_input("API key (optional)", type="password", key="at_key_in")
    c = st.columns([3, 3, 2, 2])
    ev_ep = c[0].text_input(
        "KV events endpoint (optional)",
        placeholder="tcp://127.0.0.1:5557",
        key="at_ev_in",
        help="Left empty, a vLLM's own list (GET /kv_event_sources) is used when it has one.",
    )
    rp_ep = c[1].text_input("KV events replay endpoint (optional)", placeholder="tcp://127.0.0.1:5558", key="at_rp_in")
    topic = c[2].text_input("Topic", value="", key="at_topic_in")
    ev_mode = c[3].selectbox(
        "Events socket",
        A.EVENT_MODES,
        key="at_mode_in",
        help="vLLM binds its publisher only to a wildcard (tcp://*:5557) or ipc endpoint and connects to "
        "any other one, which this side must then bind. auto: bind exactly then.",
    )
    go_ = st.form_submit_button("Attach", type="primary")

if go_:
    old = SS.pop("at_session", None)
    if old is not None:
        old.stop()
    th = ea.get_engine()
    try:
        SS["at_session"] = A.AttachSession(
            base,
            key or None,
            ev_ep.strip() or None,
            rp_ep.strip() or None,
            topic,
            events_mode=ev_mode,
            tokenizer=th.tokenizer if th is not None else None,
        )
        SS.pop("at_error", None)
    except ValueError as e:
        SS["at_error"] = str(e)

if SS.get("at_error"):
    st.error(SS["at_error"])
sess: A.AttachSession | None = SS.get("at_session")
if sess is None:
    st.info("Enter the server's base URL and press Attach.")
    st.stop()
if st.button("Detach", key="at_detach"):
    sess.stop()
    SS.pop("at_session", None)
    st.rerun()


def _tree_section(sess: A.AttachSession, tok_ok: bool, tok_why: str) -> None:
    if not sess.events_endpoint:
        return
    st.subheader("Prefix cache from the KV events")
    with sess.lock:
        state, ev_err = sess.event_state, sess.event_error
        color_by = SS.get("at_color", "age")
        decode = sess.tokenizer.decode if (tok_ok and sess.tokenizer is not None) else None
        n = len(sess.tree)
        fig = P.tree_figure(sess.tree, time.monotonic(), color_by=color_by, decode=decode) if n else None
        counts = (n, sess.tree.chains(), sess.tree.removed, sess.tree.cleared)
    if ev_err:
        st.error(f"KV events: {ev_err}")
    st.radio(
        "Colour blocks by",
        ["age", "reuse"],
        horizontal=True,
        key="at_color",
        help="age: seconds since the block was stored; reuse: chains that continue through the block "
        "beyond the first, plus repeated BlockStored reports for it",
    )
    st.caption(
        f"{counts[0]} cached blocks in {counts[1]} chains · {counts[2]} removed · {counts[3]} clears · "
        + (
            f"{state.batches} batches (last seq {state.last_seq}, {state.replayed} replayed, "
            f"{state.missed} missed, wire {'/'.join(sorted(state.wires)) or '—'})"
            if state
            else ""
        )
        + (" · token text decoded: " if decode else " · no token text: ")
        + tok_why
        + f" · events socket {sess.events_endpoint}, {sess.events_mode_reason}"
    )
    if fig is not None:
        ea.chart(fig, key="at_tree")
    else:
        st.caption("No cached blocks yet.")


def _kvscope(sess: A.AttachSession) -> None:
    with sess.lock:
        snap, series, events = sess.snapshot, list(sess.series), list(sess.events)
        err, stream_mode = sess.last_error, sess.stream_mode
    if snap is None:
        st.info(f"Waiting for the first snapshot… {err or ''}")
        return
    st.caption(
        f"Reading {'the snapshot stream' if stream_mode == 'stream' else 'snapshots once a second'} of "
        f"{sess.base_url} · model {snap.info.model} · step {snap.step}" + (f" · {err}" if err else "")
    )
    m = snap.metrics
    c = st.columns(5)
    c[0].metric("Running · waiting", f"{m.num_running} · {m.num_waiting}")
    c[1].metric("KV blocks used", f"{m.num_blocks_used} / {snap.info.num_blocks}")
    c[2].metric("KV usage", f"{100 * m.kv_cache_usage_perc:.1f} %")
    c[3].metric("Preemptions", m.num_preemptions_total)
    c[4].metric("Events", len(events))
    t0 = series[0].time if series else None
    a, b = st.columns(2)
    with a:
        ea.chart(L.counts_figure(series, t0), key="at_counts")
        ea.chart(L.growth_figure(series, t0), key="at_growth")
    with b:
        ea.chart(L.kv_usage_figure(series, t0), key="at_kv")
        ea.chart(L.percentiles_figure(series, t0), key="at_pct")
    st.subheader("Block pool")
    ea.chart(pool.pool_map_figure(snap), key="at_pool")
    st.html(theme.block_legend_html())
    rids = [r.request_id for r in snap.requests if r.block_table]
    if rids:
        rid = st.selectbox("Block table of", rids, key="at_rid")
        ea.chart(pool.block_table_figure(snap, rid), key="at_table")
    st.subheader("Events")
    st.html(et.events_html(et.filter_events(events, et.DEFAULT_KINDS)))
    local = ea.model_name()
    same = snap.info.model == local or {snap.info.model, local} <= {"default", "tiny"}  # one tokenizer
    _tree_section(
        sess,
        same,
        "the server runs the same tokenizer as this app"
        if same
        else f"the server's model {snap.info.model!r} is not this app's {local!r}",
    )


def _vllm(sess: A.AttachSession) -> None:
    v = sess.vllm_view()
    rs = v["rows"]
    with sess.lock:
        err, n_err = sess.last_error, sess.scrape_errors
        tok_ok, tok_why = sess.tokenizer_ok, sess.tokenizer_reason
    st.caption(
        f"Scraping {sess.base_url}/metrics every {sess.interval:g} s ({len(rs)} scrapes kept)"
        + (f" · last error: {err}" if err else "")
        + (f" · {n_err} failed scrapes" if n_err else "")
    )
    for note in v["notes"]:
        st.warning(note, icon=":material/info:")
    if not rs:
        st.info("Waiting for the first scrape…")
    else:
        r = rs[-1]

        def fmt(x, f="{:.0f}"):
            return "—" if x is None else f.format(x)

        bs, bs_from = v["block_size"], v["block_size_from"]
        st.caption(
            f"Server block size: **{bs} tokens** (from {bs_from}); a prompt stores a block only once it fills one."
            if bs
            else "Server block size: not reported yet (vllm:cache_config_info or a BlockStored event tells it)."
        )
        c = st.columns(5)
        c[0].metric("Running · waiting", f"{fmt(r.running)} · {fmt(r.waiting)}")
        c[1].metric("KV cache usage", fmt(None if r.kv_usage is None else 100 * r.kv_usage, "{:.1f} %"))
        c[2].metric("Preemptions", fmt(r.preemptions))
        c[3].metric(
            f"Prefix hit rate ({sess.window_s:g} s)", fmt(None if r.hit_rate is None else 100 * r.hit_rate, "{:.1f} %")
        )
        c[4].metric("TTFT p50", fmt(None if r.ttft.get(0.5) is None else 1000 * r.ttft[0.5], "{:.0f} ms"))
        a, b = st.columns(2)
        with a:
            ea.chart(vm.queue_figure(rs), key="at_v_queue")
            ea.chart(vm.latency_figure(rs, "ttft"), key="at_v_ttft")
            ea.chart(vm.preemption_figure(rs), key="at_v_pre")
        with b:
            ea.chart(vm.kv_figure(rs), key="at_v_kv")
            ea.chart(vm.latency_figure(rs, "itl"), key="at_v_itl")
            if v["acceptance"]:
                ea.chart(vm.acceptance_figure(v["acceptance"]), key="at_v_acc")
            else:
                st.caption("No speculative decoding counters (vllm:spec_decode_…) on this server.")
    _tree_section(sess, tok_ok, tok_why)


@st.fragment(run_every=mode.run_every(REFRESH_S))
def _live() -> None:
    s = SS.get("at_session")
    if s is None:
        return
    s.touch()
    if s.resume():  # it stopped itself while the page was not refreshing (a background tab)
        st.info(
            "Reading resumed: this page had not refreshed for a while (the browser tab was in the "
            "background), so the session had paused."
        )
    st.caption(f"Attached to a **{s.kind}** server ({s.kind_reason}).")
    if s.kind == "kvscope":
        _kvscope(s)
    else:
        _vllm(s)


_live()
