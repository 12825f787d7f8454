"""Replay: open a recorded trace and scrub through it one tick at a time."""

from __future__ import annotations

import hashlib
from pathlib import Path

import streamlit as st

from ui.figures import demo as D
from ui.figures import events_table as et
from ui.figures import load as L
from ui.figures import pool, theme
from ui.figures import replay as R
from ui.widgets import engine_access as ea
from ui.widgets import mode, shell
from ui.widgets.batching_view import batching_view

shell.enter_app()

SS = st.session_state
TRACE_DIR = Path(__file__).resolve().parents[1] / "assets" / "traces"

st.title("Replay")
st.caption(
    "A trace is the engine's own record of a run: a snapshot per step (queues, per-request token and block "
    "counts, metrics, and at keyframes the whole block pool) plus its events. Every live page can download "
    "one. Here the same charts are drawn again from the file, at whichever step you pick."
)

demos = R.demo_traces(TRACE_DIR)
source = st.radio(
    "Trace", ["Recorded demo", "Upload a file"] if demos else ["Upload a file"], horizontal=True, key="rp_source"
)


def _load(key: str, read) -> None:
    """Parse once per distinct file (kept in the session); a bad file shows the reader's message."""
    if SS.get("rp_key") == key and SS.get("rp_trace") is not None:
        return
    SS["rp_key"], SS["rp_trace"] = key, None
    SS.pop("rp_tick", None)
    try:
        SS["rp_trace"] = read()
    except ValueError as e:
        SS["rp_error"] = (key, str(e))


wanted = None
if source == "Recorded demo":
    name = st.selectbox("Demo trace", list(demos), key="rp_demo")
    wanted = f"demo:{name}"
    _load(wanted, lambda: R.load_demo_trace(demos[name]))
else:
    up = st.file_uploader(
        "Trace file (JSON Lines, as downloaded from a live page)", type=["jsonl", "txt"], key="rp_upload"
    )
    if up is not None:
        data = up.getvalue()
        wanted = "upload:" + hashlib.sha256(data).hexdigest()
        _load(wanted, lambda: R.load_trace_bytes(data))

err = SS.get("rp_error")
if err and err[0] == wanted:
    st.error(f"Not a usable trace: {err[1]}")
trace = SS.get("rp_trace") if wanted is not None and SS.get("rp_key") == wanted else None
if trace is None:
    st.info(
        "Pick a recorded demo or upload a trace (.jsonl) downloaded from the Concurrent load, Prefix cache, "
        "Paged vs contiguous or Cache vs no-cache pages."
    )
    st.stop()

summary = R.trace_summary(trace)
st.html(f"<p style='font-size:0.9rem;margin:0'>{R.summary_html(summary)}</p>")

n = len(trace.snapshots)
if n > 1:
    if not isinstance(SS.get("rp_tick"), int) or not 0 <= SS["rp_tick"] < n:
        SS["rp_tick"] = R.interesting_tick(trace)
    if isinstance(SS.get("rp_next_tick"), int):  # auto-play's step, applied before the slider exists
        SS["rp_tick"] = min(n - 1, SS.pop("rp_next_tick"))
    pc = st.columns([1, 3])
    playing = bool(SS.get("rp_play"))
    pc[0].button(
        "Pause" if playing else "▶ Play",
        key="rp_play_btn",
        width="stretch",
        on_click=lambda: SS.__setitem__("rp_play", not SS.get("rp_play")),
    )
    speed = pc[1].select_slider("Speed (recorded snapshots per second)", D.SPEEDS, value=1.0, key="rp_speed")
    tick = st.slider(
        "Tick (one recorded snapshot each)", 0, n - 1, key="rp_tick", on_change=lambda: SS.__setitem__("rp_play", False)
    )
else:
    tick = 0
view = R.view_at(trace, tick)
snap = view.snapshot
prev = trace.snapshots[tick - 1].step if tick > 0 else None
m = snap.metrics
c = st.columns(6)
c[0].metric("Engine step", snap.step)
c[1].metric("Time", f"{snap.time - trace.snapshots[0].time:.2f} s")
c[2].metric("Running/waiting", f"{m.num_running} / {m.num_waiting}")
c[3].metric("Preempted/swapped", f"{m.num_preempted} / {m.num_swapped}")
c[4].metric("KV blocks used", f"{m.num_blocks_used} / {snap.info.num_blocks}")
c[5].metric("Preemptions", m.num_preemptions_total, help="total so far")

t0 = trace.snapshots[0].time
a, b = st.columns(2)
with a:
    ea.chart(L.counts_figure(view.series, t0), key="rp_counts")
    ea.chart(L.growth_figure(view.series, t0), key="rp_growth")
with b:
    ea.chart(L.kv_usage_figure(view.series, t0), key="rp_kv")
    ea.chart(L.percentiles_figure(view.series, t0), key="rp_pct")
batching_view(view.events, key="rp_batching")

st.subheader("Block pool")
key_snap = next((s for s in reversed(view.series) if s.blocks), None)
if key_snap is None:
    st.caption("This trace holds no block map up to this tick (traces keep the pool only at keyframes).")
else:
    if key_snap.step != snap.step:
        st.caption(f"Pool as recorded at step {key_snap.step}, the latest keyframe at or before this tick.")
    ea.chart(pool.pool_map_figure(key_snap), key="rp_pool")
    st.html(theme.block_legend_html())

st.subheader("Requests at this tick")
rows = [
    {
        "request": r.request_id,
        "state": r.state,
        "prompt tokens": r.prompt_len,
        "output tokens": r.output_len,
        "tokens in KV": r.num_computed_tokens,
        "blocks": len(r.block_table),
        "from prefix cache": r.num_cached_tokens,
        "preemptions": r.num_preemptions,
        "waiting reason": r.waiting_reason or "",
    }
    for r in snap.requests[:200]
]
if rows:
    st.dataframe(rows, hide_index=True, width="stretch", height=min(400, 38 + 35 * len(rows)))
else:
    st.caption("No requests in the engine at this tick.")

st.subheader("Events")
now_evs = R.events_between(trace.events, prev, snap.step)
kinds = st.multiselect(
    "Kinds",
    sorted(set(et.MEMORY_KINDS) | {e.kind for e in trace.events}),
    default=[k for k in et.DEFAULT_KINDS],
    key="rp_kinds",
)
st.caption(f"{len(now_evs)} event(s) since the previous tick; newest first, up to this tick:")
st.html(et.events_html(et.filter_events(view.events, kinds)))

if n > 1 and SS.get("rp_play") and mode.paced(D.PLAY_INTERVAL_S):
    # auto-play: after one interval, rerun at the next tick (stops by itself at the end)
    nxt, end = D.advance(tick, n, float(speed))
    SS["rp_next_tick"] = nxt
    if end:
        SS["rp_play"] = False
    st.rerun()
