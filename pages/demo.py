"""Demo: the release-freeze afternoon (and speculation) told in chapters, played from recorded
traces, with every caption taken from the trace's own events; any chapter can be run live."""

from __future__ import annotations

import html
import uuid
from pathlib import Path

import streamlit as st

from engine.config import SamplingParams
from engine.observe import recording
from engine.observe.trace_events import Trace
from ui.figures import demo as D
from ui.figures import load as L
from ui.figures import pool, theme
from ui.figures import replay as R
from ui.widgets import engine_access as ea
from ui.widgets import mode, room, shell
from ui.widgets.batching_view import batching_view

shell.enter_app()

SS = st.session_state
TRACE_DIR = Path(__file__).resolve().parents[1] / "assets" / "traces"
SETS = {"release-freeze": "The release-freeze afternoon", "speculation": "Speculative decoding"}

st.title("Demo")
st.caption(
    "A guided tour, played back from traces the engine recorded on the default model (SmolLM2-135M, fp32, "
    "CPU). Each chapter jumps to the moment the trace shows it, and its caption is written from that "
    "moment's events: which request, how many blocks, the engine's own reason. Play it, scrub it, or run "
    "the same requests on the engine now."
)


@st.cache_resource(show_spinner=False)
def _trace(name: str, mtime: float) -> Trace:
    return R.load_demo_trace(TRACE_DIR / name)


which = st.segmented_control("Story", list(SETS), format_func=SETS.get, default="release-freeze", key="demo_set")
which = which or "release-freeze"
fname = D.RECORDINGS[which]["file"]
path = TRACE_DIR / fname
if not path.is_file():
    st.error(f"The recorded trace {fname} is missing from assets/traces (run scripts/record_demo_traces.py).")
    st.stop()
trace = _trace(fname, path.stat().st_mtime)
chs = D.chapters(trace, which)
n = len(trace.snapshots)
tick_key = f"demo_tick_{which}"
play_key = f"demo_play_{which}"
if not isinstance(SS.get(tick_key), int) or not 0 <= SS[tick_key] < n:
    first = next((c.moment.tick for c in chs if c.moment is not None), 0)
    SS[tick_key] = first
SS.setdefault(play_key, False)
st.html(f"<p style='font-size:0.85rem;margin:0'>{R.summary_html(R.trace_summary(trace))}</p>")


def _goto(tick: int, chapter: int | None = None) -> None:
    SS[tick_key] = max(0, min(n - 1, tick))
    SS[play_key] = False
    SS[f"demo_pick_{which}"] = chapter


# ------------------------------------------------------------------ chapters
cols = st.columns(len(chs))
for i, (col, c) in enumerate(zip(cols, chs)):
    with col:
        label = f"{i + 1}. {c.short}"
        if c.moment is None:
            st.button(label, key=f"demo_ch_{which}_{c.key}", disabled=True, width="stretch")
            st.caption(c.missing)
        else:
            st.button(label, key=f"demo_ch_{which}_{c.key}", on_click=_goto, args=(c.moment.tick, i), width="stretch")

# ------------------------------------------------------------------ transport
c = st.columns([1, 1, 1, 2])
c[0].button("◀ Step", key="demo_back", on_click=lambda: _goto(SS[tick_key] - 1), width="stretch")
c[1].button(
    "Pause" if SS[play_key] else "▶ Play",
    key="demo_play_btn",
    type="primary",
    width="stretch",
    on_click=lambda: SS.__setitem__(play_key, not SS[play_key]),
)
c[2].button("Step ▶", key="demo_fwd", on_click=lambda: _goto(SS[tick_key] + 1), width="stretch")
speed = c[3].select_slider("Speed (recorded snapshots per second)", D.SPEEDS, value=1.0, key="demo_speed")


@st.fragment(run_every=mode.run_every(D.PLAY_INTERVAL_S, active=bool(SS.get(play_key))))
def player() -> None:
    if SS.get(play_key):
        nxt, end = D.advance(SS[tick_key], n, float(speed))
        SS[tick_key] = nxt
        if end:
            SS[play_key] = False
            st.rerun()  # the whole page: the Play button comes back and the timer stops
    tick = st.slider(
        "Scrubber (one recorded snapshot each)",
        0,
        n - 1,
        key=tick_key,
        on_change=lambda: SS.__setitem__(play_key, False),
    )
    view = R.view_at(trace, tick)
    snap = view.snapshot
    cur = D.current_chapter(chs, tick, SS.get(f"demo_pick_{which}"))
    with st.container(border=True):
        if cur is None:
            st.markdown("**Before the first chapter.** Press Play or pick a chapter.")
        else:
            ch = chs[cur]
            st.markdown(f"**Chapter {cur + 1} · {html.escape(ch.title)}**")
            st.caption(ch.intro)
            st.html(f"<p style='margin:0.2rem 0'>{html.escape(ch.moment.caption)}</p>")
            if ch.moment.step != snap.step:
                st.caption(
                    f"(the moment is step {ch.moment.step}; the charts show the recorded snapshot at step "
                    f"{snap.step}, the trace keeps one snapshot every few steps)"
                )
    m = snap.metrics
    k = st.columns(6)
    k[0].metric("Engine step", snap.step)
    k[1].metric("Running / waiting", f"{m.num_running} / {m.num_waiting}")
    k[2].metric("KV blocks used", f"{m.num_blocks_used} / {snap.info.num_blocks}")
    k[3].metric(
        "Demand (blocks)",
        D.kv_demand_blocks(snap),
        help="blocks the requests in the engine would need for their whole context right now",
    )
    k[4].metric("Preemptions", m.num_preemptions_total)
    if which == "speculation":
        a = m.spec.acceptance_rate
        k[5].metric(
            "Acceptance so far",
            "—" if a is None else f"{a:.2f}",
            help="accepted / proposed draft tokens, all requests so far",
        )
    else:
        k[5].metric("Prefix hit rate", f"{100 * m.prefix_cache_hit_rate:.0f}%")
    t0 = trace.snapshots[0].time
    a, b = st.columns(2)
    with a:
        ea.chart(L.kv_usage_figure(view.series, t0), key="demo_kv")
    with b:
        ea.chart(L.counts_figure(view.series, t0), key="demo_counts")
    batching_view(view.events, key="demo_batching", max_steps=80)
    key_snap = next((s for s in reversed(view.series) if s.blocks), None)
    if key_snap is not None:
        with st.expander(f"Block pool at step {key_snap.step}", expanded=False):
            ea.chart(pool.pool_map_figure(key_snap), key="demo_pool")
            st.html(theme.block_legend_html())


player()

# ------------------------------------------------------------------ run it live
st.subheader("Run this story live")
th = ea.get_engine()
if th is None:
    st.info(f"The engine is not available: {ea.engine_error()}")
    st.stop()
info = th.snapshot().info
rec_cfg = D.RECORDINGS[which]["config"]
st.caption(
    f"Submits the same requests to the shared engine now ({info.model}, {info.num_blocks} blocks of "
    f"{info.block_size} tokens, speculation {info.speculative or 'off'}). The recording used "
    f"{rec_cfg['num_kv_blocks']} blocks of {rec_cfg['block_size']}"
    + (" and n-gram speculation with k=4" if which == "speculation" else "")
    + "; with other settings the same chapters may happen at other steps or not at all — the captions "
    "below are found in the live run's own events the same way."
    + (
        " Second turns carry placeholder replies of the asked length, as in the recording (its prompts are "
        "built before the run); the Concurrent load page runs release-freeze with the model's own answers."
        if which == "release-freeze"
        else ""
    )
)
run_key = f"demo_live_{which}"
if st.button("Run this story live", key=f"demo_live_btn_{which}"):
    reqs = D.speculation_requests(th.tokenizer) if which == "speculation" else D.release_freeze_requests()
    run_id = f"D{uuid.uuid4().hex[:4]}"
    now = th.snapshot()
    rec = recording.SnapshotRecorder(run_id, start_time=now.time, start_seq=th.events.last_seq)
    feeder = recording.LoadFeeder(
        room.submitter(th),
        reqs,
        lambda r: SamplingParams(**r.sampling_kwargs()),
        run_id,
        time_scale=mode.current().time_scale,
        bound_to=th,
    )
    SS[run_key] = {"run_id": run_id, "feeder": feeder, "rec": rec}
    feeder.start()

live = SS.get(run_key)
if live:

    def _running() -> bool:
        fs = live["feeder"].snapshot_status()
        return not fs.done or L.run_request_ids_pending(th.snapshot(), fs.request_ids) > 0

    every = mode.wait_or_poll(_running, tick=lambda: live["rec"].poll(th))

    @st.fragment(run_every=every)
    def live_view() -> None:
        rec: recording.SnapshotRecorder = live["rec"]
        snap = rec.poll(th)
        fs = live["feeder"].snapshot_status()
        pending = L.run_request_ids_pending(snap, fs.request_ids)
        st.caption(
            f"Live run {live['run_id']}: {fs.submitted} of {fs.total} submitted, {pending} still in the "
            f"engine{', ' + str(fs.rejected) + ' refused' if fs.rejected else ''}."
        )
        snaps = rec.trace_snapshots()
        if snaps:
            ltrace = Trace(snaps, list(rec.events))
            rows = []
            for i, ch in enumerate(D.chapters(ltrace, which)):
                rows.append(
                    f"<li><b>{i + 1}. {html.escape(ch.title)}</b>: "
                    f"{html.escape(ch.moment.caption if ch.moment else 'not (yet) seen: ' + ch.missing)}</li>"
                )
            st.html("<ul style='margin:0'>" + "".join(rows) + "</ul>")
        batching_view(rec.events, key="demo_live_batching", max_steps=80)
        if every and fs.done and not pending:
            st.rerun()  # the run just ended: a full rerun stops the polling

    live_view()
