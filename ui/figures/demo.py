"""The guided demo: chapters of a recorded trace, each anchored on a moment found in the trace's
own events and snapshots (never a hard-coded step), with a caption written from that moment's data.

Pure functions over `engine.observe.trace_events.Trace`; no Streamlit. A tick is an index into the trace's
snapshots (as on the Replay page). Captions are plain text: escape them when rendering (request
ids and engine reasons come from the file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.model.kv_layout import cdiv
from engine.observe import rates
from engine.observe.snapshot import Snapshot
from engine.observe.trace_events import ADMIT, FINISH, PREEMPT, PREFIX_HIT, SCHEDULE, SPEC_FALLBACK, Event, Trace

LIVE_STATES = ("running", "waiting", "preempted", "swapped")
SPEEDS = (0.5, 1.0, 2.0, 4.0)  # ticks advanced per second of auto-play
PLAY_INTERVAL_S = 0.5  # one auto-play refresh


@dataclass(frozen=True, slots=True)
class Moment:
    step: int
    tick: int
    caption: str
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Chapter:
    key: str
    title: str
    intro: str  # what this chapter is about, in general terms
    moment: Moment | None  # where in this trace it happens (None: the trace never shows it)
    missing: str = ""  # said instead of a caption when moment is None
    short: str = ""  # button label


def tick_of_step(trace: Trace, step: int) -> int:
    """The first snapshot at or after `step` (the last one if the trace ends before it)."""
    for i, s in enumerate(trace.snapshots):
        if s.step >= step:
            return i
    return len(trace.snapshots) - 1


def _first(events: list[Event], kind: str, pred: Callable[[Event], bool] = lambda e: True) -> Event | None:
    return next((e for e in sorted(events, key=lambda e: e.seq) if e.kind == kind and pred(e)), None)


def kv_demand_blocks(snap: Snapshot) -> int:
    """Blocks the requests still in the engine would need to hold their whole context right now
    (prompt + output so far), whether or not they currently hold them."""
    bs = max(1, snap.info.block_size)
    return sum(cdiv(r.prompt_len + r.output_len, bs) for r in snap.requests if r.state in LIVE_STATES)


# ------------------------------------------------------------------ release-freeze chapters


def _grow(trace: Trace) -> tuple[Moment | None, str]:
    e = _first(trace.events, ADMIT)
    if e is None:
        return None, "no request was admitted in this trace"
    n_admit = sum(1 for x in trace.events if x.kind == ADMIT and not x.data.get("resumed"))
    return Moment(
        e.step,
        tick_of_step(trace, e.step),
        f"Step {e.step}: {e.request_id} is admitted with {e.data.get('prompt_tokens')} prompt tokens in "
        f"{e.data.get('num_blocks')} blocks. {n_admit} conversation turns arrive in this trace; every later "
        f"turn re-sends its conversation so far, so each one needs more KV than the last.",
        e.request_id,
    ), ""


def _crossing(trace: Trace) -> tuple[Moment | None, str]:
    for i, s in enumerate(trace.snapshots):
        need = kv_demand_blocks(s)
        if need > s.info.num_blocks:
            live = sum(1 for r in s.requests if r.state in LIVE_STATES)
            return Moment(
                s.step,
                i,
                f"Step {s.step}: the {live} requests in the engine would need {need} blocks to hold "
                f"their whole contexts, more than the budget of {s.info.num_blocks} blocks "
                f"({s.metrics.num_blocks_used} in use, {s.metrics.num_waiting} waiting). From here "
                "someone has to wait or give up memory.",
            ), ""
    return None, "the requests' KV demand never exceeded the budget in this trace"


def _queue(trace: Trace) -> tuple[Moment | None, str]:
    for i, s in enumerate(trace.snapshots):
        waiting = [r for r in s.requests if r.state == "waiting" and r.waiting_reason]
        if waiting:
            r = waiting[0]
            return Moment(
                s.step,
                i,
                f"Step {s.step}: {len(waiting)} request(s) wait at admission. {r.request_id} waits "
                f"because: {r.waiting_reason}. A request is admitted only when blocks for its whole "
                "prompt can be reserved, so it queues while the running ones keep their memory.",
                r.request_id,
            ), ""
    return None, "no request had to wait at admission in this trace"


def _preemption(trace: Trace) -> tuple[Moment | None, str]:
    e = _first(trace.events, PREEMPT)
    if e is None:
        return None, "the engine never preempted a request in this trace"
    back = _first(
        trace.events, ADMIT, lambda x: x.request_id == e.request_id and x.seq > e.seq and bool(x.data.get("resumed"))
    )
    tail = (
        f" It is admitted again at step {back.step}, recomputing {back.data.get('tokens_to_compute')} tokens "
        f"({back.data.get('cached_tokens')} came back from the prefix cache)."
        if back is not None
        else " It had not been readmitted when the trace ends."
    )
    return Moment(
        e.step,
        tick_of_step(trace, e.step),
        f"Step {e.step}: first preemption. The victim is {e.request_id}; mode {e.data.get('mode')}, "
        f"{e.data.get('blocks_freed')} blocks freed, {e.data.get('tokens_to_recompute')} tokens to "
        f"recompute. Engine's reason: {e.data.get('reason')}." + tail,
        e.request_id,
    ), ""


def _prefix(trace: Trace) -> tuple[Moment | None, str]:
    e = _first(trace.events, PREFIX_HIT)
    if e is None:
        return None, "no prefix-cache hit in this trace"
    hits = [x for x in trace.events if x.kind == PREFIX_HIT]
    tokens = sum(int(x.data.get("tokens") or 0) for x in hits)
    return Moment(
        e.step,
        tick_of_step(trace, e.step),
        f"Step {e.step}: first prefix-cache hit. {e.request_id} reuses {e.data.get('tokens')} tokens "
        f"already in the pool ({len(e.data.get('blocks') or [])} full blocks) instead of computing them. "
        f"Over the whole trace {len(hits)} admissions reused {tokens} tokens this way.",
        e.request_id,
    ), ""


RELEASE_FREEZE = (
    (
        "grow",
        "Conversations grow",
        "Engineers open code-review conversations within a few minutes of each other. Each answer and each "
        "follow-up stays in the context, so every conversation's KV cache keeps growing, one block at a time.",
        _grow,
    ),
    (
        "crossing",
        "The KV budget is crossed",
        "The pool has a fixed number of blocks. Compute is not the limit here: the sum of everyone's cache is.",
        _crossing,
    ),
    (
        "queue",
        "Admission queues",
        "A new request needs blocks for its prompt before it may start. With the pool full it waits in the "
        "queue, however idle the arithmetic units are.",
        _queue,
    ),
    (
        "preempt",
        "LRU preemption recomputes",
        "When a running request needs one more block and none is free, the scheduler takes the blocks of the "
        "least recently scheduled request. With recompute, its K/V are thrown away and rebuilt later.",
        _preemption,
    ),
    (
        "prefix",
        "Prefix sharing helps",
        "Later turns start with the same tokens as the earlier turn of their conversation. Full blocks with the "
        "same content are found by hash and shared instead of recomputed.",
        _prefix,
    ),
)


# ------------------------------------------------------------------ speculation chapters


def _request_spec(trace: Trace, rid: str) -> tuple[int, int, int, int] | None:
    """(step, draft tokens, accepted tokens, output tokens) from the last snapshot holding `rid`."""
    for s in reversed(trace.snapshots):
        r = s.request(rid)
        if r is not None:
            return s.step, r.spec_num_draft_tokens, r.spec_num_accepted_tokens, r.output_len
    return None


def _verify_steps(trace: Trace, rid: str) -> list[int]:
    """Steps whose forward pass verified drafts for `rid` (from the SCHEDULE events)."""
    return [
        e.step
        for e in trace.events
        if e.kind == SCHEDULE
        for row in (e.data.get("rows") or ())
        if row[0] == rid and row[1] == "verify"
    ]


def _spec_chapter(trace: Trace, which: str) -> tuple[Moment | None, str]:
    admits = [e for e in sorted(trace.events, key=lambda e: e.seq) if e.kind == ADMIT and not e.data.get("resumed")]
    rid = next((e.request_id for e in admits if which in (e.request_id or "")), None)
    if rid is None:
        return None, f"no {which} request in this trace"
    fin = _first(trace.events, FINISH, lambda e: e.request_id == rid)
    info = _request_spec(trace, rid)
    if fin is None or info is None:
        return None, f"{rid} did not finish in this trace"
    _, drafted, accepted, out = info
    vsteps = _verify_steps(trace, rid)
    passes = len(vsteps)
    a, mal = rates.acceptance_rate(accepted, drafted), rates.mean_acceptance_length(accepted, passes)
    alpha = f"{a:.2f}" if a is not None else "n/a"
    per_pass = f"{mal:.2f}" if mal is not None else "n/a"
    # an edit is shown when it finishes; "break it" at its last verify pass (before any fallback)
    step = fin.step if which == "passage-edit" or not vsteps else vsteps[-1]
    return Moment(
        step,
        tick_of_step(trace, step),
        f"{rid}: {drafted} draft tokens proposed, {accepted} accepted (acceptance {alpha}); "
        f"{passes} verify passes gave {per_pass} tokens each on average, for {out} output tokens.",
        rid,
    ), ""


def _passage(trace: Trace):
    return _spec_chapter(trace, "passage-edit")


def _break(trace: Trace):
    return _spec_chapter(trace, "open-ended")


def _fallback(trace: Trace) -> tuple[Moment | None, str]:
    e = _first(trace.events, SPEC_FALLBACK, lambda e: e.data.get("speculating") is False)
    if e is None:
        return None, "speculation never fell back to plain decoding in this trace"
    d = e.data
    a = d.get("acceptance_rate")
    be = d.get("break_even_alpha")
    return Moment(
        e.step,
        tick_of_step(trace, e.step),
        f"Step {e.step}: class {d.get('request_class')!r} stops speculating. Recent acceptance "
        f"{a:.2f} is below the break-even {be:.2f} the engine computes from its measured costs "
        f"(draft + verify pass = {d.get('cost_ratio', 0):.2f}× a plain pass). Engine's reason: "
        f"{d.get('reason')}"
        if isinstance(a, (int, float)) and isinstance(be, (int, float))
        else f"Step {e.step}: speculation falls back. Engine's reason: {d.get('reason')}",
    ), ""


SPECULATION = (
    (
        "passage",
        "A passage edit: drafts that land",
        "Asked to rewrite a passage with one word changed, the model copies long runs of its prompt. The n-gram "
        "drafter proposes those runs; one target pass checks them all at once and keeps the matching prefix.",
        _passage,
    ),
    (
        "break",
        "Open-ended prompts: break it",
        "A poem or an opinion has no text to copy, so the drafts are mostly wrong. Each verify pass still yields "
        "one token (the target's own), but the draft and the wider pass cost a little extra.",
        _break,
    ),
    (
        "fallback",
        "Falling back when acceptance collapses",
        "The engine watches acceptance per request class and compares it with the measured cost of drafting "
        "and verifying. Below break-even it decodes that class plainly and probes again later.",
        _fallback,
    ),
)

SHORT = {
    "grow": "Growth",
    "crossing": "Budget crossed",
    "queue": "Queueing",
    "preempt": "Preemption",
    "prefix": "Prefix sharing",
    "passage": "Passage edit",
    "break": "Break it",
    "fallback": "Fallback",
}

CHAPTER_SETS = {"release-freeze": RELEASE_FREEZE, "speculation": SPECULATION}


def chapters(trace: Trace, which: str) -> list[Chapter]:
    """The chapters of set `which` ("release-freeze" or "speculation"), each anchored in `trace`."""
    out = []
    for key, title, intro, find in CHAPTER_SETS[which]:
        moment, missing = find(trace)
        out.append(Chapter(key, title, intro, moment, missing, SHORT.get(key, title)))
    return out


def current_chapter(chs: list[Chapter], tick: int, prefer: int | None = None) -> int | None:
    """Index of the chapter whose moment is the latest at or before `tick` (None before the first);
    `prefer` (the chapter just picked) wins when its moment is at this very tick, since two moments
    can share one recorded snapshot."""
    if (
        prefer is not None
        and 0 <= prefer < len(chs)
        and chs[prefer].moment is not None
        and chs[prefer].moment.tick == tick
    ):
        return prefer
    best = None
    for i, c in enumerate(chs):
        if c.moment is not None and c.moment.tick <= tick and (best is None or c.moment.tick >= chs[best].moment.tick):
            best = i
    return best


def advance(tick: int, n_ticks: int, speed: float, interval_s: float = PLAY_INTERVAL_S) -> tuple[int, bool]:
    """Auto-play: the next tick after one refresh at `speed` ticks per second, and whether the end
    is reached (play stops there)."""
    nxt = min(n_ticks - 1, tick + max(1, round(speed * interval_s)))
    return nxt, nxt >= n_ticks - 1


# ------------------------------------------------------------------ the scenarios themselves

# The runs the demo traces were recorded from (scripts/record_demo_traces.py) and that "run this
# chapter live" repeats on the shared engine. Engine settings apply to the recording only; live
# runs use the shared engine as configured in the sidebar.
RECORDINGS = {
    # many growing conversations against a budget far below their demand: preemptions
    "release-freeze": dict(
        file="release-freeze.jsonl",
        scenario="release-freeze",
        n=12,
        params=dict(
            turns=2,
            window_s=2.0,
            prompt_median=50,
            prompt_max=120,
            context_max=200,
            output_median=40,
            output_min=16,
            output_max=64,
        ),
        config=dict(
            block_size=16,
            num_kv_blocks=48,
            max_num_seqs=16,
            max_model_len=1024,
            enable_prefix_caching=True,
            preemption_mode="recompute",
            victim_policy="lru",
        ),
    ),
    # speculation told in three acts, one request at a time: a passage edit (the n-gram drafter
    # copies from the prompt), then open-ended prompts (drafts rejected: "break it") until their
    # class's acceptance monitor falls back to plain decoding
    "speculation": dict(
        file="speculation.jsonl",
        sequential=True,
        prompts=[
            ("passage-edit", "edit", 96),
            ("open-ended-1", "open", 48),
            ("open-ended-2", "open", 48),
            ("open-ended-3", "open", 48),
        ],
        config=dict(
            block_size=16,
            num_kv_blocks=64,
            max_num_seqs=4,
            max_model_len=1024,
            speculative=dict(
                method="ngram", num_speculative_tokens=4, monitor_window=16, probe_interval=64, enable_fallback=True
            ),
        ),
    ),
}


# Acceptance is monitored per request class: edits and open-ended prompts are two classes, so the
# open-ended ones can fall back to plain decoding while edits keep speculating.
CLASSES = {"edit": "passage-edit", "open": "open-ended"}


@dataclass(frozen=True, slots=True)
class LiveRequest:
    """One request of a live run, in the shape engine.recording.LoadFeeder submits."""

    request_id: str
    prompt: object  # text or token ids
    arrival_s: float
    sampling: dict

    def sampling_kwargs(self) -> dict:
        return dict(self.sampling)


def speculation_requests(tokenizer, spec: dict | None = None) -> list[LiveRequest]:
    """The speculation scenario's requests: the bench's passage-edit and open-ended prompts,
    chat-templated, greedy, each kind in its own request class (CLASSES)."""
    from engine.lab.prompt_sets import speculative_sets

    spec = spec or RECORDINGS["speculation"]
    sets = speculative_sets(tokenizer)
    used = {"edit": 0, "open": 0}
    out = []
    for i, (rid, which, max_tokens) in enumerate(spec["prompts"]):
        pool = sets["passage_edit"] if which == "edit" else sets["open_ended"]
        ids = pool[used[which] % len(pool)]
        used[which] += 1
        out.append(
            LiveRequest(rid, list(ids), 0.0, dict(max_tokens=max_tokens, ignore_eos=True, request_class=CLASSES[which]))
        )
    return out


def release_freeze_requests(spec: dict | None = None) -> list:
    from engine.lab.workloads import make_workload

    spec = spec or RECORDINGS["release-freeze"]
    return make_workload(spec["scenario"], spec["n"], 0, **spec["params"])
