"""What if the gateway had used another rule? The recorded request stream (each request's send
time, duration and prompt blocks, in order) replayed OFFLINE against simulated per-instance
prefix caches (LRU over blocks, each instance's pool size). Every row is a replay of recorded
requests, labelled so (WhatIfRow.label == "replay"), never a measurement.

Rules (as published; the simulation is ours):
* round_robin: request i goes to instance i mod N.
* llmd_longest_prefix: llm-d's prefix-cache scorer: the instance holding the longest run of the
  prompt's leading blocks; ties to the least loaded (in-flight requests), then the lowest index.
* dynamo_overlap_cost: Dynamo's KV router cost, overlap_weight * (prompt blocks not cached
  there, to prefill) + blocks held by its in-flight requests (decode load); the lowest wins.
* recorded: the instances the gateway really chose, through the same simulator: how far the
  simulation is from the measured hit rate (a calibration row, still a replay).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from engine.fleet.state import WhatIfRow

RULES = ("round_robin", "llmd_longest_prefix", "dynamo_overlap_cost", "recorded")


def block_keys(token_ids, block_size: int = 16) -> tuple[str, ...]:
    """A chain key per full block of a prompt: sha256(parent key, token ids), 16 hex digits.
    The replay's own keys (content-addressed, so equal prefixes give equal keys)."""
    out, parent = [], b""
    for k in range(len(token_ids) // block_size):
        blk = token_ids[k * block_size : (k + 1) * block_size]
        h = hashlib.sha256(parent + b"".join(int(t).to_bytes(4, "little") for t in blk)).digest()[:8]
        out.append(h.hex())
        parent = h
    return tuple(out)


@dataclass(frozen=True)
class StreamRequest:
    request_id: str
    t_sent: float
    duration_s: float
    prompt_tokens: int
    blocks: tuple[str, ...]
    served_by: str = ""  # the instance the gateway chose (for the "recorded" rule)


class SimCache:
    """One instance's prefix cache in the replay: LRU over block keys, `capacity` blocks."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.lru: OrderedDict[str, None] = OrderedDict()

    def held(self, blocks) -> int:
        n = 0
        for b in blocks:
            if b not in self.lru:
                break
            n += 1
        return n

    def store(self, blocks) -> None:
        for b in blocks:
            self.lru[b] = None
            self.lru.move_to_end(b)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


def replay(
    stream: list[StreamRequest],
    instances: list[str],
    rule: str,
    *,
    capacity_blocks: int = 256,
    block_size: int = 16,
    overlap_weight: float = 1.0,
    source: str = "",
) -> WhatIfRow:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not instances:
        raise ValueError("instances: at least one is needed")
    caches = {i: SimCache(capacity_blocks) for i in instances}
    in_flight: list[tuple[float, str, int]] = []  # (end time, instance, blocks)
    per = dict.fromkeys(instances, 0)
    hit = prompt = 0
    for k, r in enumerate(sorted(stream, key=lambda s: s.t_sent)):
        in_flight = [f for f in in_flight if f[0] > r.t_sent]
        load_req = {i: sum(1 for f in in_flight if f[1] == i) for i in instances}
        load_blocks = {i: sum(f[2] for f in in_flight if f[1] == i) for i in instances}
        held = {i: caches[i].held(r.blocks) for i in instances}
        if rule == "round_robin":
            pick = instances[k % len(instances)]
        elif rule == "llmd_longest_prefix":
            pick = min(instances, key=lambda i: (-held[i], load_req[i], instances.index(i)))
        elif rule == "dynamo_overlap_cost":

            def cost(i, r=r, held=held, load_blocks=load_blocks):
                return overlap_weight * (len(r.blocks) - held[i]) + load_blocks[i]

            pick = min(instances, key=lambda i: (cost(i), instances.index(i)))
        else:
            pick = r.served_by if r.served_by in caches else instances[0]
        per[pick] += 1
        hit += min(held[pick] * block_size, max(0, r.prompt_tokens - 1))
        prompt += r.prompt_tokens
        caches[pick].store(r.blocks)
        in_flight.append((r.t_sent + r.duration_s, pick, len(r.blocks) + 1))
    notes = {
        "round_robin": "request i to instance i mod N",
        "llmd_longest_prefix": "longest run of leading blocks held; ties to fewest in flight",
        "dynamo_overlap_cost": f"min {overlap_weight:g} x blocks to prefill + in-flight blocks",
        "recorded": "the gateway's real choices through the same simulator (calibration)",
    }
    return WhatIfRow(
        rule=rule,
        requests=len(stream),
        hit_tokens=hit,
        prompt_tokens=prompt,
        hit_rate=round(hit / prompt, 4) if prompt else None,
        per_instance_requests=per,
        note=f"replay of recorded requests, LRU caches of {capacity_blocks} blocks: " + notes[rule],
        source=source,
    )


def replay_all(stream, instances, *, capacity_blocks: int = 256, block_size: int = 16, source: str = ""):
    return [
        replay(stream, instances, rule, capacity_blocks=capacity_blocks, block_size=block_size, source=source)
        for rule in RULES
    ]


__all__ = ["RULES", "SimCache", "StreamRequest", "block_keys", "replay", "replay_all"]
