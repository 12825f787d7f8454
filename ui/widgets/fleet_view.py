"""The Fleet page's Streamlit sections: where the fleet comes from (the embedded local fleet, servers
attached by URL, or a recorded fleet trace) and the views every source shares, drawn from
`engine.fleet.state` data by ui/figures/fleet.py.

The page never waits on the network: live sources are read through `ui.servers.fleet_session`,
whose threads do every request; a section only copies the latest snapshot.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import streamlit as st

from engine.fleet.state import FleetSnapshot, FleetTrace, PolicyRun, RequestRow, WhatIfRow
from ui.figures import fleet as F
from ui.servers import fleet_session as fs
from ui.widgets import engine_access as ea
from ui.widgets import mode

SS = st.session_state
TRACE_DIR = Path(__file__).resolve().parents[2] / "assets" / "traces"
SOURCES = ("Local fleet", "Attach to servers", "Recorded trace")

INTRO = (
    "Several engines behind one gateway. Each instance publishes its prefix-cache changes as KV events "
    "(a block stored, a block removed); applying every instance's stream rebuilds what each one holds. "
    "Put side by side, they show which prefixes the fleet keeps more than once, and, per request, "
    "whether the gateway sent it where its prefix already was."
)
TREE_HELP = (
    "One cell per distinct KV block, its parent above it: a chain from the top is one cached prefix. "
    "Blocks are identified by their hash, so the same tokens cached on two instances are one cell marked "
    "with both. Each copy beyond the first is a duplicated block: memory spent holding a prefix the "
    "fleet already has."
)
LEDGER_HELP = (
    "For each request sent through the gateway: the prefix tokens every instance held when it arrived "
    "(rebuilt from the events, ★ the best holder, the serving instance's cell shaded), the cached tokens the "
    "server reported in its usage, and the prefix tokens the router credited where its log says. A "
    "request with no hit either had a prefix no instance ever stored, or one evicted before it came, "
    "or it was sent away from the instance that held it."
)
RUNS_HELP = (
    "The same workload run once per policy, one after the other, each on cleared caches. The fleet hit "
    "rate is the cached tokens the servers reported over all prompt tokens."
)
SINGLE_RUN_HELP = (
    "One run of the workload through the gateway under this policy, on the caches as they were. The fleet "
    "hit rate is the cached tokens the servers reported over all prompt tokens."
)
WHATIF_HELP = (
    "The recorded requests and event log fed offline to other published routing rules: which instance "
    "each rule would have picked, and how many prefix tokens that instance held at the time by the "
    "recorded events. A replay of recorded events, not a measurement: no request was sent, and timing "
    "and load effects are not modelled."
)


def source_picker() -> str:
    return st.radio(
        "Fleet",
        SOURCES,
        horizontal=True,
        key="fl_source",
        help="Local fleet: kvscope servers and vLLM's router started here on 127.0.0.1. Attach: servers "
        "already running (kvscope, vLLM or SGLang: the same KV-event format). Recorded trace: a fleet "
        "session saved to a file.",
    )


# ----------------------------------------------------------------------------- recorded trace


def _load(key: str, read) -> None:
    if SS.get("fl_trace_key") == key and SS.get("fl_trace") is not None:
        return
    SS["fl_trace_key"], SS["fl_trace"], SS["fl_trace_error"] = key, None, None
    SS.pop("fl_tick", None)
    try:
        SS["fl_trace"] = read()
    except (ValueError, OSError) as e:
        SS["fl_trace_error"] = str(e)


def trace_picker(trace_dir: Path = TRACE_DIR) -> FleetTrace | None:
    """A recorded fleet trace: one of assets/traces/fleet_*.json, or an uploaded file."""
    demos = F.fleet_traces(trace_dir)
    opts = list(demos) + ["upload a file"]
    name = st.selectbox("Recorded fleet trace", opts, key="fl_trace_name")
    if name in demos:
        _load(f"demo:{name}", lambda: F.load_fleet_trace_bytes(demos[name].read_bytes()))
    else:
        up = st.file_uploader("Fleet trace (JSON, as saved by a live fleet)", type=["json"], key="fl_upload")
        if up is None:
            return None
        data = up.getvalue()
        _load("upload:" + hashlib.sha256(data).hexdigest(), lambda: F.load_fleet_trace_bytes(data))
    if SS.get("fl_trace_error"):
        st.error(f"Not a usable fleet trace: {SS['fl_trace_error']}")
    trace = SS.get("fl_trace")
    if trace is not None:
        st.caption("Recorded: " + F.trace_caption(trace))
    return trace


def snapshot_picker(trace: FleetTrace) -> FleetSnapshot:
    n = len(trace.snapshots)
    if n == 1:
        return trace.snapshots[0]
    if not isinstance(SS.get("fl_tick"), int) or not 0 <= SS["fl_tick"] < n:
        SS["fl_tick"] = n - 1
    i = st.slider("Snapshot (the fleet at one moment of the recording)", 0, n - 1, key="fl_tick")
    return trace.snapshots[i]


def draw_recorded(trace: FleetTrace) -> None:
    snap = snapshot_picker(trace)
    draw_snapshot(snap, key="rec", t0=trace.snapshots[0].t)
    if len(trace.snapshots) > 1:
        ea.chart(F.timeline_figure(trace.snapshots), key="fl_rec_timeline")
    runs_section(trace.runs, trace.whatif, F.instance_ids(snap))
    ledger_section(trace.requests, F.instance_ids(snap), key="rec")


# ----------------------------------------------------------------------------- shared sections


def summary_row(snap: FleetSnapshot, t0: float | None = None) -> None:
    up = sum(1 for i in snap.instances if i.up)
    c = F.tree_counts(snap.tree)
    cols = st.columns(4)
    cols[0].metric("Instances up", f"{up} / {len(snap.instances)}")
    cols[1].metric("Distinct cached blocks", f"{c['blocks']:,}")
    cols[2].metric(
        "Duplicated blocks",
        f"{c['duplicated_blocks']:,}",
        help="copies beyond the first of blocks held on more than one instance",
    )
    cols[3].metric("Duplicated KV bytes", F.fmt_bytes(c["duplicated_bytes"]))
    where = f"gateway {snap.router}, policy **{snap.policy or '—'}**" if snap.router else "no gateway"
    when = f"t = {snap.t - t0:,.1f} s" if t0 is not None else ""
    st.caption(" · ".join(x for x in (when, where) if x))


def draw_snapshot(snap: FleetSnapshot, *, key: str, t0: float | None = None) -> None:
    summary_row(snap, t0)
    st.subheader("Instances")
    if not snap.instances:
        st.info("No instance yet.")
        return
    st.html(F.instances_html(snap))
    st.subheader("Merged prefix tree")
    st.caption(TREE_HELP)
    ids = F.instance_ids(snap)
    st.caption(F.duplication_text(snap.tree))
    if snap.tree.nodes:
        ea.chart(F.merged_tree_figure(snap.tree, ids), key=f"fl_{key}_tree")
        st.html(F.holders_legend_html(ids))
        ea.chart(F.holdings_figure(snap), key=f"fl_{key}_holdings")


def runs_section(runs: tuple[PolicyRun, ...], whatif: tuple[WhatIfRow, ...], ids: list[str]) -> None:
    if not runs and not whatif:
        return
    st.subheader("Policies compared")
    if len(runs) > 1:
        st.caption(RUNS_HELP)
    elif runs:
        st.caption(SINGLE_RUN_HELP)
    ea.chart(F.hit_rate_figure(runs, whatif), key="fl_hit_fig")
    if runs:
        ea.chart(F.policy_figure(runs, ids), key="fl_runs_fig")
        st.markdown("**Measured runs**")
        st.html(F.policy_table_html(runs))
    if whatif:
        st.markdown("**What-if: " + F.REPLAY_LABEL + "**")
        st.caption(WHATIF_HELP)
        st.html(F.whatif_html(whatif))


def ledger_section(rows: tuple[RequestRow, ...], ids: list[str], *, key: str) -> None:
    if not rows:
        return
    st.subheader("Request ledger")
    st.caption(LEDGER_HELP)
    policies = list(dict.fromkeys(r.policy for r in rows if r.policy))
    shown = rows
    if len(policies) > 1:
        pick = st.segmented_control(
            "Requests of the run under", ["all"] + policies, default="all", key=f"fl_{key}_ledger_policy"
        )
        if pick and pick != "all":
            shown = tuple(r for r in rows if r.policy == pick)
    c = F.ledger_counts(shown)
    st.caption(
        f"{c['requests']} requests · {c['hits']} with a prefix hit · no hit: {c['never_stored']} never stored, "
        f"{c['evicted']} evicted first, {c['held_elsewhere']} held on another instance · "
        f"{c['on_best']} of {c['with_holder']} served by the best holder"
        + (
            f" · router credit equals the reported cached tokens on {c['credit_equal']} of {c['credit_known']}"
            if c["credit_known"]
            else " · the router reported no credited tokens"
        )
        + (f" · {c['errors']} failed" if c["errors"] else "")
    )
    st.html(F.ledger_html(shown, ids))


# ----------------------------------------------------------------------------- live fleets

REFRESH_S = 2.0
FALLBACK_POLICIES = ("round_robin", "kv_aware", "cache_aware")


def _policies() -> tuple[str, ...]:
    api, _ = fs.fleet_api()
    return tuple(api[0].POLICIES) if api is not None else FALLBACK_POLICIES


@st.cache_resource
def local_fleet() -> fs.LocalFleet:
    """One embedded fleet per app server (its processes are the server's, not a tab's)."""
    return fs.LocalFleet()


def draw_live(snap: FleetSnapshot | None, rows, runs, whatif, *, key: str) -> None:
    if snap is None:
        st.info("Waiting for the first snapshot of the fleet…")
        return
    draw_snapshot(snap, key=key)
    ids = F.instance_ids(snap)
    runs_section(tuple(runs), tuple(whatif), ids)
    ledger_section(tuple(rows), ids, key=key)


def local_panel() -> None:
    """Start / stop the embedded fleet, launch load through its gateway, and watch it."""
    lf = local_fleet()
    api, why = fs.fleet_api()
    if api is None:
        st.error(why)
        return
    up = lf.fleet is not None
    SS["fl_local_state"] = (up, lf.busy)  # the live fragment reruns the page when this changes
    st.caption(
        "kvscope servers on 127.0.0.1, each with its own API, KV-event and replay ports and a small pool "
        "so pressure shows, behind vLLM's router (`vllm-router`). The same fleet starts from a shell with "
        "`python -m engine fleet up`; started there, this page watches it."
    )
    c = st.columns([1, 2, 1, 1])
    n = c[0].number_input("Instances", 1, 6, 3, key="fl_n", disabled=up)
    policies = _policies()
    policy = c[1].selectbox("Gateway policy", policies, index=policies.index("kv_aware"), key="fl_policy", disabled=up)
    blocks = c[2].number_input("KV blocks each", 16, 4096, 256, step=16, key="fl_blocks", disabled=up)
    c[3].text_input("Model", value=ea.model_name(), disabled=True, key="fl_model")
    b = st.columns([1, 1, 4])
    if b[0].button("Start fleet", type="primary", disabled=up or lf.busy, key="fl_start"):
        lf.start(int(n), policy, ea.model_name(), int(blocks))
        st.rerun()
    if b[1].button("Stop fleet", disabled=(not up) or lf.busy, key="fl_stop"):
        lf.stop()
        st.rerun()
    if up:
        load_launcher(lf, policies)
    _local_live()


def load_launcher(lf: fs.LocalFleet, policies: tuple[str, ...]) -> None:
    with st.expander("Load through the gateway: the release-freeze workload", expanded=True):
        st.caption(
            "Engineers whose conversations share the same repository context and grow turn by turn; each "
            "conversation's next turn is sent when the previous one is answered."
        )
        c = st.columns([1, 1, 2])
        n = c[0].number_input("Requests", 4, 200, 24, key="fl_load_n")
        conc = c[1].number_input("Concurrent conversations", 1, 16, 4, key="fl_load_conc")
        cmp = c[2].multiselect(
            "Compare policies",
            policies,
            default=[p for p in ("round_robin", "kv_aware") if p in policies],
            key="fl_cmp",
        )
        b = st.columns([2, 2, 2, 2])
        one = b[0].selectbox("Single run under", policies, index=policies.index("kv_aware"), key="fl_load_policy")
        if b[1].button("Run load", disabled=lf.busy, key="fl_run"):
            lf.run_load(one, int(n), int(conc))
            st.rerun()
        if b[2].button("Compare policies", disabled=lf.busy or len(cmp) < 2, key="fl_compare", type="primary"):
            lf.compare(cmp, int(n), int(conc))
            st.rerun()
        ids = [i.engine_id for i in lf.fleet.instances] if lf.fleet is not None else []
        victim = b[3].selectbox("Fault: kill an instance", ids, key="fl_victim")
        if st.button(f"Kill {victim}", disabled=not victim, key="fl_kill"):
            api, _ = fs.fleet_api()
            try:
                api[0].kill_instance(lf.fleet, victim)
            except Exception as e:  # noqa: BLE001 - a message, not a traceback
                st.error(f"Could not kill {victim}: {e}")


@st.fragment(run_every=mode.run_every(REFRESH_S))
def _local_live() -> None:
    lf = local_fleet()
    if SS.get("fl_local_state") != (lf.fleet is not None, lf.busy):
        st.rerun(scope="app")  # a job started or ended: the buttons and the load launcher change
    st.caption(f"Fleet: **{lf.status}**" + (f" · {lf.progress}" if lf.busy and lf.progress else ""))
    if lf.error:
        st.error(lf.error)
    if lf.fleet is None:
        if not lf.busy:
            st.info("No local fleet running. Start one above, or open a recorded fleet trace.")
        return
    rows, runs, whatif = lf.results()
    draw_live(lf.snapshot(), rows, runs, whatif, key="local")
    if rows or runs:
        st.download_button(
            "Save this session as a fleet trace (JSON)",
            lf.trace({"model": lf.fleet.model, "router": "vllm-router"}).to_json(),
            file_name="fleet_session.json",
            mime="application/json",
            key="fl_save",
        )


def attach_panel() -> None:
    """Attach to servers already running (one base URL per line) and watch them."""
    with st.form("fl_attach_form"):
        text = st.text_area(
            "Servers, one per line: base URL, then optionally its KV-events and replay endpoints",
            value=SS.get("fl_attach_text", ""),
            placeholder="http://127.0.0.1:8000\nhttp://127.0.0.1:8001 tcp://127.0.0.1:5557 tcp://127.0.0.1:5558",
            help="Endpoints left out are read from the server's GET /kv_event_sources (vLLM has it).",
        )
        router = st.text_input("Gateway URL (optional)", value=SS.get("fl_attach_router", ""))
        go_ = st.form_submit_button("Attach", type="primary")
    if go_:
        old = SS.pop("fl_attached", None)
        if old is not None:
            old.stop()
        SS["fl_attach_text"], SS["fl_attach_router"] = text, router
        try:
            SS["fl_attached"] = fs.AttachedFleet(text, router)
            SS.pop("fl_attach_error", None)
        except ValueError as e:
            SS["fl_attach_error"] = str(e)
    if SS.get("fl_attach_error"):
        st.error(SS["fl_attach_error"])
    if SS.get("fl_attached") is None:
        st.info("List the servers and press Attach.")
        return
    if st.button("Detach", key="fl_detach"):
        SS.pop("fl_attached").stop()
        st.rerun()
    _attached_live()


@st.fragment(run_every=mode.run_every(REFRESH_S))
def _attached_live() -> None:
    af = SS.get("fl_attached")
    if af is None:
        return
    af.touch()
    why = " (reading stops when the page is left unwatched; press Attach to start again)"
    st.caption(f"Attached fleet: **{af.status}**" + (why if af.status == "stopped" else ""))
    if af.error:
        st.error(af.error)
    for note in af.notes:
        st.caption(note)
    draw_live(af.snapshot(), (), (), (), key="attached")
