"""The fleet's state as plain, frozen, JSON-serializable data: what the Fleet page draws.

Pure data, no I/O except FleetTrace.save/load. Every dataclass has to_dict() / from_dict();
sets are stored as sorted lists so a round trip is exact and the JSON is stable.
Rows that come from an offline replay (WhatIfRow) carry `label="replay"` and are never
mixed with measured rows (RequestRow, PolicyRun).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


def _tuple(x: Any) -> tuple:
    return tuple(x) if x is not None else ()


@dataclass(frozen=True)
class StreamHealth:
    """One instance's KV-event stream as the collector saw it."""

    connected: bool = False
    encoding: str = ""  # "msgpack" / "json" / "" (not seen yet)
    batches: int = 0
    events: int = 0
    last_seq: int = -1
    seq_gaps: int = 0  # gaps detected in the batch sequence numbers
    replays: int = 0  # replay requests that returned batches
    replayed_batches: int = 0
    clears: int = 0  # AllBlocksCleared events
    missed: int = 0  # seq numbers neither received nor replayed (fell out of the replay buffer)
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StreamHealth:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class InstanceStatus:
    """One serving instance at one moment: its /metrics and its event stream."""

    url: str  # http://127.0.0.1:PORT
    engine_id: str = ""
    kind: str = "kvscope"  # kvscope / vllm / sglang / unknown
    up: bool = False
    reason: str = ""  # why it is down ("" when up)
    kv_usage: float | None = None  # 0..1 (vllm:kv_cache_usage_perc)
    running: int | None = None
    waiting: int | None = None
    prefix_hit_rate: float | None = None  # hits / queries over the instance's life
    prefix_queries: float | None = None  # tokens
    prefix_hits: float | None = None  # tokens
    preemptions: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    cached_blocks: int = 0  # blocks in the collector's rebuilt set for this instance
    stream: StreamHealth = field(default_factory=StreamHealth)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stream"] = self.stream.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> InstanceStatus:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["stream"] = StreamHealth.from_dict(d.get("stream") or {})
        return cls(**kw)


@dataclass(frozen=True)
class TreeNode:
    """One block of the merged prefix tree: a block hash (hex string), its parent's hash
    ("" for a root block), the tokens it covers, and the instances (engine ids) holding it."""

    block_hash: str
    parent: str = ""
    token_count: int = 0
    holders: tuple[str, ...] = ()
    depth: int = 0  # blocks from the root (0 for a root block), -1 if the parent chain is unknown

    def __post_init__(self) -> None:
        object.__setattr__(self, "holders", tuple(sorted(set(self.holders))))

    def to_dict(self) -> dict:
        return {
            "block_hash": self.block_hash,
            "parent": self.parent,
            "token_count": self.token_count,
            "holders": sorted(self.holders),
            "depth": self.depth,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TreeNode:
        return cls(
            block_hash=d["block_hash"],
            parent=d.get("parent", ""),
            token_count=int(d.get("token_count", 0)),
            holders=tuple(sorted(d.get("holders", ()))),
            depth=int(d.get("depth", 0)),
        )


@dataclass(frozen=True)
class PrefixTree:
    """The fleet's merged prefix tree rebuilt from every instance's events.

    duplicated_blocks: nodes held on more than one instance, counted once per extra copy
    (a block on 3 instances adds 2). duplicated_bytes = duplicated_blocks * bytes_per_block
    (None when the block size in bytes is not known)."""

    nodes: tuple[TreeNode, ...] = ()
    duplicated_blocks: int = 0
    duplicated_bytes: int | None = None
    bytes_per_block: int | None = None

    def to_dict(self) -> dict:
        return {
            "nodes": [n.to_dict() for n in self.nodes],
            "duplicated_blocks": self.duplicated_blocks,
            "duplicated_bytes": self.duplicated_bytes,
            "bytes_per_block": self.bytes_per_block,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PrefixTree:
        return cls(
            nodes=tuple(TreeNode.from_dict(n) for n in d.get("nodes", ())),
            duplicated_blocks=int(d.get("duplicated_blocks", 0)),
            duplicated_bytes=d.get("duplicated_bytes"),
            bytes_per_block=d.get("bytes_per_block"),
        )


# no-hit reasons of a RequestRow (empty string: the request got a hit, or it is not known)
NO_HIT_NEVER_STORED = "never_stored"  # no instance had ever stored the request's first block
NO_HIT_EVICTED = "evicted"  # some instance had stored it, but removed it before the request came
NO_HIT_ELSEWHERE = "held_elsewhere"  # another instance held it; the gateway sent it to one that did not


@dataclass(frozen=True)
class RequestRow:
    """One request sent through the gateway (a measurement)."""

    request_id: str
    t_sent: float = 0.0  # seconds since the run began
    policy: str = ""
    served_by: str = ""  # engine id of the instance that served it ("" unknown)
    prompt_tokens: int = 0
    held_at_arrival: dict[str, int] = field(default_factory=dict)  # engine id -> prefix tokens held
    best_holder: str = ""  # engine id holding the longest prefix ("" none)
    best_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens from the server
    router_credited: int | None = None  # the router's credited prefix tokens, where it reports them
    no_hit_reason: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str = ""
    conversation: str = ""
    turn: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["held_at_arrival"] = dict(sorted(self.held_at_arrival.items()))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRow:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["held_at_arrival"] = {str(k): int(v) for k, v in (d.get("held_at_arrival") or {}).items()}
        return cls(**kw)


@dataclass(frozen=True)
class PolicyRun:
    """Summary of one measured run of a workload under one routing policy."""

    policy: str
    requests: int = 0
    errors: int = 0
    fleet_hit_rate: float | None = None  # sum(cached_tokens) / sum(prompt_tokens)
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    output_tok_s: float | None = None
    wall_s: float | None = None
    per_instance_requests: dict[str, int] = field(default_factory=dict)
    duplicated_blocks: int = 0  # at the end of the run
    preemptions: int = 0  # summed over instances during the run
    landed_on_best: float | None = None  # share of requests served by a best holder (when one held any)
    workload: str = ""
    model: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_instance_requests"] = dict(sorted(self.per_instance_requests.items()))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PolicyRun:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["per_instance_requests"] = {str(k): int(v) for k, v in (d.get("per_instance_requests") or {}).items()}
        return cls(**kw)


@dataclass(frozen=True)
class WhatIfRow:
    """One rule replayed offline over a recorded request stream and event log. Never a measurement."""

    rule: str  # "round_robin" / "dynamo_overlap_cost" / "llmd_longest_prefix" / ...
    label: str = "replay"
    requests: int = 0
    hit_tokens: int = 0  # prefix tokens the chosen instance held (from the recorded events)
    prompt_tokens: int = 0
    hit_rate: float | None = None
    per_instance_requests: dict[str, int] = field(default_factory=dict)
    note: str = ""
    source: str = ""  # which recorded run it replays

    def to_dict(self) -> dict:
        d = asdict(self)
        d["per_instance_requests"] = dict(sorted(self.per_instance_requests.items()))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> WhatIfRow:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["per_instance_requests"] = {str(k): int(v) for k, v in (d.get("per_instance_requests") or {}).items()}
        if kw.get("label", "replay") != "replay":
            raise ValueError(f"WhatIfRow.label must be 'replay', got {kw['label']!r}")
        return cls(**kw)


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet at one moment."""

    t: float  # seconds since the trace began
    instances: tuple[InstanceStatus, ...] = ()
    tree: PrefixTree = field(default_factory=PrefixTree)
    router: str = ""  # gateway url ("" none)
    policy: str = ""

    def instance(self, engine_id: str) -> InstanceStatus | None:
        return next((i for i in self.instances if i.engine_id == engine_id), None)

    def to_dict(self) -> dict:
        return {
            "t": self.t,
            "instances": [i.to_dict() for i in self.instances],
            "tree": self.tree.to_dict(),
            "router": self.router,
            "policy": self.policy,
        }

    @classmethod
    def from_dict(cls, d: dict) -> FleetSnapshot:
        return cls(
            t=float(d["t"]),
            instances=tuple(InstanceStatus.from_dict(i) for i in d.get("instances", ())),
            tree=PrefixTree.from_dict(d.get("tree") or {}),
            router=d.get("router", ""),
            policy=d.get("policy", ""),
        )


@dataclass(frozen=True)
class FleetTrace:
    """A recorded fleet session: snapshots over time, the request ledger, policy-run summaries and
    what-if replays. `meta` is free-form (model, CPU, command) but must be JSON-serializable."""

    snapshots: tuple[FleetSnapshot, ...] = ()
    requests: tuple[RequestRow, ...] = ()
    runs: tuple[PolicyRun, ...] = ()
    whatif: tuple[WhatIfRow, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "meta": dict(self.meta),
            "snapshots": [s.to_dict() for s in self.snapshots],
            "requests": [r.to_dict() for r in self.requests],
            "runs": [r.to_dict() for r in self.runs],
            "whatif": [w.to_dict() for w in self.whatif],
        }

    @classmethod
    def from_dict(cls, d: dict) -> FleetTrace:
        v = int(d.get("version", SCHEMA_VERSION))
        if v > SCHEMA_VERSION:
            raise ValueError(f"fleet trace version {v} is newer than this reader ({SCHEMA_VERSION})")
        return cls(
            snapshots=tuple(FleetSnapshot.from_dict(s) for s in d.get("snapshots", ())),
            requests=tuple(RequestRow.from_dict(r) for r in d.get("requests", ())),
            runs=tuple(PolicyRun.from_dict(r) for r in d.get("runs", ())),
            whatif=tuple(WhatIfRow.from_dict(w) for w in d.get("whatif", ())),
            meta=dict(d.get("meta") or {}),
            version=v,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FleetTrace:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FleetTrace:
        return cls.from_json(Path(path).read_text())


__all__ = [
    "NO_HIT_ELSEWHERE",
    "NO_HIT_EVICTED",
    "NO_HIT_NEVER_STORED",
    "SCHEMA_VERSION",
    "FleetSnapshot",
    "FleetTrace",
    "InstanceStatus",
    "PolicyRun",
    "PrefixTree",
    "RequestRow",
    "StreamHealth",
    "TreeNode",
    "WhatIfRow",
]
