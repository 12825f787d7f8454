"""Typed engine events (kvscope's own record of every scheduling and memory decision; the
vLLM-format KV-cache events are engine/observe/kv_events.py), the bounded ring they live in, and JSONL
trace read/write.

A trace file is JSON Lines: a header line {"kind": "kvscope-trace", "version": 2}, then lines
{"kind": "snapshot", "snapshot": {...}} and {"kind": "event", "event": {...}}. Reading never
executes anything (json only), validates every snapshot and event with pydantic in strict mode
(unknown fields refused), and bounds size and line count. Version 1 traces (before event payloads
were fixed per kind: `blocks` was a count in admit / prefill / swap events) still load; their
counts are read as `num_blocks`.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Iterable

from pydantic import TypeAdapter, ValidationError

from engine.observe.snapshot import TRACE_VALIDATION, Snapshot


class EventKind(enum.StrEnum):
    """What happened. Every memory decision has a kind and a reason (`data["reason"]`); the keys
    of `data` for each kind are fixed: EVENT_PAYLOADS. In `data`, `blocks` is always a list of
    block ids and `num_blocks` a count."""

    ADMIT = "admit"  # a waiting request was scheduled (first time, or resumed)
    REJECT = "reject"  # refused at add_request / admission
    WAIT = "wait"  # a request started waiting for KV memory (wait_reason says which way)
    PREFILL = "prefill"  # a prefill chunk ran
    DECODE = "decode"  # a decode step produced a token
    BLOCK_ALLOC = "block_alloc"  # blocks appended to a block table (a request's or its draft's)
    BLOCK_FREE = "block_free"  # blocks released (finish/abort/rollback/no-cache/draft)
    PREFIX_HIT = "prefix_hit"  # blocks reused from the prefix cache at admission
    PREFIX_EVICT = "prefix_evict"  # a cached-free block was reused for new content; its hash is dropped
    COW = "cow"  # copy-on-write of a shared block before a write
    PREEMPT = "preempt"  # victim chosen (mode, blocks freed, tokens to recompute, why)
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    EVICT = "evict"  # manual eviction (LLMEngine.evict)
    FINISH = "finish"
    ABORT = "abort"
    ERROR = "error"  # a step (or a draft) failed; the requests in it are failed
    SPEC_VERIFY = "spec_verify"  # proposed, accepted, rejected/replacement, bonus, times
    SPEC_FALLBACK = "spec_fallback"  # a request class stopped / resumed speculating
    CONFIG = "config"  # engine started or its KV budget changed
    SCHEDULE = "schedule"  # one per forward pass: who was in it (rows) and its forward time


# The data keys of each kind: (always present, present in some events of the kind).
_SPEC_VERIFY_KEYS = (
    "method",
    "k",
    "proposed",
    "proposed_text",
    "accepted",
    "rejected",
    "rejected_text",
    "replacement",
    "replacement_text",
    "bonus",
    "bonus_text",
    "draft_s",
    "verify_s",
    "request_class",
    "reason",
)
EVENT_PAYLOADS: dict[EventKind, tuple[tuple[str, ...], tuple[str, ...]]] = {
    EventKind.ADMIT: (("resumed", "prompt_tokens", "tokens_to_compute", "cached_tokens", "num_blocks", "reason"), ()),
    EventKind.REJECT: (("reason",), ()),
    EventKind.WAIT: (("wait_reason", "reason"), ()),
    EventKind.PREFILL: (("start", "tokens", "num_blocks", "chunk"), ()),
    EventKind.DECODE: (("token", "position"), ()),
    EventKind.BLOCK_ALLOC: (("blocks", "reason"), ()),
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
    EventKind.SPEC_FALLBACK: (
        ("request_class", "speculating", "reason"),
        (
            "acceptance_rate",
            "mean_acceptance_length",
            "cost_ratio",
            "break_even_alpha",
            "mean_k",
            "batch",
            "draft_s_per_request",
            "plain_pass_s",
            "verify_pass_s",
        ),
    ),
    EventKind.CONFIG: (("num_blocks", "reason"), ("model", "block_size", "bytes_per_token", "previous")),
    # rows: [[request_id, "prefill" | "decode" | "verify", num_tokens, start], ...] in batch order
    EventKind.SCHEDULE: (("rows", "forward_s"), ()),
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
WAIT, BLOCK_ALLOC = EventKind.WAIT, EventKind.BLOCK_ALLOC
BLOCK_FREE, PREFIX_HIT, PREFIX_EVICT, COW = (
    EventKind.BLOCK_FREE,
    EventKind.PREFIX_HIT,
    EventKind.PREFIX_EVICT,
    EventKind.COW,
)
PREEMPT, SWAP_OUT, SWAP_IN, EVICT = EventKind.PREEMPT, EventKind.SWAP_OUT, EventKind.SWAP_IN, EventKind.EVICT
FINISH, ABORT, ERROR, CONFIG = EventKind.FINISH, EventKind.ABORT, EventKind.ERROR, EventKind.CONFIG
SPEC_VERIFY, SPEC_FALLBACK, SCHEDULE = EventKind.SPEC_VERIFY, EventKind.SPEC_FALLBACK, EventKind.SCHEDULE

TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_TRACE_BYTES = 256 * 1024 * 1024
MAX_TRACE_LINES = 2_000_000
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Event:
    seq: int  # monotonically increasing event number
    step: int  # engine step during which it happened
    time: float  # seconds since the engine started
    kind: EventKind
    request_id: str | None = None
    data: dict = field(default_factory=dict)  # JSON-serialisable details, incl. "reason"

    __pydantic_config__ = TRACE_VALIDATION

    def to_dict(self) -> dict:
        return asdict(self)


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
    fp.write(json.dumps({"kind": "kvscope-trace", "version": TRACE_VERSION}) + "\n")
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


_ADAPTERS: dict[type, TypeAdapter] = {}
_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected an object",
    "missing": "missing field",
}


def _where(root: str, loc) -> str:
    out = root
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _validate(cls: type, root: str, data):
    """Build cls (a dataclass tree) from JSON data with pydantic in strict mode. Raises ValueError
    naming the field: '<root>.<field>[<index>]...: <what was expected>'."""
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    try:
        text = json.dumps(data, allow_nan=False)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    try:
        return adapter.validate_json(text)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    unknown = [x for x in errors if x["type"] in ("unexpected_keyword_argument", "extra_forbidden")]
    if unknown:
        parent = unknown[0]["loc"][:-1]
        names = sorted(str(x["loc"][-1]) for x in unknown if x["loc"][:-1] == parent)
        raise ValueError(f"{_where(root, parent)}: unknown field(s) {names[:5]}")
    err = errors[0]
    loc, typ, got = err["loc"], err["type"], err.get("input")
    if typ in ("dataclass_type", "dataclass_exact_type", "model_type", "dict_type") or (not loc and typ != "missing"):
        raise ValueError(f"{_where(root, loc)}: expected an object, got {type(got).__name__}")
    if typ == "enum" and cls is Event and loc == ("kind",):
        raise ValueError(f"{root}.kind: unknown kind {str(got)[:40]!r}")
    if typ == "enum":
        raise ValueError(f"{_where(root, loc)}: unknown value {str(got)[:40]!r} ({err['msg']})")
    raise ValueError(f"{_where(root, loc)}: {_EXPECTED.get(typ, err['msg'])}")


def snapshot_from_dict(data) -> Snapshot:
    """A Snapshot from its to_dict() JSON (the server's /v1/kvscope routes). ValueError naming the field."""
    return _validate(Snapshot, "Snapshot", data)


def event_from_dict(data) -> Event:
    """An Event from its to_dict() JSON. ValueError naming the field."""
    return _validate(Event, "event", data)


_V1_BLOCK_COUNTS = (EventKind.ADMIT, EventKind.PREFILL, EventKind.SWAP_OUT, EventKind.SWAP_IN)


def _upgrade_v1_event(e: Event) -> Event:
    """Version 1 wrote a block count as `blocks` in admit / prefill / swap events: now `num_blocks`."""
    if e.kind in _V1_BLOCK_COUNTS and isinstance(e.data.get("blocks"), int):
        data = {("num_blocks" if k == "blocks" else k): v for k, v in e.data.items()}
        return Event(e.seq, e.step, e.time, e.kind, e.request_id, data)
    return e


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
    version = TRACE_VERSION
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
        except ValueError as e:  # NaN/Infinity, integers over Python's digit limit
            raise ValueError(f"trace line {i}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ValueError(f"trace line {i}: expected an object with a 'kind'")
        kind = obj["kind"]
        try:
            if i == 1 or (not snaps and not events and kind == "kvscope-trace"):
                version = obj.get("version")
                if kind != "kvscope-trace" or type(version) is not int or version not in READABLE_VERSIONS:
                    raise ValueError(
                        f'the first line must be the header {{"kind": "kvscope-trace", '
                        f'"version": {TRACE_VERSION}}} (versions {list(READABLE_VERSIONS)} are read)'
                    )
                continue
            if kind == "snapshot":
                snaps.append(_validate(Snapshot, "Snapshot", obj.get("snapshot")))
            elif kind == "event":
                e = _validate(Event, "event", obj.get("event"))
                events.append(_upgrade_v1_event(e) if version == 1 else e)
            else:
                raise ValueError(f"unknown line kind {str(kind)[:40]!r}")
        except ValueError as e:
            raise ValueError(f"trace line {i}: {e}") from None
    if not snaps:
        raise ValueError("trace holds no snapshot")
    return Trace(snaps, events)
