"""Claims: what the seeds say about inference, each beside this machine's measurement."""

from __future__ import annotations

import html
from pathlib import Path

import streamlit as st

from engine.lab import bench_results as BR
from engine.lab import claims as C
from engine.lab.claims_live import measure_live
from ui.figures import claims as CL
from ui.figures import scaling as SC
from ui.widgets import engine_access as ea
from ui.widgets import shell

shell.enter_app()

SS = st.session_state

st.title("Claims")
st.caption(
    "The reference texts kvscope grew from make claims about inference engines. Each row below puts one of "
    "them beside a number measured on this machine — from the benchmark's latest saved results, or measured "
    "here on the loaded engine — and says whether it holds here, by a rule written in the row."
)


@st.cache_resource(show_spinner=False)
def _live_results() -> dict:
    """Live measurements, kept for every session of this server with their time."""
    return {}


bench = BR.latest_results()
rows = C.rows_from_bench(bench)
store = _live_results()
th = ea.get_engine()
model = th.config.model if th is not None else None
live = store.get(model)

c = st.columns([1, 3])
if c[0].button(
    "Measure",
    type="primary",
    key="claims_measure",
    disabled=th is None,
    help="times decode steps at batch 1-8, a (k+1)-token pass vs a 1-token pass for k = 1-8, "
    "memory bandwidth and a matmul on the loaded engine (pauses it briefly)",
):
    bar = st.progress(0.0, text="starting")
    try:
        live = measure_live(th, progress=lambda f, s: bar.progress(min(1.0, max(0.0, f)), text=s))
        store[model] = live
    except Exception as e:  # noqa: BLE001 - shown; the engine keeps serving
        st.error(f"Measurement failed: {type(e).__name__}: {e}")
    bar.empty()
if live:
    c[1].caption(
        f"Live measurement of {html.escape(str(model))} from {live['when'][:19].replace('T', ' ')} UTC "
        "replaces the bench rows it covers."
    )
    rows = C.merge(rows, live["rows"])
else:
    c[1].caption("Rows marked 'this page' need a live measurement: press Measure.")

if bench:
    st.caption("Bench results read: " + " · ".join(html.escape(b.label) for b in bench.values()))
else:
    st.caption(
        f"No bench results found in {html.escape(str(BR.results_dir()))} "
        "(`python -m engine bench all --quick` writes them)."
    )

st.html(CL.claims_table_html(rows))

scaling, committed = bench.get("scaling"), None
if scaling is None:
    scaling = committed = BR.committed("scaling")
with st.expander("Cost as work grows: kvscope vs llama.cpp vs vLLM CPU (bench scaling)", expanded=False):
    if committed is not None:
        st.caption(
            "No `bench scaling` result from this machine yet: this is the committed measurement "
            f"docs/data/{html.escape(Path(committed.path).name)}, "
            f"measured on {html.escape(BR.machine_text(committed))} "
            "(docs/BENCHMARKS.md quotes it). `python -m engine bench scaling` measures it here."
        )
    if scaling is None:
        st.caption(
            "No `bench scaling` result is stored yet. `python -m engine bench scaling --quick` (a few minutes) "
            "or `python -m engine bench scaling` (the full grid to 8k tokens and 64 requests) measures it; "
            "llama.cpp and vLLM CPU join where `scripts/peers.sh install` has installed them."
        )
    else:
        ea.chart(SC.scaling_figure(scaling.fields), key="claims_scaling")
        st.caption(html.escape(SC.caption(scaling.fields, scaling.label)))
