"""KV cache events in vLLM's wire format: the event types, msgpack encoding / decoding of a
batch (both wire generations), and applying a stream to a set of cached block hashes. The
ZeroMQ publisher and subscriber are engine/observe/kv_events.py.

What goes on the wire (as vLLM's `ZmqEventPublisher` sends it):

- PUB socket, one multipart message per batch: [topic, seq (8-byte big-endian, from 0), payload].
- payload: msgpack of `KVEventBatch` = positional array [ts, events, data_parallel_rank].
- each event is `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, ...)`, `BlockRemoved(block_hashes, medium, group_idx)`
  or `AllBlocksCleared()`; kvscope publishes group_idx=0 and extra_keys [(salt,), None, ...] for a
  salted chain's first block.
  wire="current" (vLLM 0.33): a map tagged by "type", fields by name, defaulted fields omitted.
  wire="legacy" (vLLM before mid-2026, `array_like=True` events): a positional array whose first
  element is the tag, e.g. ["BlockRemoved", [hash, ...], "GPU"].
- block hashes are published as vLLM does by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1):
  the low 64 bits of the hash read big-endian, as an unsigned int.
- replay: a ROUTER socket. A client sends [b"", start_seq as 8 bytes] (DEALER; a REQ socket adds
  the empty frame itself) and gets every buffered batch with seq >= start_seq, then an end
  marker with seq -1 and an empty payload. Current framing: [b"", topic, seq, payload] and
  [b"", b"", END_SEQ, b""]; legacy framing: [b"", seq, payload] and [b"", END_SEQ, b""].

kvscope's events come from the block manager's hash index: "stored" when a full block's hash
enters it, "removed" when it leaves (the block was popped from the free queue for new content,
rewritten, or evicted by hand). Applying the stream in order rebuilds the engine's set of cached
block hashes (`apply_events`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

WIRES = ("current", "legacy")
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_EVENTS_PER_BATCH = 1_000_000


def published_hash(h: bytes) -> int:
    """kvscope's block hash as vLLM publishes hashes by default (KV events, the fleet's cached
    blocks): the low 64 bits, big-endian, unsigned."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


# ---------------------------------------------------------------- events


@dataclass(slots=True)
class BlockStored:
    block_hashes: list
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # vLLM 0.33's trailing fields, in its order (array_like: order is the wire format); None =
    # the default, omitted on the wire (msgspec omit_defaults). extra_keys: one entry per block,
    # a tuple of the keys hashed with it (the cache salt on a chain's first block) or None
    extra_keys: list | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list
    data_parallel_rank: int | None = None
    wire: str = "current"  # which form the events were decoded from ("current"/"legacy"/"mixed")


def _extra_keys_wire(keys):
    return None if keys is None else [list(k) if k is not None else None for k in keys]


def _trailing(fields: list) -> list:
    """vLLM's defaulted trailing fields as msgspec writes them with omit_defaults: up to the
    last one that is set (an unset one before it goes out as null in the array form; the map
    form drops nulls, see _event_to_wire)."""
    while fields and fields[-1][1] is None:
        fields.pop()
    return fields


def _event_to_wire(e, wire: str):
    if isinstance(e, BlockStored):
        fields = [
            ("block_hashes", list(e.block_hashes)),
            ("parent_block_hash", e.parent_block_hash),
            ("token_ids", list(e.token_ids)),
            ("block_size", e.block_size),
            ("lora_id", e.lora_id),
            ("medium", e.medium),
            ("lora_name", e.lora_name),
        ]
        fields += _trailing([("extra_keys", _extra_keys_wire(e.extra_keys)), ("group_idx", e.group_idx)])
    elif isinstance(e, BlockRemoved):
        fields = [("block_hashes", list(e.block_hashes)), ("medium", e.medium)]
        fields += _trailing([("group_idx", e.group_idx)])
    elif isinstance(e, AllBlocksCleared):
        fields = []
    else:
        raise ValueError(f"not a KV event: {type(e).__name__}")
    tag = type(e).__name__
    if wire == "legacy":
        return [tag, *(v for _, v in fields)]
    defaulted = ("extra_keys", "group_idx")
    return {"type": tag, **{k: v for k, v in fields if not (k in defaulted and v is None)}}


def encode_batch(batch: KVEventBatch, wire: str = "current") -> bytes:
    """msgpack bytes of a KVEventBatch, as vLLM's msgspec encoder writes them."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    body = [float(batch.ts), [_event_to_wire(e, wire) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def _hash_list(v, where: str) -> list:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in v):
        raise ValueError(f"{where}.block_hashes: expected a list of ints or bytes")
    return v


def _opt(v, types, where: str):
    if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
        raise ValueError(f"{where}: expected {types} or null, got {type(v).__name__}")
    return v


def _decode_event(raw, i: int):
    where = f"events[{i}]"
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # legacy: tagged array
        tag, vals, form = raw[0], raw[1:], "legacy"
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
            "AllBlocksCleared": (),
        }.get(tag)
        if names is None:
            raise ValueError(f"{where}: unknown event type {tag[:40]!r}")
        required = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}[tag]
        if len(vals) < required:
            raise ValueError(f"{where}: {tag} needs at least {required} fields, got {len(vals)}")
        d = dict(zip(names, vals))  # extra trailing fields (newer vLLM) are ignored
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):  # current: tagged map
        tag, d, form = raw["type"], raw, "current"
    else:
        raise ValueError(f"{where}: expected a tagged map or a tagged array")
    if tag == "BlockStored":
        for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
            if k not in d:
                raise ValueError(f"{where}: BlockStored without {k}")
        toks = d["token_ids"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ValueError(f"{where}.token_ids: expected a list of ints")
        bs = d["block_size"]
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            raise ValueError(f"{where}.block_size: expected a positive int")
        ev = BlockStored(
            _hash_list(d["block_hashes"], where),
            _opt(d["parent_block_hash"], (int, bytes), where),
            toks,
            bs,
            _opt(d.get("lora_id"), int, where),
            _opt(d.get("medium"), str, where),
            _opt(d.get("lora_name"), str, where),
        )
    elif tag == "BlockRemoved":
        if "block_hashes" not in d:
            raise ValueError(f"{where}: BlockRemoved without block_hashes")
        ev = BlockRemoved(_hash_list(d["block_hashes"], where), _opt(d.get("medium"), str, where))
    elif tag == "AllBlocksCleared":
        ev = AllBlocksCleared()
    else:
        raise ValueError(f"{where}: unknown event type {tag[:40]!r}")
    return ev, form


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload in either wire form (and a map-shaped batch). ValueError if malformed."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError("payload must be bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload larger than {MAX_PAYLOAD_BYTES} bytes")
    try:
        obj = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=False, max_array_len=MAX_EVENTS_PER_BATCH)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"payload is not valid msgpack: {type(e).__name__}") from None
    if isinstance(obj, list) and len(obj) >= 2:
        ts, events, dp = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    elif isinstance(obj, dict) and "ts" in obj and "events" in obj:
        ts, events, dp = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise ValueError("payload: expected a KVEventBatch [ts, events, data_parallel_rank]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise ValueError("batch.ts: expected a number")
    if not isinstance(events, list):
        raise ValueError("batch.events: expected a list")
    _opt(dp, int, "batch.data_parallel_rank")
    out, forms = [], set()
    for i, raw in enumerate(events):
        ev, form = _decode_event(raw, i)
        out.append(ev)
        forms.add(form)
    wire = forms.pop() if len(forms) == 1 else ("mixed" if forms else "current")
    return KVEventBatch(float(ts), out, dp, wire)


def apply_events(cached: set, events) -> set:
    """Apply events in order to a set of cached block hashes (what a subscriber keeps)."""
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            cached.clear()
    return cached
