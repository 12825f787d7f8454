"""Soak run: many requests from the workload scenarios through one engine under a KV budget far
below demand, with random client aborts and manual evictions, in both preemption modes.

    python -m engine soak [--requests 1000] [--model default] [--mode both] [--seed 0] [--profile small]

What one run does (``run_soak``):

1. Builds a seeded mix of the three scenarios (release-freeze, shared-system-prompt, mixed) and a
   bursty arrival schedule counted in engine steps (no wall clock, so runs are reproducible).
2. Reference: the same requests, greedy, on an unconstrained engine (a pool big enough that
   nothing ever waits for memory, prefix caching off). Its peak block use is the "peak demand".
3. Constrained: a pool of ~``budget_fraction`` of that peak (never below the largest single
   request), prefix caching on, the given preemption mode (swap with a swap space much smaller
   than the pool, so the swap-full fallback to recompute happens too). Between steps it aborts a
   random live request or evicts a random running one now and then, aborts unknown and finished
   ids (which must be harmless), and runs ``check_invariants()`` after every step.
4. Checks: every request ends exactly once as finished, aborted (by the soak, reason "abort") or
   rejected (ValueError with a reason); finished outputs equal the reference token for token;
   aborted requests' partial outputs are prefixes of the reference; every preemption / eviction /
   rejection event carries a reason; no event was dropped before it was read; at the end every
   block is free or cached-free and the swap space is empty. RSS (VmRSS) is sampled throughout.

Problems are collected in ``SoakReport.problems`` (empty = pass); the CLI (engine/lab/soak_cli.py)
exits 1 if any.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import asdict, dataclass, field

from engine.config import EngineConfig, SamplingParams, TierConfig, default_tiers
from engine.lab.workloads import make_workload
from engine.model.kv_layout import cdiv
from engine.observe.rates import prefix_hit_rate
from engine.observe.trace_events import EventKind

SCENARIO_ORDER = ("release-freeze", "shared-system-prompt", "mixed")

# Scenario parameters per profile. "small": short prompts and outputs (the suite's tiny-model
# soak, and a real-model soak that fits minutes on a laptop CPU). "medium": scenario-shaped
# prompts, outputs capped. "full": the scenarios' own defaults (hours on CPU for the real model).
PROFILES: dict[str, dict[str, dict]] = {
    "small": {
        "release-freeze": dict(
            turns=3,
            prompt_median=20,
            prompt_sigma=0.4,
            prompt_min=6,
            prompt_max=48,
            followup_median=8,
            followup_sigma=0.4,
            context_max=96,
            output_median=8,
            output_sigma=0.5,
            output_min=2,
            output_max=20,
        ),
        "shared-system-prompt": dict(
            system_words=40,
            prompt_median=8,
            prompt_sigma=0.4,
            prompt_min=2,
            prompt_max=24,
            output_median=8,
            output_sigma=0.5,
            output_min=2,
            output_max=20,
        ),
        "mixed": dict(
            prompt_median=14,
            prompt_sigma=0.8,
            prompt_min=2,
            prompt_max=64,
            output_median=8,
            output_sigma=0.6,
            output_min=2,
            output_max=24,
        ),
    },
    "medium": {
        "release-freeze": dict(
            prompt_median=60, prompt_max=200, context_max=300, output_median=16, output_min=4, output_max=48
        ),
        "shared-system-prompt": dict(system_words=150, output_median=16, output_min=4, output_max=48),
        "mixed": dict(prompt_median=40, prompt_max=300, output_median=16, output_min=4, output_max=48),
    },
    "full": {name: {} for name in SCENARIO_ORDER},
}


# Requests are spread over the engine's tiers; the soak caps the "free" tier's context so that
# a few requests are rejected at admission (with the reason) while the rest are served.
TIER_MIX = {"free": 1.0, "pro": 2.0, "enterprise": 1.0}
FREE_TIER_PERCENTILE = 0.9


def rss_kib() -> int:
    """Resident set size of this process in KiB (VmRSS from /proc/self/status; 0 if unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass(slots=True)
class SoakRequest:
    request_id: str
    prompt: str
    max_tokens: int
    arrival_step: int
    scenario: str
    tier: str | None = None

    def params(self, with_tier: bool = True) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, tier=self.tier if with_tier else None)


def build_requests(n: int, seed: int = 0, profile: str = "small", arrivals_per_step: float = 0.6) -> list[SoakRequest]:
    """n requests mixed from the three scenarios (about a third each; the mixed scenario tops
    up when release-freeze conversations end early), interleaved by their relative arrival time,
    with a bursty step-count arrival schedule (mean ``arrivals_per_step`` per step)."""
    if not isinstance(n, int) or not 3 <= n <= 10_000:
        raise ValueError(f"requests must be an integer in [3, 10000], got {n!r}")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {tuple(PROFILES)}, got {profile!r}")
    params = {k: dict(v, tiers=TIER_MIX) for k, v in PROFILES[profile].items()}
    third = n // 3
    parts = {
        "release-freeze": make_workload("release-freeze", third, seed, **params["release-freeze"]),
        "shared-system-prompt": make_workload(
            "shared-system-prompt", third, seed + 1, **params["shared-system-prompt"]
        ),
    }
    parts["mixed"] = make_workload("mixed", n - sum(len(v) for v in parts.values()), seed + 2, **params["mixed"])
    merged = []
    for si, name in enumerate(SCENARIO_ORDER):
        reqs = parts[name]
        span = max((r.arrival_s for r in reqs), default=0.0) or 1.0
        for i, r in enumerate(reqs):
            frac = r.arrival_s / span if r.arrival_s else i / max(1, len(reqs))
            merged.append((frac, si, i, name, r))
    merged.sort(key=lambda t: t[:3])
    rng = random.Random(seed * 7919 + 17)
    out, step = [], 0
    i = 0
    while i < len(merged):
        burst = rng.choice((1, 1, 1, 2, 3)) if rng.random() > 0.08 else rng.randint(6, 16)
        for _ in range(min(burst, len(merged) - i)):
            _, _, _, name, r = merged[i]
            out.append(SoakRequest(r.request_id, r.prompt, r.max_tokens, step, name, r.tier))
            i += 1
        step += max(1, round(rng.expovariate(arrivals_per_step / 1.9)))
    return out


@dataclass
class SoakReport:
    model: str
    mode: str
    seed: int
    requests: int
    outcomes: dict = field(default_factory=dict)  # finished / aborted / rejected / error
    finish_reasons: dict = field(default_factory=dict)
    steps: int = 0
    invariant_checks: int = 0
    preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swap_full_fallbacks: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    evictions: int = 0
    evicted_then_finished: int = 0
    harmless_aborts: int = 0
    prefix_hit_rate: float = 0.0
    compared: int = 0
    mismatches: int = 0
    partial_prefix_checked: int = 0
    peak_demand_blocks: int = 0
    budget_blocks: int = 0
    swap_blocks: int = 0
    block_size: int = 0
    max_request_blocks: int = 0
    end_free_blocks: int = 0
    end_cached_free_blocks: int = 0
    end_swap_used: int = 0
    rss_kib_start: int = 0
    rss_kib_end: int = 0
    rss_kib_max: int = 0
    rss_samples: list = field(default_factory=list)
    event_ring_len: int = 0
    event_ring_maxlen: int = 0
    events_seen: int = 0
    seconds: float = 0.0
    reference_seconds: float = 0.0
    problems: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        o = self.outcomes
        lines = [
            f"soak {self.model} mode={self.mode} seed={self.seed}: {self.requests} requests in {self.steps} steps "
            f"({self.seconds:.1f} s; reference run {self.reference_seconds:.1f} s)",
            f"  outcomes: finished {o.get('finished', 0)}, aborted {o.get('aborted', 0)}, "
            f"rejected {o.get('rejected', 0)}, error {o.get('error', 0)}, lost {o.get('lost', 0)}",
            f"  KV budget {self.budget_blocks} blocks x {self.block_size} tokens = "
            f"{self.budget_blocks / max(1, self.peak_demand_blocks):.2f} of the unconstrained peak "
            f"({self.peak_demand_blocks} blocks); largest request {self.max_request_blocks} blocks; "
            f"swap space {self.swap_blocks} blocks",
            f"  preemptions {self.preemptions} (recompute {self.preemptions_recompute}, swap {self.preemptions_swap}, "
            f"swap-full fallbacks {self.swap_full_fallbacks}); swaps out/in {self.swap_outs}/{self.swap_ins}; "
            f"manual evictions {self.evictions} ({self.evicted_then_finished} finished afterwards); "
            f"harmless aborts of unknown/finished ids {self.harmless_aborts}; "
            f"prefix hit rate {self.prefix_hit_rate:.1%}",
            f"  greedy outputs vs unconstrained run: {self.compared} compared, {self.mismatches} differ; "
            f"{self.partial_prefix_checked} aborted partial outputs checked as prefixes",
            f"  invariant checks passed: {self.invariant_checks}; at the end: {self.end_free_blocks} free + "
            f"{self.end_cached_free_blocks} cached-free of {self.budget_blocks} blocks, swap used {self.end_swap_used}",
            f"  RSS start {self.rss_kib_start / 1024:.1f} MiB, end {self.rss_kib_end / 1024:.1f} MiB, "
            f"max {self.rss_kib_max / 1024:.1f} MiB; event ring {self.event_ring_len}/{self.event_ring_maxlen} "
            f"({self.events_seen} events read)",
            "  PASS" if not self.problems else "  FAIL:\n    " + "\n    ".join(self.problems[:20]),
        ]
        return "\n".join(lines)


_NEEDS_REASON = (
    EventKind.PREEMPT,
    EventKind.EVICT,
    EventKind.REJECT,
    EventKind.ABORT,
    EventKind.ERROR,
    EventKind.SWAP_OUT,
    EventKind.SWAP_IN,
    EventKind.BLOCK_FREE,
)


def _drain_events(eng, last_seq: int, report: SoakReport, problems: list) -> int:
    evs = eng.events.since(last_seq)
    if evs and evs[0].seq != last_seq + 1:
        problems.append(f"events {last_seq + 1}..{evs[0].seq - 1} dropped from the ring before they were read")
    for e in evs:
        report.events_seen += 1
        reason = e.data.get("reason")
        if e.kind in _NEEDS_REASON and not (isinstance(reason, str) and reason):
            problems.append(f"{e.kind} event for {e.request_id} has no reason")
        if e.kind == EventKind.PREEMPT:
            report.preemptions += 1
            if e.data.get("mode") == "swap":
                report.preemptions_swap += 1
            else:
                report.preemptions_recompute += 1
            if "swap space full" in (reason or ""):
                report.swap_full_fallbacks += 1
        elif e.kind == EventKind.SWAP_OUT:
            report.swap_outs += 1
        elif e.kind == EventKind.SWAP_IN:
            report.swap_ins += 1
    return evs[-1].seq if evs else last_seq


def reference_run(
    requests: list[SoakRequest],
    model: str,
    block_size: int,
    max_model_len: int,
    device: str = "auto",
    max_num_seqs: int = 64,
    num_threads: int | None = None,
):
    """Greedy outputs of the requests on an engine that never runs short of KV memory (pool =
    max_num_seqs x the largest request; prefix caching off), with the same arrival schedule.
    Returns (token ids per request id, peak blocks in use, the engine)."""
    from engine.core.engine import LLMEngine
    from engine.model.models import load_model

    tokenizer = load_model(model, device)[1]
    tok_counts = {r.request_id: len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests}
    largest = max(cdiv(min(tok_counts[r.request_id] + r.max_tokens, max_model_len), block_size) for r in requests)
    eng = LLMEngine(
        EngineConfig(
            model=model,
            device=device,
            block_size=block_size,
            max_model_len=max_model_len,
            num_kv_blocks=max_num_seqs * largest,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2048, max_model_len),
            enable_prefix_caching=False,
            num_threads=num_threads,
        )
    )
    outs: dict[str, list[int]] = {}
    peak = 0
    i, step = 0, 0
    while i < len(requests) or eng.has_unfinished_requests():
        while i < len(requests) and requests[i].arrival_step <= step:
            r = requests[i]
            try:
                eng.add_request(r.request_id, r.prompt, r.params(with_tier=False))
            except ValueError:
                pass
            i += 1
        if not eng.has_unfinished_requests() and i < len(requests):
            step = requests[i].arrival_step
            continue
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        peak = max(peak, eng.bm.num_used_blocks)
        if eng.scheduler.num_preemptions:
            raise RuntimeError("reference run preempted a request: its pool is not unconstrained")
        step += 1
    return outs, peak, largest, tok_counts, eng


def run_soak(
    requests: list[SoakRequest],
    reference: dict[str, list[int]],
    *,
    model: str = "tiny",
    mode: str = "recompute",
    seed: int = 0,
    block_size: int = 8,
    budget_blocks: int,
    swap_blocks: int = 0,
    bytes_per_block: int = 0,
    max_model_len: int = 512,
    device: str = "auto",
    abort_prob: float = 0.03,
    evict_prob: float = 0.05,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    num_threads: int | None = None,
    free_tier_cap: int | None = None,
    rss_every: int = 200,
    snapshot_every: int = 50,
    log=None,
) -> SoakReport:
    """One constrained soak run over ``requests`` (see the module docstring); compares finished
    outputs with ``reference`` (request id -> greedy token ids)."""
    from engine.core.engine import LLMEngine

    rng = random.Random(seed * 31 + (1 if mode == "swap" else 0))
    tiers = default_tiers()
    if free_tier_cap is not None:
        tiers["free"] = TierConfig("free", max_context=free_tier_cap, priority=tiers["free"].priority)
    cfg = EngineConfig(
        tiers=tiers,
        model=model,
        device=device,
        block_size=block_size,
        num_kv_blocks=budget_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=True,
        preemption_mode=mode,
        swap_space_bytes=swap_blocks * bytes_per_block if mode == "swap" else 0,
        num_threads=num_threads,
    )
    eng = LLMEngine(cfg)
    rep = SoakReport(
        model,
        mode,
        seed,
        len(requests),
        budget_blocks=budget_blocks,
        block_size=block_size,
        swap_blocks=eng.bm.num_swap_blocks,
    )
    problems = rep.problems
    outcome: dict[str, str] = {}
    final: dict[str, list[int]] = {}
    partial: dict[str, list[int]] = {}
    evicted: set[str] = set()
    finish_reasons: dict[str, int] = {}
    gc.collect()
    rep.rss_kib_start = rss_kib()
    rep.rss_samples.append((0, rep.rss_kib_start))
    last_seq = 0
    t0 = time.perf_counter()
    i, step, idle_steps = 0, 0, 0
    all_ids = [r.request_id for r in requests]

    def settle(rid: str, kind: str) -> None:
        if rid in outcome:
            problems.append(f"{rid} ended twice ({outcome[rid]}, then {kind})")
        outcome[rid] = kind

    while i < len(requests) or eng.has_unfinished_requests():
        while i < len(requests) and requests[i].arrival_step <= step:
            r = requests[i]
            try:
                eng.add_request(r.request_id, r.prompt, r.params())
            except ValueError as e:
                if not str(e):
                    problems.append(f"{r.request_id} rejected without a reason")
                settle(r.request_id, "rejected")
            i += 1
        if not eng.has_unfinished_requests():
            if i < len(requests):
                step = requests[i].arrival_step
            continue
        # ---- client actions between steps
        if eng.requests and rng.random() < abort_prob:
            live = list(eng.requests.values())
            victim = rng.choice(live)
            rid = victim.request_id
            partial[rid] = list(victim.output_token_ids)
            if not eng.abort_request(rid):
                problems.append(f"abort of live request {rid} returned False")
            settle(rid, "aborted")
        if eng.scheduler.running and rng.random() < evict_prob:
            victim = rng.choice(eng.scheduler.running)
            try:
                eng.evict(victim.request_id)
                rep.evictions += 1
                evicted.add(victim.request_id)
            except ValueError as e:
                problems.append(f"evict of running {victim.request_id} failed: {e}")
        if rng.random() < 0.02:
            ghost = rng.choice((f"no-such-request-{step}", rng.choice(all_ids[: max(1, i)])))
            if ghost not in eng.requests:
                if eng.abort_request(ghost):
                    problems.append(f"abort of unknown/finished id {ghost} returned True")
                rep.harmless_aborts += 1
        # ---- one step
        outs = eng.step()
        step += 1
        rep.steps += 1
        progressed = False
        for o in outs:
            progressed = True
            if o.finished:
                reason = o.outputs[0].finish_reason
                finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
                if reason in ("length", "stop"):
                    settle(o.request_id, "finished")
                    final[o.request_id] = list(o.outputs[0].token_ids)
                    if o.request_id in evicted:
                        rep.evicted_then_finished += 1
                else:
                    settle(o.request_id, "error")
                    problems.append(f"{o.request_id} failed: {o.error or reason}")
        try:
            eng.check_invariants()
            rep.invariant_checks += 1
        except AssertionError as e:
            problems.append(f"invariant broken after step {eng.step_num}: {e}")
            break
        if rep.steps % 16 == 0:  # the ring holds thousands of events: reading every 16 steps loses none
            last_seq = _drain_events(eng, last_seq, rep, problems)
        if snapshot_every and rep.steps % snapshot_every == 0:
            eng.snapshot()
        if rss_every and rep.steps % rss_every == 0:
            rep.rss_samples.append((rep.steps, rss_kib()))
        idle_steps = 0 if progressed else idle_steps + 1
        if idle_steps > 1000:
            problems.append(
                f"no progress for 1000 steps at step {eng.step_num}: livelock "
                f"(waiting {len(eng.scheduler.waiting)}, running {len(eng.scheduler.running)}, "
                f"swapped {len(eng.scheduler.swapped)})"
            )
            break
        if log is not None and rep.steps % 500 == 0:
            log(
                f"  [{mode}] step {rep.steps}: {len(outcome)}/{len(requests)} settled, "
                f"{rep.preemptions} preemptions, RSS {rss_kib() / 1024:.1f} MiB"
            )
    rep.seconds = time.perf_counter() - t0
    last_seq = _drain_events(eng, last_seq, rep, problems)

    # ---- every request ended exactly once, with a reason
    for rid in all_ids:
        if rid not in outcome:
            problems.append(f"{rid} was lost (never finished, aborted or rejected)")
            outcome[rid] = "lost"
    counts: dict[str, int] = {}
    for k in outcome.values():
        counts[k] = counts.get(k, 0) + 1
    rep.outcomes = counts
    rep.finish_reasons = finish_reasons
    # ---- outputs vs the unconstrained run
    for rid, toks in final.items():
        ref = reference.get(rid)
        if ref is None:
            continue
        rep.compared += 1
        if toks != ref:
            rep.mismatches += 1
            if rep.mismatches <= 5:
                j = next((k for k, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
                problems.append(f"{rid}: output differs from the unconstrained run at token {j}")
    for rid, toks in partial.items():
        ref = reference.get(rid)
        if ref is not None:
            rep.partial_prefix_checked += 1
            if toks != ref[: len(toks)]:
                problems.append(f"{rid}: aborted partial output is not a prefix of the unconstrained output")
    # ---- end state: nothing owned, swap empty
    bm = eng.bm
    if eng.has_unfinished_requests() or eng.requests:
        problems.append(f"engine still holds {len(eng.requests)} requests at the end")
    if bm.request_ids():
        problems.append(f"block tables left at the end: {sorted(bm.request_ids())[:5]}")
    if bm.num_used_blocks:
        problems.append(f"{bm.num_used_blocks} blocks still owned (neither free nor cached-free) at the end")
    rep.end_cached_free_blocks = bm.num_cached_free_blocks
    rep.end_free_blocks = bm.num_free_blocks - rep.end_cached_free_blocks
    rep.end_swap_used = bm.num_swap_used
    if bm.num_swap_used or not bm.is_empty:
        problems.append(f"swap space not empty at the end: {bm.num_swap_used} slots used")
    if mode == "swap" and rep.swap_full_fallbacks == 0 and rep.preemptions:
        problems.append("swap mode never hit the swap-full fallback (swap space too large for this run?)")
    q, h = bm.prefix_queries, bm.prefix_hits
    rep.prefix_hit_rate = prefix_hit_rate(h, q)
    rep.event_ring_len = len(eng.events)
    rep.event_ring_maxlen = eng.events.maxlen
    del eng
    gc.collect()
    rep.rss_kib_end = rss_kib()
    rep.rss_samples.append((rep.steps, rep.rss_kib_end))
    rep.rss_kib_max = max(v for _, v in rep.rss_samples)
    return rep
