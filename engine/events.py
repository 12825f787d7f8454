"""Typed engine events, the bounded ring they live in, and JSONL trace read/write.

A trace file is JSON Lines: a header line {"kind": "kvscope-trace", "version": 1}, then lines
{"kind": "snapshot", "snapshot": {...}} and {"kind": "event", "event": {...}}. Reading never
executes anything (json only), checks the schema line by line, and bounds size and line count.
"""
from __future__ import annotations

import enum
import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Iterable

from .snapshot import Snapshot, snapshot_from_dict

class EventKind(enum.StrEnum):
    """What happened. Every memory decision has a kind and a reason (`data["reason"]`); the keys
    of `data` for each kind are fixed: EVENT_PAYLOADS. In `data`, `blocks` is always a list of
    block ids and `num_blocks` a count."""

    ADMIT = "admit"                  # a waiting request was scheduled (first time, or resumed)
    REJECT = "reject"                # refused at add_request / admission
    PREFILL = "prefill"              # a prefill chunk ran
    DECODE = "decode"                # a decode step produced a token
    BLOCK_FREE = "block_free"        # blocks released (finish/abort/rollback/no-cache/draft)
    PREFIX_HIT = "prefix_hit"        # blocks reused from the prefix cache at admission
    PREFIX_EVICT = "prefix_evict"    # a cached-free block was reused for new content; its hash is dropped
    COW = "cow"                      # copy-on-write of a shared block before a write
    PREEMPT = "preempt"              # victim chosen (mode, blocks freed, tokens to recompute, why)
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    EVICT = "evict"                  # manual eviction (LLMEngine.evict)
    FINISH = "finish"
    ABORT = "abort"
    ERROR = "error"                  # a step (or a draft) failed; the requests in it are failed
    SPEC_VERIFY = "spec_verify"      # proposed, accepted, rejected/replacement, bonus, times
    SPEC_FALLBACK = "spec_fallback"  # a request class stopped / resumed speculating
    CONFIG = "config"                # engine started or its KV budget changed


# The data keys of each kind: (always present, present in some events of the kind).
_SPEC_VERIFY_KEYS = ("method", "k", "proposed", "proposed_text", "accepted", "rejected", "rejected_text",
                     "replacement", "replacement_text", "bonus", "bonus_text", "draft_s", "verify_s",
                     "request_class", "reason")
EVENT_PAYLOADS: dict[EventKind, tuple[tuple[str, ...], tuple[str, ...]]] = {
    EventKind.ADMIT: (("resumed", "prompt_tokens", "tokens_to_compute", "cached_tokens", "num_blocks",
                       "reason"), ()),
    EventKind.REJECT: (("reason",), ()),
    EventKind.PREFILL: (("start", "tokens", "num_blocks", "chunk"), ()),
    EventKind.DECODE: (("token", "position"), ()),
    EventKind.BLOCK_FREE: (("blocks", "reason"), ()),
    EventKind.PREFIX_HIT: (("blocks", "tokens", "reason"), ()),
    EventKind.PREFIX_EVICT: (("block", "hash", "reason"), ()),
    EventKind.COW: (("src", "dst", "reason"), ()),
    EventKind.PREEMPT: (("mode", "blocks_freed", "tokens_to_recompute", "reason"), ()),
    EventKind.SWAP_OUT: (("blocks", "swap_slots", "tokens", "reason"), ()),
    EventKind.SWAP_IN: (("blocks", "swap_slots", "tokens", "reason"), ()),
    EventKind.EVICT: (("blocks_freed", "tokens_to_recompute", "cached_tokens_dropped", "reason"), ()),
    EventKind.FINISH: (("finish_reason", "output_tokens", "reason"), ()),
    EventKind.ABORT: (("finish_reason", "output_tokens", "reason"), ()),
    EventKind.ERROR: (("reason",), ("finish_reason", "output_tokens")),
    EventKind.SPEC_VERIFY: (_SPEC_VERIFY_KEYS, ()),
    EventKind.SPEC_FALLBACK: (("request_class", "speculating", "reason"),
                              ("acceptance_rate", "mean_acceptance_length", "cost_ratio", "break_even_alpha",
                               "mean_k", "batch", "draft_s_per_request", "plain_pass_s", "verify_pass_s")),
    EventKind.CONFIG: (("num_blocks", "reason"), ("model", "block_size", "bytes_per_token", "previous")),
}


def check_payload(kind: EventKind, data: dict) -> None:
    """Raise ValueError unless data has every key its kind always carries and no other key."""
    required, optional = EVENT_PAYLOADS[EventKind(kind)]
    missing = set(required) - set(data)
    extra = set(data) - set(required) - set(optional)
    if missing or extra:
        raise ValueError(f"{kind} event: missing {sorted(missing)}, unexpected {sorted(extra)}")


# Module-level names for the kinds (ev.ADMIT, ...).
ADMIT, REJECT, PREFILL, DECODE = EventKind.ADMIT, EventKind.REJECT, EventKind.PREFILL, EventKind.DECODE
BLOCK_FREE, PREFIX_HIT, PREFIX_EVICT, COW = (EventKind.BLOCK_FREE, EventKind.PREFIX_HIT, EventKind.PREFIX_EVICT,
                                             EventKind.COW)
PREEMPT, SWAP_OUT, SWAP_IN, EVICT = EventKind.PREEMPT, EventKind.SWAP_OUT, EventKind.SWAP_IN, EventKind.EVICT
FINISH, ABORT, ERROR, CONFIG = EventKind.FINISH, EventKind.ABORT, EventKind.ERROR, EventKind.CONFIG
SPEC_VERIFY, SPEC_FALLBACK = EventKind.SPEC_VERIFY, EventKind.SPEC_FALLBACK
EVENT_KINDS = tuple(EventKind)

MAX_TRACE_BYTES = 256 * 1024 * 1024
MAX_TRACE_LINES = 2_000_000
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Event:
    seq: int                     # monotonically increasing event number
    step: int                    # engine step during which it happened
    time: float                  # seconds since the engine started
    kind: EventKind
    request_id: str | None = None
    data: dict = field(default_factory=dict)   # JSON-serialisable details, incl. "reason"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Event":
        if not isinstance(d, dict):
            raise ValueError("event: expected an object")
        allowed = {"seq", "step", "time", "kind", "request_id", "data"}
        if set(d) - allowed:
            raise ValueError(f"event: unknown field(s) {sorted(set(d) - allowed)[:5]}")
        for k, t in (("seq", int), ("step", int)):
            if not isinstance(d.get(k), t) or isinstance(d.get(k), bool):
                raise ValueError(f"event.{k}: expected an integer")
        if not isinstance(d.get("time"), (int, float)) or isinstance(d.get("time"), bool):
            raise ValueError("event.time: expected a number")
        if d.get("kind") not in EVENT_KINDS:
            raise ValueError(f"event.kind: unknown kind {str(d.get('kind'))[:40]!r}")
        rid = d.get("request_id")
        if rid is not None and not isinstance(rid, str):
            raise ValueError("event.request_id: expected a string or null")
        data = d.get("data", {})
        if not isinstance(data, dict):
            raise ValueError("event.data: expected an object")
        return Event(d["seq"], d["step"], float(d["time"]), d["kind"], rid, data)


class EventRing:
    """Bounded, thread-safe ring of events. `since(seq)` gives events newer than seq."""

    def __init__(self, maxlen: int = 20000):
        self._buf: deque[Event] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._seq = 0

    def emit(self, step: int, time: float, kind: str, request_id: str | None = None, **data) -> Event:
        with self._lock:
            self._seq += 1
            ev = Event(self._seq, step, time, kind, request_id, data)
            self._buf.append(ev)
        return ev

    def since(self, seq: int = 0, kinds: Iterable[str] | None = None) -> list[Event]:
        with self._lock:
            evs = [e for e in self._buf if e.seq > seq]
        if kinds is not None:
            ks = set(kinds)
            evs = [e for e in evs if e.kind in ks]
        return evs

    def __iter__(self):
        return iter(self.since(0))

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def maxlen(self) -> int:
        return self._buf.maxlen


# ---------------------------------------------------------------- traces

def write_trace(fp: IO[str], snapshots: Iterable[Snapshot], events: Iterable[Event]) -> None:
    fp.write(json.dumps({"kind": "kvscope-trace", "version": 1}) + "\n")
    for s in snapshots:
        fp.write(json.dumps({"kind": "snapshot", "snapshot": s.to_dict()}, separators=(",", ":")) + "\n")
    for e in events:
        fp.write(json.dumps({"kind": "event", "event": e.to_dict()}, separators=(",", ":")) + "\n")


def trace_to_string(snapshots: Iterable[Snapshot], events: Iterable[Event]) -> str:
    import io
    buf = io.StringIO()
    write_trace(buf, snapshots, events)
    return buf.getvalue()


@dataclass(slots=True)
class Trace:
    snapshots: list[Snapshot]
    events: list[Event]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def read_trace(source: str | bytes | IO, *, max_bytes: int = MAX_TRACE_BYTES) -> Trace:
    """Parse a JSONL trace. Raises ValueError with the line number on anything malformed."""
    if hasattr(source, "read"):
        source = source.read(max_bytes + 1)
    if isinstance(source, bytes):
        if len(source) > max_bytes:
            raise ValueError(f"trace is larger than the limit of {max_bytes} bytes")
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"trace is not valid UTF-8: {e}") from None
    if not isinstance(source, str):
        raise ValueError("trace must be text (JSON Lines)")
    if len(source) > max_bytes:
        raise ValueError(f"trace is larger than the limit of {max_bytes} bytes")
    lines = source.splitlines()
    if len(lines) > MAX_TRACE_LINES:
        raise ValueError(f"trace has more than {MAX_TRACE_LINES} lines")
    if not lines:
        raise ValueError("trace is empty")
    snaps: list[Snapshot] = []
    events: list[Event] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"trace line {i}: longer than {MAX_LINE_BYTES} characters")
        try:
            obj = json.loads(line, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace line {i}: not valid JSON ({e.msg}); the file may be truncated") from None
        except RecursionError:
            raise ValueError(f"trace line {i}: JSON nested too deeply") from None
        except ValueError as e:    # NaN/Infinity, integers over Python's digit limit
            raise ValueError(f"trace line {i}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ValueError(f"trace line {i}: expected an object with a 'kind'")
        kind = obj["kind"]
        try:
            if i == 1 or (not snaps and not events and kind == "kvscope-trace"):
                if kind != "kvscope-trace" or obj.get("version") != 1:
                    raise ValueError("the first line must be the header {\"kind\": \"kvscope-trace\", \"version\": 1}")
                continue
            if kind == "snapshot":
                snaps.append(snapshot_from_dict(obj.get("snapshot")))
            elif kind == "event":
                events.append(Event.from_dict(obj.get("event")))
            else:
                raise ValueError(f"unknown line kind {str(kind)[:40]!r}")
        except ValueError as e:
            raise ValueError(f"trace line {i}: {e}") from None
    if not snaps:
        raise ValueError("trace holds no snapshot")
    return Trace(snaps, events)
