"""Driving an engine and recording what it reports: the one step loop and the one snapshot
recorder that the pages, the bench and the comparisons use.

- `drive(engine, ...)`: add requests (at once or at arrival steps), step until idle, call back
  after each step with the step's outputs and wall time.
- `run_engine(engine, requests, ...)`: `drive` plus a `RunRecord` (bounded snapshot series, the
  snapshot at the allocation peak, the run's events, per-step wall times, final outputs).
- `measure_decode_cost(engine, prompt, n)`: one request, one step at a time, timing each step.
- `LoadFeeder`: submits a workload to an EngineThread at its arrival times (daemon thread).
- `SnapshotRecorder`: records what an EngineThread publishes while something else drives it
  (the live load page), with the same series and event rules as `run_engine`.

Only reads what the engine reports (Snapshots, Events, RequestOutputs); no Streamlit, no Plotly.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from engine.config import SamplingParams
from engine.observe.snapshot import Snapshot
from engine.observe.trace_events import trace_to_string

SERIES_CAP = 600  # snapshots kept for the over-time charts (older half thinned beyond it)
# Events kept for logs and traces: every kind except the per-token/per-chunk chatter.
RECORDED_EXCLUDE = ("decode", "prefill")
EVENT_CAP = 5000
KEYFRAME_EVERY = 20  # every n-th recorded snapshot keeps its block list (pool map in replay)


# ------------------------------------------------------------------ bounded series


def append_snapshot(series: list[Snapshot], snap: Snapshot | None, cap: int = SERIES_CAP) -> list[Snapshot]:
    """Append `snap` unless it is not newer than the last one (same or earlier step: an idle
    engine adds nothing); when over `cap`, drop every other point of the older half so the whole
    run stays visible at a coarser resolution. Returns a new list."""
    if snap is None:
        return list(series)
    if series and snap.step <= series[-1].step:
        return list(series)
    out = list(series) + [snap]
    if len(out) > cap:
        half = len(out) // 2
        out = out[:half][::2] + out[half:]
    return out


def slim_snapshot(snap: Snapshot, keep_blocks: bool = False) -> Snapshot:
    """A copy for the over-time series and traces: per-request token marks, histories and texts
    dropped (they grow with every token), the block list kept only when asked (keyframes)."""
    reqs = tuple(replace(r, tokens=(), history=(), prompt_preview="", output_text="") for r in snap.requests)
    return replace(snap, requests=reqs, blocks=snap.blocks if keep_blocks else ())


# ------------------------------------------------------------------ the step loop


def drive(
    engine,
    arrivals: Iterable[tuple[int, str, object, object]] = (),
    *,
    on_step: Callable[[int, list, float], None] | None = None,
    max_steps: int | None = None,
    max_idle_steps: int | None = None,
) -> int:
    """Step `engine` until it has no unfinished request and no arrival is pending.

    arrivals: (step, request_id, prompt, SamplingParams), added once the loop reaches `step`.
    on_step(step_number, outputs, wall_s) runs after every step (step_number counts from 1).
    Stops after `max_steps`; raises RuntimeError when `max_idle_steps` steps in a row produced no
    output while nothing was pending. Returns the number of steps taken."""
    pending = sorted(arrivals, key=lambda a: a[0])
    steps = idle = 0
    while pending or engine.has_unfinished_requests():
        if max_steps is not None and steps >= max_steps:
            break
        while pending and pending[0][0] <= steps:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        t = time.perf_counter()
        outs = engine.step() or []
        dt = time.perf_counter() - t
        steps += 1
        if on_step is not None:
            on_step(steps, outs, dt)
        idle = 0 if outs or pending else idle + 1
        if max_idle_steps is not None and idle > max_idle_steps:
            raise RuntimeError(f"engine made no progress for {max_idle_steps} steps")
    return steps


# ------------------------------------------------------------------ a recorded run


@dataclass
class RunRecord:
    """What one engine run reported: bounded snapshot series (one per step, thinned beyond the
    cap), every event of the run, per-step wall times and the engine's outputs."""

    label: str
    series: list[Snapshot] = field(default_factory=list)
    events: list = field(default_factory=list)
    step_wall_s: list[float] = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    steps: int = 0
    wall_s: float = 0.0
    add_errors: list[str] = field(default_factory=list)
    truncated: bool = False  # stopped at max_steps with work left
    peak: Snapshot | None = None  # full snapshot (block list included) at the allocation peak
    budget_tokens: int | None = None  # exercise: the fixed budget to compare against (when the
    # engine itself ran with a bigger pool, to measure demand)

    def trace_text(self) -> str:
        snaps = list(self.series)
        if self.peak is not None:  # put the peak's block list into the trace (pool map in replay)
            snaps = [self.peak if s.step == self.peak.step else s for s in snaps]
        return trace_to_string(snaps, self.events)


def run_engine(
    engine,
    requests: Sequence[tuple[str, object, object]],
    *,
    label: str,
    max_steps: int = 5000,
    cap: int = SERIES_CAP,
    on_step: Callable[[int, Snapshot], None] | None = None,
) -> RunRecord:
    """Add every (request_id, prompt, SamplingParams) to `engine` at once, then step until idle
    (or `max_steps`). A ValueError from add_request is kept as the engine's rejection message.
    Snapshots are slimmed (no per-request tokens/history/blocks); the one at the allocation peak
    is kept whole. Per-token events (decode, prefill chunks) are left out of the record."""
    rec = RunRecord(label=label)
    seq0 = engine.events.last_seq
    for rid, prompt, params in requests:
        try:
            engine.add_request(rid, prompt, params)
        except ValueError as e:
            rec.add_errors.append(f"{rid}: {e}")

    def keep(snap):
        rec.series = append_snapshot(rec.series, slim_snapshot(snap), cap)
        if rec.peak is None or snap.metrics.slots_allocated > rec.peak.metrics.slots_allocated:
            rec.peak = snap

    def after_step(n, outs, dt):
        for out in outs:
            if out.finished:
                rec.outputs[out.request_id] = out
        rec.step_wall_s.append(dt)
        rec.steps = n
        snap = engine.snapshot()
        keep(snap)
        if on_step is not None:
            on_step(n, snap)

    keep(engine.snapshot())
    t_start = time.perf_counter()
    drive(engine, on_step=after_step, max_steps=max_steps)
    rec.wall_s = time.perf_counter() - t_start
    rec.truncated = engine.has_unfinished_requests()
    rec.events = [e for e in engine.events.since(seq0) if e.kind not in RECORDED_EXCLUDE]
    return rec


# ------------------------------------------------------------------ cost per decode step


@dataclass(frozen=True, slots=True)
class CostPoint:
    generated: int  # tokens generated so far (after this step)
    context_len: int  # prompt + generated tokens the step attended over
    step_s: float  # measured wall time of the step
    fed_tokens: int = 0  # tokens the step ran through the model for this request (from its events)


def measure_decode_cost(
    engine, prompt, n_tokens: int, *, request_id: str | None = None
) -> tuple[float, list[CostPoint]]:
    """Generate `n_tokens` for one request, one engine step at a time, timing each step.
    Returns (prefill step seconds, one CostPoint per decode step). The request ignores EOS so
    both modes run the same number of steps. `fed_tokens` comes from the engine's own prefill /
    decode events: 1 per step with the cache, the whole context without it."""
    rid = request_id or f"cost-{uuid.uuid4().hex[:8]}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
    prefill_s: list[float] = []
    pts: list[CostPoint] = []
    seq = [engine.events.last_seq]

    def after_step(_n, _outs, dt):
        mine = [e for e in engine.events.since(seq[0], kinds=("prefill", "decode")) if e.request_id == rid]
        seq[0] = engine.events.last_seq
        fed = sum(int(e.data.get("tokens", 0)) for e in mine if e.kind == "prefill")
        fed = fed or sum(1 for e in mine if e.kind == "decode")
        r = engine.snapshot().request(rid)
        out_len = r.output_len if r is not None else (pts[-1].generated + 1 if pts else 1)
        ctx = (r.prompt_len + r.output_len) if r is not None else (pts[-1].context_len + 1 if pts else 0)
        if not prefill_s:
            prefill_s.append(dt)
            return
        pts.append(CostPoint(out_len, ctx, dt, fed))

    drive(engine, on_step=after_step)
    return (prefill_s[0] if prefill_s else 0.0), pts


# ------------------------------------------------------------------ recording a running engine


class SnapshotRecorder:
    """Collects what an EngineThread reports during one run that something else drives: a
    bounded, slimmed series of the Snapshots it publishes (one per poll, when the step moved on),
    the latest full Snapshot, and the run's events (bounded). `poll(th)` is cheap, lock-free on
    the engine side, and idempotent."""

    def __init__(self, run_id: str, start_time: float = 0.0, start_seq: int = 0, cap: int = SERIES_CAP):
        self.run_id = run_id
        self.start_time = start_time
        self.last_seq = start_seq
        self.cap = cap
        self.series: list[Snapshot] = []
        self.latest: Snapshot | None = None
        self.events: deque = deque(maxlen=EVENT_CAP)
        self._n = 0
        self.restarts = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled without its lock (a recording comes back from the lab process, engine/lab/lab_proc.py)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _add(self, snap: Snapshot) -> None:
        if snap.time < self.start_time or (self.series and snap.step <= self.series[-1].step):
            return
        keep = self._n % KEYFRAME_EVERY == 0
        self._n += 1
        self.series = append_snapshot(self.series, slim_snapshot(snap, keep_blocks=keep), self.cap)

    def poll(self, th) -> Snapshot:
        with self._lock:
            # th.snapshot() is the thread's last published snapshot: lock-free, so a page never
            # waits for a long engine step (recent_snapshots() would take the engine lock)
            snap = th.snapshot()
            prev = self.latest
            if prev is not None and prev.engine_id and snap.engine_id:
                rebuilt = snap.engine_id != prev.engine_id
            else:  # snapshots without an engine id (made by hand or by an older engine)
                rebuilt = bool(self.series and snap.step < self.series[-1].step) or th.events.last_seq < self.last_seq
            if rebuilt:
                # the shared engine was rebuilt (sidebar settings, restart): its steps, clock and
                # event numbers start again from 0, so the run's record starts again too
                self.restarts += 1
                self.series, self.latest, self.start_time, self.last_seq = [], None, 0.0, 0
                self.events.clear()
            self._add(snap)
            self.latest = snap
            for e in th.events.since(self.last_seq):
                self.last_seq = max(self.last_seq, e.seq)
                if e.kind not in RECORDED_EXCLUDE:
                    self.events.append(e)
            return snap

    def trace_snapshots(self) -> list[Snapshot]:
        """The series, with the latest snapshot (block list included) as the last one."""
        with self._lock:
            out = list(self.series)
            if self.latest is not None:
                last = slim_snapshot(self.latest, keep_blocks=True)
                if out and out[-1].step == last.step:
                    out[-1] = last
                elif not out or last.step > out[-1].step:
                    out.append(last)
            return out

    def trace_text(self) -> str:
        snaps = self.trace_snapshots()
        with self._lock:
            evs = list(self.events)
        return trace_to_string(snaps, evs)


# ------------------------------------------------------------------ feeding a running engine

MAX_LOAD_REQUESTS = 300  # the feeder never submits more than this in one run


@dataclass
class FeederStatus:
    total: int
    submitted: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    done: bool = False
    stopped: bool = False
    rebuilt: bool = False  # stopped because the engine it fed was rebuilt
    skipped: int = 0  # chained turns not sent because their previous turn did not finish


class LoadFeeder:
    """Submits `requests` (objects with .arrival_s, .prompt, .max_tokens, .tier) through `submit`
    at their arrival times, on a daemon thread. Bounded (MAX_LOAD_REQUESTS) and stoppable.

    `submit(prompt, params, request_id)` is the EngineThread's submit; a ValueError from it (bad
    input, over a tier's cap) is counted as a rejection with the engine's message, and the feeder
    goes on with the next request.

    `bound_to` (an EngineThread): the feeder feeds the engine that thread runs when it starts;
    once the thread's engine is rebuilt (another object), the feeder stops and says so, instead
    of submitting the rest of the workload into an engine its run never saw.

    `chain(req, parent_output)` (conversations whose later turns carry the model's own answers):
    a request with a `parent_id` in the workload waits until that turn has finished, then is sent
    with the prompt `chain` builds from the parent's RequestOutput (first turns get
    `chain(req, None)`); it is sent at its arrival time or when its parent finishes, whichever is
    later. A turn whose parent was rejected, aborted or failed is skipped (counted, with why)."""

    MAX_ERRORS = 50
    REBUILT = "stopped: the engine this load fed was rebuilt"

    def __init__(
        self,
        submit: Callable,
        requests: Sequence,
        make_params: Callable,
        run_id: str,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        bound_to=None,
        chain: Callable | None = None,
    ):
        self._submit = submit
        self._chain = chain
        self._bound_to = bound_to
        self._engine = getattr(bound_to, "engine", None)
        self._requests = sorted(list(requests)[:MAX_LOAD_REQUESTS], key=lambda r: r.arrival_s)
        self._make_params = make_params
        self._run_id = run_id
        self._scale = max(0.0, float(time_scale))
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.status = FeederStatus(total=len(self._requests))
        self._thread = threading.Thread(target=self._run, name=f"kvscope-feeder-{run_id}", daemon=True)

    def start(self) -> "LoadFeeder":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot_status(self) -> FeederStatus:
        with self._lock:
            s = self.status
            return replace(s, errors=list(s.errors), request_ids=list(s.request_ids))

    POLL_S = 0.02  # how often a chained turn checks whether its previous turn has finished

    def _run(self) -> None:
        t0 = self._clock()
        pending = list(enumerate(self._requests))
        in_workload = {getattr(r, "request_id", None) for r in self._requests}
        handles: dict[str, object] = {}  # workload request id -> handle (chained runs)
        dropped: set[str] = set()  # workload ids not sent or not finished: their later turns skip
        try:
            while pending and not self._stop.is_set():
                now = self._clock() - t0
                sent_any = waiting = False
                for item in list(pending):
                    i, req = item
                    if req.arrival_s * self._scale > now:
                        break  # sorted by arrival: the rest are later still
                    parent = getattr(req, "parent_id", None) if self._chain is not None else None
                    parent_out = None
                    if parent is not None and parent in in_workload:
                        h = handles.get(parent)
                        if parent not in dropped and (h is None or not h.finished):
                            waiting = True
                            continue
                        parent_out = getattr(h, "output", None) if h is not None else None
                        if parent in dropped or h.error or parent_out is None or _aborted(parent_out):
                            pending.remove(item)
                            self._skip(req, f"its previous turn {parent} did not finish")
                            dropped.add(req.request_id)
                            continue
                    pending.remove(item)
                    sent_any = True
                    if not self._send(i, req, parent_out, handles, dropped):
                        return
                if not pending or self._stop.is_set() or self._stopped_by_rebuild():
                    break
                if sent_any:
                    continue
                later = [r.arrival_s * self._scale for _, r in pending if r.arrival_s * self._scale > now]
                until_next = max(0.0, t0 + min(later) - self._clock()) if later else None
                if waiting:  # a chained turn polls for its parent (and wakes for an earlier arrival)
                    delay = self.POLL_S if until_next is None else min(self.POLL_S, until_next)
                else:
                    delay = until_next if until_next is not None else self.POLL_S
                if self._stop.wait(delay):
                    break
        finally:
            with self._lock:
                self.status.stopped = self._stop.is_set()
                self.status.done = True

    def _stopped_by_rebuild(self) -> bool:
        """True (and the feeder stopped, saying so) once the bound thread runs another engine."""
        if self._bound_to is None or getattr(self._bound_to, "engine", None) is self._engine:
            return False
        with self._lock:
            self.status.errors.append(self.REBUILT)
            self.status.rebuilt = True
        self._stop.set()
        return True

    def _skip(self, req, why: str) -> None:
        with self._lock:
            self.status.skipped += 1
            if len(self.status.errors) < self.MAX_ERRORS:
                self.status.errors.append(f"{self._run_id}-{req.request_id}: skipped, {why}")

    def _send(self, i: int, req, parent_out, handles: dict, dropped: set) -> bool:
        """Submit one request; False when the feeder must stop (the engine is gone)."""
        if self._stopped_by_rebuild():
            return False
        wid = getattr(req, "request_id", None)
        rid = f"{self._run_id}-{wid or f'{i:03d}'}"
        try:
            if self._chain is not None:
                prompt = self._chain(req, parent_out)
            else:
                prompt = req.prompt if getattr(req, "prompt", None) is not None else req.prompt_token_ids
            h = self._submit(prompt, self._make_params(req), request_id=rid)
            if wid is not None:
                handles[wid] = h
            with self._lock:
                self.status.submitted += 1
                self.status.request_ids.append(rid)
        except ValueError as e:
            dropped.add(wid)
            with self._lock:
                self.status.rejected += 1
                if len(self.status.errors) < self.MAX_ERRORS:
                    self.status.errors.append(f"{rid}: {e}")
        except Exception as e:  # engine down / reconfigured: stop feeding, say why
            with self._lock:
                self.status.errors.append(f"{rid}: {type(e).__name__}: {e}")
            return False
        return True


def _aborted(out) -> bool:
    reason = out.outputs[0].finish_reason if getattr(out, "outputs", None) else None
    return reason in ("abort", "error", "rejected")
