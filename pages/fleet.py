"""Fleet: several engines behind vLLM's router, each instance's prefix cache rebuilt from its KV
events, merged, and every routed request checked against what the instances held."""

from __future__ import annotations

import streamlit as st

from ui.widgets import fleet_view as fv
from ui.widgets import shell

shell.enter_app()

st.title("Fleet")
st.caption(fv.INTRO)

source = fv.source_picker()
if source == "Recorded trace":
    trace = fv.trace_picker()
    if trace is None:
        st.info("Pick a recorded fleet trace or upload one.")
        st.stop()
    fv.draw_recorded(trace)
elif source == "Attach to servers":
    fv.attach_panel()
else:
    fv.local_panel()
