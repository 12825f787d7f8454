"""Streamlit block drawing the continuous-batching chart (ui.figures.batching) with its one-line summary;
shared by the Load, Replay and Demo pages."""

from __future__ import annotations

from typing import Iterable

import streamlit as st

from engine.observe.trace_events import Event
from ui.figures import batching as B
from ui.widgets import engine_access as ea


def batching_view(events: Iterable[Event], *, key: str, max_steps: int = B.MAX_STEPS) -> None:
    grid = B.batch_grid(list(events), max_steps=max_steps)
    if not grid.steps:
        st.caption(
            "Continuous batching: no forward pass recorded yet (or this trace predates the per-step schedule events)."
        )
        return
    ea.chart(B.batching_figure(grid), key=key)
    st.html(
        f"<p style='font-size:0.85rem;margin:0'>{B.batch_summary(grid)} Each column is one forward pass "
        "of the model; a request joins the batch when its first prompt chunk runs and leaves when it "
        "finishes or is preempted — other requests keep decoding in the same passes.</p>"
    )
