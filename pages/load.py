"""Concurrent load: launch a workload scenario against the shared engine and watch its memory."""

from __future__ import annotations

import uuid

import streamlit as st

from engine.config import SamplingParams
from engine.lab.workloads import SCENARIOS, conversation_chain, make_workload, summarize
from engine.observe import recording
from ui.figures import events_table as et
from ui.figures import load as L
from ui.widgets import engine_access as ea
from ui.widgets import mode, room, shell
from ui.widgets.batching_view import batching_view

shell.enter_app()

SS = st.session_state

st.title("Concurrent load")
st.caption(
    "Many requests at once on the shared engine. Each running request holds KV blocks that grow "
    "with every token; when the pool runs dry the scheduler must make someone wait or preempt a "
    "running request (recompute drops its blocks, swap copies them to CPU). Everything below is "
    "read from the engine's snapshots and events while the load runs."
)

th = ea.require_engine()
cfg = ea.engine_config()
snap0 = th.snapshot()

# ------------------------------------------------------------------ launch form
SCEN_HELP = {
    "release-freeze": "code-review conversations arriving within a window, each turn re-sending the "
    "whole conversation so contexts grow (the seed's release-freeze afternoon). With 'real answers' "
    "on, a later turn is sent once the previous one has finished (at its arrival time or then, "
    "whichever is later) and carries the model's own answer token for token, so its prefix-cache "
    "hit reaches into the blocks the engine wrote while generating that answer. Off, the replies "
    "are placeholder text of the asked length and every turn arrives on its own schedule.",
    "shared-system-prompt": "one long system prompt with many different user questions behind it",
    "mixed": "independent requests with lognormal prompt and output lengths",
}
scenario = st.segmented_control("Scenario", list(SCENARIOS), default="release-freeze", key="load_scenario")
scenario = scenario or "release-freeze"
st.caption(SCEN_HELP[scenario])
mml = snap0.info.max_model_len
with st.form("load_form"):
    c = st.columns(4)
    n = c[0].number_input("Requests", 1, recording.MAX_LOAD_REQUESTS, 24, key="load_n")
    seed = c[1].number_input("Seed", 0, 10_000, 0, key="load_seed")
    tiers = c[2].multiselect(
        "Tiers (picked at random)",
        sorted(cfg.tiers),
        default=[],
        key="load_tiers",
        help="each tier caps prompt + max tokens; a request over its cap is rejected",
    )
    if scenario == "release-freeze":
        turns = c[3].number_input("Turns per conversation", 1, 12, 4, key="load_turns")
    else:
        rate = c[3].number_input(
            "Arrival rate (req/s, 0 = all at once)",
            0.0,
            1000.0,
            2.0 if scenario == "shared-system-prompt" else 0.0,
            key="load_rate",
        )
    c = st.columns(4)
    if scenario == "release-freeze":
        window = c[0].number_input("Arrival window (s)", 0.1, 600.0, 10.0, key="load_window")
    elif scenario == "shared-system-prompt":
        system_words = c[0].number_input("System prompt (words)", 1, 4000, min(300, mml // 4), key="load_sys")
    else:
        c[0].empty()
    pmax_default = max(8, min(400, mml // 4))
    p_med = c[1].number_input(
        "Prompt median (words)",
        1,
        100_000,
        16 if scenario == "shared-system-prompt" else min(60, pmax_default),
        key="load_pmed",
    )
    o_med = c[2].number_input("Output median (tokens)", 1, 4096, 32, key="load_omed")
    o_max = c[3].number_input("Output max (tokens)", 1, 4096, 96, key="load_omax")
    if scenario == "release-freeze":
        chained = st.toggle(
            "Later turns carry the model's own answers",
            value=True,
            key="load_chained",
            help="each later turn waits for the previous one and re-sends its answer token for token; "
            "off: placeholder replies, every turn on its own arrival schedule",
        )
    launch = st.form_submit_button("Launch load", type="primary")


def _params() -> dict:
    p = {"output_median": float(o_med), "output_max": int(max(o_max, 1)), "output_min": 1, "tiers": list(tiers) or None}
    if scenario == "release-freeze":
        p.update(
            turns=int(turns),
            window_s=float(window),
            prompt_median=float(p_med),
            prompt_min=1,
            prompt_max=max(int(p_med), pmax_default),
            context_max=max(int(p_med), pmax_default, mml // 3),
        )
    elif scenario == "shared-system-prompt":
        p.update(
            system_words=int(system_words),
            prompt_median=float(p_med),
            prompt_min=1,
            prompt_max=max(int(p_med), 80),
            arrival_rate=float(rate) or None,
        )
    else:
        p.update(
            prompt_median=float(p_med),
            prompt_min=1,
            prompt_max=max(int(p_med), pmax_default),
            arrival_rate=float(rate) or None,
        )
    return p


def _stop_run(abort: bool) -> None:
    run = SS.get("load_run")
    if not run:
        return
    run["feeder"].stop()
    if abort:
        for rid in run["feeder"].snapshot_status().request_ids:
            try:
                th.abort(rid)
            except Exception:
                pass


if launch:
    try:
        reqs = make_workload(scenario, int(n), int(seed), **_params())
    except ValueError as e:
        st.error(f"Workload not built: {e}")
        reqs = None
    if reqs:
        _stop_run(abort=False)
        run_id = f"L{uuid.uuid4().hex[:4]}"
        now = th.snapshot()
        rec = recording.SnapshotRecorder(run_id, start_time=now.time, start_seq=th.events.last_seq)
        feeder = recording.LoadFeeder(
            room.submitter(th),
            reqs,
            lambda r: SamplingParams(**r.sampling_kwargs()),
            run_id,
            time_scale=mode.current().time_scale,
            bound_to=th,
            chain=conversation_chain(th.tokenizer) if scenario == "release-freeze" and chained else None,
        )
        SS["load_run"] = {
            "run_id": run_id,
            "feeder": feeder,
            "rec": rec,
            "scenario": scenario,
            "summary": summarize(reqs),
            "chained": scenario == "release-freeze" and chained,
            "first_turns": summarize([r for r in reqs if r.parent_id is None]),
            "t0": now.time,
        }
        feeder.start()

run = SS.get("load_run")

# ------------------------------------------------------------------ controls while running
with st.container(border=True):
    c = st.columns([3, 1, 1])
    cur = th.snapshot().info
    cap = max(
        cfg.num_kv_blocks or 0,
        cur.num_blocks,
        max((s.info.num_blocks for s in run["rec"].series), default=0) if run else 0,
    )
    with c[0].form("budget_form", border=False):
        new_budget = st.slider(
            "KV budget (blocks) — tighten it mid-run to make the server preempt",
            1,
            int(cap),
            int(cur.num_blocks),
            key="load_budget",
        )
        if st.form_submit_button("Apply budget") and room.operator_only("The KV budget"):
            try:
                th.set_kv_budget(int(new_budget))
                st.toast(f"KV budget set to {int(new_budget)} blocks")
            except ValueError as e:
                st.error(f"Budget not changed: {e}")
    if run:
        if c[1].button("Stop feeding", help="no new arrivals; submitted requests finish", key="load_stop"):
            _stop_run(abort=False)
        if c[2].button("Abort this load", help="stop feeding and abort its unfinished requests", key="load_abort"):
            _stop_run(abort=True)

if not run:
    st.info("No load launched in this session yet. Pick a scenario and press **Launch load**.")
    if L.origin_html(th.snapshot()):
        st.html(L.origin_html(th.snapshot()))  # requests sent to the OpenAI API (same engine)
    st.stop()


def _running() -> bool:
    """The run still has something to draw: the feeder is sending, or one of its requests is in the
    engine (the handles are the engine's final word: the published snapshot can predate a submit)."""
    fs = run["feeder"].snapshot_status()
    return (
        not fs.done
        or L.run_request_ids_pending(th.snapshot(), fs.request_ids) > 0
        or room.outcomes(fs.request_ids)["in_flight"] > 0
    )


every = mode.wait_or_poll(_running, tick=lambda: run["rec"].poll(th))


@st.fragment(run_every=every)
def live() -> None:
    rec: recording.SnapshotRecorder = run["rec"]
    snap = rec.poll(th)
    fs = run["feeder"].snapshot_status()
    pending = L.run_request_ids_pending(snap, fs.request_ids)
    m = snap.metrics
    c = st.columns(6)
    c[0].metric("Submitted", f"{fs.submitted} / {fs.total}")
    c[1].metric("Rejected at submit", fs.rejected)
    c[2].metric("Running/waiting", f"{m.num_running} / {m.num_waiting}")
    c[3].metric("Preempted/swapped", f"{m.num_preempted} / {m.num_swapped}", help="right now")
    c[4].metric("Preemptions", m.num_preemptions_total, help="total since the engine started")
    used_b, pool_b = m.num_blocks_used * snap.info.bytes_per_block, snap.info.num_blocks * snap.info.bytes_per_block
    c[5].metric(
        "KV in use",
        f"{100 * m.kv_cache_usage_perc:.0f}% · {L.format_bytes(used_b)}",
        help=f"{m.num_blocks_used} of {snap.info.num_blocks} blocks owned by requests: "
        f"{used_b:,} of {pool_b:,} bytes ({snap.info.bytes_per_block:,} bytes per block)",
    )
    state = "feeding" if not fs.done else ("draining" if pending else "done")
    s = run["summary"]
    st.caption(
        f"Run {run['run_id']} · {run['scenario']} · {state} · {s.get('requests', 0)} requests, "
        + (
            f"first-turn prompts {f1.get('prompt_words_min', 0)}–{f1.get('prompt_words_max', 0)} words "
            "(each later turn re-sends the conversation with the model's own answers), "
            if run.get("chained") and (f1 := run.get("first_turns"))
            else f"prompts {s.get('prompt_words_min', 0)}–{s.get('prompt_words_max', 0)} words, "
        )
        + f"{s.get('max_tokens_total', 0)} output tokens asked in total. "
        "Counts and charts are engine-wide (other sessions' requests included)."
    )
    if L.origin_html(snap):
        st.html(L.origin_html(snap))  # requests sent to the OpenAI API, tagged with their origin
    oc = room.outcomes(fs.request_ids)
    st.caption(
        f"This run's requests: {oc['finished']} finished, {oc['aborted']} aborted, "
        f"{oc['failed'] + fs.rejected} rejected or failed, {oc['in_flight']} in flight"
        + (f", {fs.skipped} later turn(s) not sent because an earlier turn did not finish" if fs.skipped else "")
        + "."
    )
    if fs.rebuilt:
        st.warning("Feeding stopped: the shared engine was rebuilt, so the rest of this load was not submitted.")
    if rec.restarts:
        st.warning(
            "The shared engine was rebuilt during this run (settings changed or a restart), which "
            "aborted its in-flight requests; the charts restart from the rebuilt engine's first step."
        )
    if fs.errors:
        with st.expander(f"{len(fs.errors)} request(s) refused or skipped at submission — the reasons"):
            st.code("\n".join(fs.errors[:50]), language=None)
    series = rec.series
    t0 = run["t0"] if not rec.restarts else None
    # Figures are rebuilt only when the engine has stepped since the last poll: building four
    # Plotly figures costs far more than the 0.25 s between polls on a busy CPU.
    fkey = (run["run_id"], series[-1].step if series else -1, len(series))
    cached = SS.get("load_figs")
    if cached is None or cached[0] != fkey:
        cached = (
            fkey,
            [
                L.counts_figure(series, t0),
                L.growth_figure(series, t0),
                L.kv_usage_figure(series, t0),
                L.percentiles_figure(series, t0),
            ],
        )
        SS["load_figs"] = cached
    f_counts, f_growth, f_kv, f_pct = cached[1]
    a, b = st.columns(2)
    with a:
        ea.chart(f_counts, key="load_counts")
        ea.chart(f_growth, key="load_growth")
    with b:
        ea.chart(f_kv, key="load_kv")
        ea.chart(f_pct, key="load_pct")
    batching_view(rec.events, key="load_batching")
    pct = L.latency_percentiles(snap)
    st.html(L.percentile_table_html(pct, L.percentile_counts(snap)))
    st.subheader("Event log")
    kinds = st.multiselect(
        "Kinds", list(et.MEMORY_KINDS) + list(et.NOISY_KINDS[2:4]), default=list(et.DEFAULT_KINDS), key="load_kinds"
    )
    evs = list(rec.events)
    counts = et.count_by_kind(evs)
    st.caption(" · ".join(f"{k}: {counts[k]}" for k in sorted(counts)) or "no events yet")
    st.html(et.events_html(et.filter_events(evs, kinds)))
    if every and not _running():
        st.rerun()  # the run just ended: a full rerun stops the polling


live()
st.download_button(
    "Download this run's trace (JSONL)",
    data=run["rec"].trace_text,
    file_name=f"kvscope-load-{run['run_id']}.jsonl",
    mime="application/jsonl",
    key="load_download",
    on_click="ignore",
)
st.caption("Open a downloaded trace on the Replay page to scrub through it step by step.")
