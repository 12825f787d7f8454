"""Skip the Python work of a redraw when the engine's state has not changed.

A live page's fragment reruns every 0.25 s. Streamlit clears what a fragment run does not draw,
so each run must draw its views again; but building Plotly figures is the expensive part (far
more than sending them), and it competes with the engine for the cores. `memo` keeps, per browser
session, the last value built for a slot and rebuilds only when the key changes; `snapshot_key`
is the key of an engine state: the engine's id, its step counter and what can change between
steps (a submit, an abort, an eviction, a new budget), not the snapshot's time, so an idle page
builds nothing."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import streamlit as st

T = TypeVar("T")
STATE_KEY = "redraw_memo"


def snapshot_key(snap) -> tuple:
    """What identifies an engine state for drawing: two snapshots with the same key draw the same
    figures (the step counter, health, pool counts, and each request's state and progress)."""
    m = snap.metrics
    return (
        snap.engine_id,
        snap.step,
        snap.healthy,
        snap.error,
        snap.info.num_blocks,
        (m.num_blocks_used, m.num_blocks_cached, m.num_evictions_total, m.num_aborted),
        tuple(
            (r.request_id, r.state, r.output_len, r.num_computed_tokens, r.block_table, r.num_preemptions)
            for r in snap.requests
        ),
    )


def request_key(snap, rid: str | None) -> tuple:
    """What identifies one request's drawing (its block table, growth, phases, tokens): its own
    progress, not the engine's step, so a finished request's views are not built again while
    other requests run."""
    r = snap.request(rid) if rid is not None else None
    if r is None:
        return (snap.engine_id, rid, None)
    last = r.history[-1] if r.history else None
    return (
        snap.engine_id,
        rid,
        r.state,
        r.output_len,
        r.num_computed_tokens,
        r.block_table,
        r.num_preemptions,
        r.finish_time,
        len(r.history),
        last,
        snap.metrics.num_evictions_total,
    )


def memo(slot: str, key, build: Callable[[], T], *, at_most_every: float = 0.0) -> T:
    """`build()`'s value, rebuilt only when `key` differs from the last call for `slot` in this
    browser session. `at_most_every` (seconds): while the key keeps changing, the value built
    less than that long ago is kept (a heavy figure follows a running engine at a bounded rate);
    pass 0 for the final state."""
    store = st.session_state.setdefault(STATE_KEY, {})
    hit = store.get(slot)
    now = time.monotonic()
    if hit is not None and (hit[0] == key or now - hit[2] < at_most_every):
        stats()["hits"] += 1
        return hit[1]
    stats()["builds"] += 1
    value = build()
    store[slot] = (key, value, now)
    return value


def stats() -> dict:
    """{"hits", "builds"} counts for this browser session (tests read them)."""
    return st.session_state.setdefault(STATE_KEY + "_stats", {"hits": 0, "builds": 0})
