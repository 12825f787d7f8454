"""Replay: load a recorded trace (JSONL) and look at it one tick at a time.

Pure helpers over `engine.observe.trace_events.Trace`; no Streamlit. A tick is an index into the trace's
snapshots; the view at tick i is built only from snapshots[0..i] and the events up to that
snapshot's step, with the same figure builders the live pages use.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from engine.observe.snapshot import Snapshot
from engine.observe.trace_events import Event, Trace, read_trace

# Uploaded traces are bounded well below the reader's own limit: replay keeps the whole trace in
# the session, and a demo trace is a few MiB at most.
MAX_UPLOAD_BYTES = 32 * 1024 * 1024
TRACE_SUFFIXES = (".jsonl", ".jsonl.txt")


def load_trace_bytes(data: bytes, *, max_bytes: int = MAX_UPLOAD_BYTES) -> Trace:
    """Parse an uploaded trace. Raises ValueError with the reader's message (line number and
    what is wrong) for anything malformed, too large, truncated or not UTF-8."""
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError("trace must be uploaded as a file")
    if len(data) > max_bytes:
        raise ValueError(f"trace is {len(data) / 2**20:.1f} MiB, over the replay limit of {max_bytes / 2**20:.0f} MiB")
    trace = read_trace(bytes(data), max_bytes=max_bytes)
    trace.snapshots.sort(key=lambda s: (s.step, s.time))
    trace.events.sort(key=lambda e: e.seq)
    return trace


def demo_traces(folder: str | os.PathLike) -> dict[str, Path]:
    """Recorded demo traces in `folder` (name -> path), sorted by name; {} if none."""
    p = Path(folder)
    if not p.is_dir():
        return {}
    return {f.name: f for f in sorted(p.iterdir()) if f.is_file() and f.name.endswith(TRACE_SUFFIXES)}


def load_demo_trace(path: str | os.PathLike) -> Trace:
    return load_trace_bytes(Path(path).read_bytes())


@dataclass(frozen=True, slots=True)
class TickView:
    tick: int
    snapshot: Snapshot
    series: list[Snapshot]  # snapshots[0..tick]
    events: list[Event]  # events with step <= snapshot.step


def clamp_tick(trace: Trace, tick: int) -> int:
    return max(0, min(int(tick), len(trace.snapshots) - 1))


def view_at(trace: Trace, tick: int) -> TickView:
    t = clamp_tick(trace, tick)
    snap = trace.snapshots[t]
    evs = [e for e in trace.events if e.step <= snap.step]
    return TickView(t, snap, list(trace.snapshots[: t + 1]), evs)


def events_between(events: Sequence[Event], prev_step: int | None, step: int) -> list[Event]:
    """Events that happened after `prev_step` up to and including `step` (what this tick added)."""
    lo = -1 if prev_step is None else prev_step
    return [e for e in events if lo < e.step <= step]


def trace_summary(trace: Trace) -> dict:
    s0, s1 = trace.snapshots[0], trace.snapshots[-1]
    kinds: dict[str, int] = {}
    for e in trace.events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return {
        "snapshots": len(trace.snapshots),
        "events": len(trace.events),
        "first_step": s0.step,
        "last_step": s1.step,
        "duration_s": s1.time - s0.time,
        "model": s1.info.model,
        "allocator": s1.info.allocator,
        "num_blocks": s1.info.num_blocks,
        "block_size": s1.info.block_size,
        "requests": len({r.request_id for s in trace.snapshots for r in s.requests}),
        "event_kinds": dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def summary_html(summary: dict) -> str:
    """One escaped line describing a trace (model names come from the file)."""
    return html.escape(
        f"{summary['snapshots']} snapshots (steps {summary['first_step']}–{summary['last_step']}, "
        f"{summary['duration_s']:.1f} s), {summary['events']} events, {summary['requests']} requests · "
        f"model {summary['model']} · {summary['allocator']} allocator, {summary['num_blocks']} blocks × "
        f"{summary['block_size']} tokens"
    )


def interesting_tick(trace: Trace) -> int:
    """The default tick: the busiest recorded moment (most requests in the engine, then most
    blocks in use), preferring snapshots that carry the block pool."""
    snaps = trace.snapshots
    idx = [i for i, s in enumerate(snaps) if s.blocks] or list(range(len(snaps)))

    def load(i):
        m = snaps[i].metrics
        return (m.num_running + m.num_waiting + m.num_swapped, m.num_blocks_used, -i)

    return max(idx, key=load)
