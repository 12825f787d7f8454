"""The observability contract: immutable, plain-data views of the engine at one step.

The UI reads only these (and Events). Everything is built from the engine's real state:
block ids are indices into the K/V pool tensors, fills are slots actually written.
All classes are frozen; tuples, never lists, so a Snapshot can be shared across threads.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from operator import attrgetter

from engine.observe import rates

# Trace loading (engine/observe/trace_events.py) validates these classes with pydantic: strict types, unknown
# fields refused, no NaN/Infinity (a class attribute, not a field; pydantic reads it).
TRACE_VALIDATION = {"strict": True, "extra": "forbid", "allow_inf_nan": False}


class BlockState(enum.StrEnum):
    """A block's state in the pool map."""

    FREE = "free"  # never used, or evicted from the prefix cache: holds nothing useful
    CACHED = "cached"  # ref count 0 but its content is still indexed by the prefix cache (reusable)
    USED = "used"  # owned by one or more requests (ref count >= 1)


FREE, CACHED, USED = BlockState.FREE, BlockState.CACHED, BlockState.USED


class RequestState(enum.StrEnum):
    """A request's state (the state machine is in engine/core/sequence.py)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after a recompute preemption / eviction
    SWAPPED = "swapped"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED})

# Token marks for the token strip.
PLAIN, ACCEPTED, REJECTED, BONUS, REPLACED = "plain", "accepted", "rejected", "bonus", "replaced"


@dataclass(frozen=True, slots=True)
class BlockInfo:
    __pydantic_config__ = TRACE_VALIDATION
    block_id: int
    state: BlockState
    ref_count: int
    owners: tuple[str, ...]  # request ids whose block table holds this block
    fill: int  # slots holding a token (0..block_size)
    block_hash: str | None = None  # short hex of the prefix-cache hash for full blocks


@dataclass(frozen=True, slots=True)
class TokenMark:
    """One generated token as the engine produced it. kind: plain | accepted (a draft token the
    target accepted) | bonus (the extra token from a verify pass) | replaced (the target's token
    that replaced a rejected draft). `rejected_id` is the draft token that was rejected.
    With rejection sampling (temperature > 0) the verifier's numbers ride along: for accepted and
    replaced tokens `p` / `q` are the target's / drafter's probabilities of the judged draft token
    (1.0 for q when the drafter is deterministic, as n-gram is) and `u` the uniform draw (accepted
    iff u * q < p); for a bonus token `p` is the target's probability of it. None otherwise."""

    __pydantic_config__ = TRACE_VALIDATION
    token_id: int
    text: str
    kind: str = PLAIN
    step: int = 0
    rejected_id: int | None = None
    rejected_text: str | None = None
    p: float | None = None
    q: float | None = None
    u: float | None = None


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    __pydantic_config__ = TRACE_VALIDATION
    step: int
    time: float
    num_cached_tokens: int  # tokens whose K/V are in the pool for this request
    num_blocks: int  # blocks in its block table
    kv_bytes: int
    phase: str  # "prefill" | "decode" | "waiting" | "preempted" | "swapped" | "finished"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    __pydantic_config__ = TRACE_VALIDATION
    request_id: str
    state: RequestState
    tier: str | None
    prompt_len: int
    output_len: int
    num_computed_tokens: int  # tokens whose K/V are written in the pool
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission
    block_table: tuple[int, ...]  # logical block i -> physical block id
    slots_allocated: int  # len(block_table) * block_size (or the reserved slab)
    kv_bytes: int  # bytes of K/V actually holding this request's tokens
    priority: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    last_token_time: float | None = None  # when the newest output token was emitted (ends TPOT)
    waiting_reason: str | None = None  # the sentence shown (Request.wait_reason_text; typed only in WAIT events)
    error: str | None = None
    num_preemptions: int = 0
    prompt_preview: str = ""  # first ~200 chars of the prompt text (raw; escape when rendering)
    output_text: str = ""  # raw text; escape when rendering
    tokens: tuple[TokenMark, ...] = ()
    history: tuple[HistoryPoint, ...] = ()
    # speculative decoding, per request
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    origin: str = "engine"  # who submitted it: "engine" (Python API), "app" (a page), "http" (the API server)

    @property
    def is_terminal(self) -> bool:
        """finished, rejected or aborted: it will not change again."""
        return self.state in _TERMINAL


@dataclass(frozen=True, slots=True)
class SpecMetrics:
    """vLLM's definitions. acceptance_rate = accepted / draft tokens;
    mean_acceptance_length = 1 + accepted / drafts."""

    __pydantic_config__ = TRACE_VALIDATION
    method: str | None = None
    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    drafts_per_position: tuple[int, ...] = ()
    num_target_passes: int = 0  # verify passes (spec requests) + plain decode passes
    num_emitted_tokens: int = 0  # tokens produced by those passes
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    verify_cost_ratio: float | None = None  # measured cost of a (k+1)-token pass / a 1-token pass
    fallback_classes: tuple[str, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return rates.acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        return rates.mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    __pydantic_config__ = TRACE_VALIDATION
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preempted: int = 0  # currently waiting to resume after a recompute preemption
    num_finished: int = 0
    num_rejected: int = 0
    num_aborted: int = 0
    num_preemptions_total: int = 0
    num_swaps_total: int = 0
    num_evictions_total: int = 0
    kv_cache_usage_perc: float = 0.0  # fraction of blocks owned by requests (cached-free count as free)
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    num_blocks_free: int = 0
    slots_allocated: int = 0  # slots in blocks/slabs owned by live requests
    slots_filled: int = 0  # of those, slots holding a token
    waste_fraction: float = 0.0  # 1 - filled / allocated (0 when nothing is allocated)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (vLLM counts tokens)
    prefix_cache_hits: int = 0  # of those, tokens found
    prefix_cache_hit_rate: float = 0.0
    swap_blocks_used: int = 0
    swap_blocks_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    throughput_tok_s: float = 0.0  # generated tokens / busy wall time
    ttft_s: tuple[float, ...] = ()  # per finished-or-started request, most recent last (bounded)
    tpot_s: tuple[float, ...] = ()
    e2e_latency_s: tuple[float, ...] = ()
    step_time_s: float = 0.0  # last step's wall time
    spec: SpecMetrics = field(default_factory=SpecMetrics)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    __pydantic_config__ = TRACE_VALIDATION
    model: str
    device: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    bytes_per_token: int  # K+V, all layers, in the pool dtype
    bytes_per_block: int
    kv_cache_bytes: int  # num_blocks * bytes_per_block
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    allocator: str
    kv_cache: bool
    enable_prefix_caching: bool
    preemption_mode: str
    victim_policy: str
    speculative: str | None  # e.g. "ngram k=4" or None
    kv_capacity_blocks: int = 0  # blocks allocated in the pool tensors (the budget can go up to this)
    linear_backend: str = (
        "torch"  # "cpu_kernel" / "onednn": packed weights, q/k/v and gate/up merged (engine/model/linear.py)
    )
    attention_backend: str = "torch"  # "cpu_kernel": decode attention read in place from the blocks (engine/model/csrc)
    kv_cache_dtype: str = (
        "fp32"  # what the pool stores: fp32 / bf16 / fp16 / fp8_e4m3 / int8 / int4 / int2 (engine/model/kv_quant.py)
    )
    weight_format: str = "torch"  # "gguf": Linears read the GGUF's quantized blocks; "fp32": fp32 copies
    weight_bytes_per_step: int = 0  # weight bytes one forward pass reads in that format (Linears + norms)
    decode_backend: str = "transformers"  # "c": every layer in engine/model/csrc/layer.c (engine/model/fused_decode.py)


@dataclass(frozen=True, slots=True)
class Snapshot:
    __pydantic_config__ = TRACE_VALIDATION
    step: int
    time: float
    info: EngineInfo
    blocks: tuple[BlockInfo, ...]
    requests: tuple[RequestInfo, ...]
    metrics: EngineMetrics
    waiting_ids: tuple[str, ...] = ()
    running_ids: tuple[str, ...] = ()
    swapped_ids: tuple[str, ...] = ()
    healthy: bool = True
    error: str | None = None
    engine_id: str = ""  # unique per LLMEngine instance: a new id means a rebuilt engine

    def request(self, request_id: str) -> RequestInfo | None:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        return None

    def to_dict(self) -> dict:
        return plain(self)


# ------------------------------------------------------------------ plain data
_FIELDS: dict[type, tuple[str, ...] | None] = {}
# classes whose fields hold only plain values (numbers, strings, enums, tuples of those):
# converted with one C-level attribute fetch each
_FLAT = {
    cls: (tuple(f.name for f in fields(cls)), attrgetter(*(f.name for f in fields(cls))))
    for cls in (BlockInfo, TokenMark, HistoryPoint)
}


def _fields_of(cls: type) -> tuple[str, ...] | None:
    names = _FIELDS.get(cls, ())
    if names == ():
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls)) if is_dataclass(cls) else None
    return names


def _value(v):
    t = type(v)
    if t is tuple or t is list:
        if not v:
            return v if t is tuple else []
        flat = _FLAT.get(type(v[0]))
        if flat is not None:
            names, get = flat
            return t(dict(zip(names, get(x))) for x in v)
        if _fields_of(type(v[0])) is not None:
            return t(plain(x) for x in v)
        return v if t is tuple else list(v)  # a tuple of plain values is immutable: shared
    if t is dict:
        return {k: _value(x) for k, x in v.items()}
    return plain(v) if _fields_of(t) is not None else v


def plain(obj) -> dict:
    """A snapshot dataclass (Snapshot, RequestInfo, ...) as nested dicts, equal to
    dataclasses.asdict(obj) for these classes (tuples stay tuples, enums stay enums) but several
    times faster: asdict deep-copies every value, and a snapshot with a few finished requests
    holds thousands of token marks and history points (the engine core publishes one several
    times a second, issue 32)."""
    return {f: _value(getattr(obj, f)) for f in _fields_of(type(obj))}


_READERS: dict[type, tuple] = {}


def _reader(hint):
    """How to read one field's plain value back (hint: the field's resolved type)."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is tuple:
        inner = args[0] if args else None
        if is_dataclass(inner):
            return lambda v: tuple(from_plain(inner, x) for x in v)
        return tuple
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            read = _reader(inner[0])
            if read is not None:
                return lambda v: None if v is None else read(v)
        return None
    if is_dataclass(hint):
        return lambda v: from_plain(hint, v)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    return None


def from_plain(cls: type, data: dict):
    """The inverse of plain() for data this program wrote itself (the engine core's frames,
    issue 32): the dataclass tree rebuilt without validation, arrays as tuples, enum values as
    enums. Untrusted JSON goes through trace_events.snapshot_from_dict, which validates."""
    readers = _READERS.get(cls)
    if readers is None:
        hints = typing.get_type_hints(cls)
        readers = ((f.name, _reader(hints[f.name])) for f in fields(cls))
        readers = _READERS[cls] = tuple((n, r) for n, r in readers if r is not None)
    if not readers:
        return cls(**data)
    kw = dict(data)
    for name, read in readers:
        if name in kw:
            kw[name] = read(kw[name])
    return cls(**kw)
