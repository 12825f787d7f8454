"""The prefix-cache timing side channel (one tenant learns whether another's prompt prefix is
cached by timing its own time to first token), measured on an EngineThread, and the defence:
a per-tenant cache_salt.

One trial: a fresh random prefix of `prefix_tokens` token ids (a whole number of blocks, never
seen before). In a "cached" trial the victim runs prefix + its own suffix first (1 token), then
the attacker probes prefix + a different suffix; in a "fresh" trial the attacker probes a prefix
nobody ran. The attacker's TTFT (the engine's arrival -> first token) is the observation.
Mode "shared": both tenants use the same (no) salt, so the probe can hit the victim's blocks.
Mode "salted": victim and attacker carry their own cache_salt, so it never can.

Measurement discipline is engine/lab/ab_timing.py's: the four (mode, condition) cells run in every
round in `ab_timing.round_order` (mirrored on odd rounds, so drift lands on every cell alike);
`rounds` repeats per cell; `ab_timing.spread` gives each cell's median, quartiles, min and max.
Contention is checked per probe, finer than ab_timing's step counter: whether another request was
in the engine while the probe ran (this runs on the shared engine).
"""

from __future__ import annotations

import random
import statistics
import uuid
from dataclasses import dataclass
from typing import Callable

from engine.config import SamplingParams
from engine.lab import ab_timing as ab

MODES = ("shared", "salted")
MAX_ROUNDS = 64
MAX_PREFIX_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class Probe:
    mode: str  # shared / salted
    cached: bool  # truth: the victim ran this prefix just before
    ttft_s: float  # the attacker's observation
    hit_tokens: int  # prompt tokens the engine served from the cache for the probe
    contended: bool  # another request was queued or running while the probe ran
    round: int


spread = ab.spread  # median, quartiles, min, max of one cell (engine/lab/ab_timing.py)
CELLS = tuple((m, c) for m in MODES for c in (True, False))


def cell_order(r: int) -> list[tuple[str, bool]]:
    """The four (mode, cached) cells of round r: reversed on odd rounds (ab_timing.round_order)."""
    return ab.round_order(CELLS, r)


def threshold(probes: list[Probe], mode: str = "shared") -> float | None:
    """The attacker's rule, fitted where it can see hits: halfway between the median TTFT of
    cached and fresh probes in `mode`. None without both kinds."""
    hit = [p.ttft_s for p in probes if p.mode == mode and p.cached]
    miss = [p.ttft_s for p in probes if p.mode == mode and not p.cached]
    if not hit or not miss:
        return None
    return (statistics.median(hit) + statistics.median(miss)) / 2


def accuracy(probes: list[Probe], mode: str, thr: float | None) -> float | None:
    """How often "TTFT below thr means cached" is right in `mode` (0.5 = a coin)."""
    ps = [p for p in probes if p.mode == mode]
    if thr is None or not ps:
        return None
    return sum((p.ttft_s < thr) == p.cached for p in ps) / len(ps)


def hit_rate(probes: list[Probe], mode: str, prefix_tokens: int) -> float | None:
    """Share of the victim's prefix the attacker's cached-trial probes got from the cache."""
    ps = [p for p in probes if p.mode == mode and p.cached]
    return None if not ps else sum(min(p.hit_tokens, prefix_tokens) for p in ps) / (prefix_tokens * len(ps))


def probed_prefix_tokens(prefix_tokens: int, block_size: int) -> int:
    """The prefix length `measure` probes for a requested one: cut to whole blocks, so every
    prefix block can be shared."""
    return prefix_tokens - prefix_tokens % block_size


def measure(
    th,
    *,
    prefix_tokens: int,
    rounds: int,
    seed: int = 0,
    timeout_s: float = 600.0,
    on_probe: Callable[[Probe, int, int], None] | None = None,
) -> list[Probe]:
    """Run `rounds` rounds of the four cells on EngineThread `th`; returns every probe."""
    if not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be an integer in [1, {MAX_ROUNDS}]")
    bs = th.config.block_size
    if not isinstance(prefix_tokens, int) or not bs <= prefix_tokens <= MAX_PREFIX_TOKENS:
        raise ValueError(f"prefix_tokens must be an integer in [{bs}, {MAX_PREFIX_TOKENS}]")
    prefix_tokens = probed_prefix_tokens(prefix_tokens, bs)
    rng = random.Random(seed)
    vocab = th.engine.vocab_size
    lo, hi = min(1000, vocab // 4), vocab - 1
    tag = f"sc{uuid.uuid4().hex[:6]}"
    run_salt = uuid.uuid4().hex[:8]  # keeps repeated measurements apart
    n = 0

    def run_one(ids, salt, who):  # submit and wait for its one token
        nonlocal n
        n += 1
        h = th.submit(
            ids,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_salt=salt),
            request_id=f"{tag}-{who}-{n}",
        )
        return h.request_id, h.result(timeout=timeout_s)

    def others_busy(own: str) -> bool:
        return any(not r.is_terminal and r.request_id != own for r in th.snapshot_now().requests)

    def suffix():
        return [rng.randrange(lo, hi) for _ in range(3)]

    probes: list[Probe] = []
    run_one([rng.randrange(lo, hi) for _ in range(prefix_tokens + 3)], run_salt, "warmup")
    total = rounds * 4
    for r in range(rounds):
        for mode, cached in cell_order(r):
            prefix = [rng.randrange(lo, hi) for _ in range(prefix_tokens)]
            shared_salt = f"{run_salt}-shared"  # both tenants in one namespace (no salts)
            v_salt = shared_salt if mode == "shared" else f"{run_salt}-tenant-victim"
            a_salt = shared_salt if mode == "shared" else f"{run_salt}-tenant-attacker"
            if cached:
                run_one(prefix + suffix(), v_salt, "victim")
            busy_before = others_busy("")
            rid, out = run_one(prefix + suffix(), a_salt, "probe")
            busy = busy_before or others_busy(rid)
            p = Probe(mode, cached, float(out.metrics.ttft), int(out.metrics.num_cached_tokens), busy, r)
            probes.append(p)
            if on_probe is not None:
                on_probe(p, len(probes), total)
    return probes
