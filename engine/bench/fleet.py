"""The fleet suite: 3 kvscope servers behind vllm-router (engine/fleet/), the release-freeze
workload through the gateway under round_robin, kv_aware and cache_aware, one after the other on
cleared caches: fleet prefix hit rate (cached / prompt tokens, from each response's
cached_tokens), TTFT p50 / p99 (client side, streamed), output tokens/s, duplicated blocks (held
on more than one instance at the end, from the instances' KV events). Also writes the run as a
FleetTrace (fleet-trace-<stamp>.json) with the offline what-if replays, labelled as replays."""

from __future__ import annotations

import os
import random
import tempfile
import time

from engine.bench import common as C
from engine.bench.common import SuiteResult
from engine.bench.report import BenchUnavailable, bar_figure

POLICIES = ("round_robin", "kv_aware", "cache_aware")


def free_base_port(span: int = 302, tries: int = 50) -> int:
    """A base port whose fleet ports (base+0..2, +100.., +200.., +300, +301) are all free."""
    from engine.fleet import launcher

    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - span)
        ports = [base + k for k in (0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203, 300, 301)]
        if not any(launcher.port_in_use(p) for p in ports):
            return base
    raise BenchUnavailable("no free range of ports for the fleet on 127.0.0.1")


def run_fleet_bench(
    *,
    model: str,
    n_instances: int,
    n_requests: int,
    num_blocks: int,
    concurrency: int,
    output_median: int,
    seed: int = 0,
    policies=POLICIES,
):
    """Start a fleet, run the policies, stop the fleet; returns the engine.fleet.runs.Session."""
    from engine.fleet import launcher, runs, workload

    try:
        launcher.router_binary()
    except launcher.FleetError as e:
        raise BenchUnavailable(str(e)) from None
    state = tempfile.mkdtemp(prefix="kvscope-fleet-bench-")
    fleet = launcher.plan(
        n_instances,
        policy=policies[0],
        model=model,
        base_port=free_base_port(),
        num_blocks=num_blocks,
        state_dir=state,
    )
    reqs = workload.release_freeze(
        n_requests,
        seed,
        turns=4,
        output_median=output_median,
        output_min=max(1, output_median // 4),
        output_max=output_median * 3,
    )
    fleet = launcher.up(fleet, timeout_s=600)
    try:
        return runs.compare_policies(fleet, list(policies), reqs, concurrency=concurrency)
    finally:
        launcher.down(state)


def suite_fleet(ctx: C.BenchContext) -> SuiteResult:
    from engine.fleet.state import FleetTrace

    res = SuiteResult()
    model = "tiny" if ctx.quick else ctx.model
    n_inst = 3
    n_req = ctx.pick(48, 24, smoke=8)
    ctx.start("fleet up + policies")
    sess = run_fleet_bench(
        model=model,
        n_instances=n_inst,
        n_requests=n_req,
        num_blocks=ctx.pick(256, 128, smoke=128),
        concurrency=ctx.pick(4, 4, smoke=2),
        output_median=ctx.pick(32, 16, smoke=4),
    )
    ctx.done("fleet up + policies")
    ctx.start("summaries")
    res.add("fleet_model", model, f"{n_inst} kvscope servers behind vllm-router, 1 torch thread each")
    res.add("fleet_requests", n_req, "release-freeze requests per policy (closed loop, 4 conversations at a time)")
    by = {}
    for r in sess.runs:
        by[r.policy] = r
        p = r.policy
        res.add(f"{p}_hit_rate", r.fleet_hit_rate, f"{p}: cached / prompt tokens over the run")
        res.add(f"{p}_ttft_p50_s", r.ttft_p50_s, f"{p}: TTFT p50 (client, streamed)")
        res.add(f"{p}_ttft_p99_s", r.ttft_p99_s, f"{p}: TTFT p99")
        res.add(f"{p}_output_tok_s", r.output_tok_s, f"{p}: output tokens / wall seconds")
        res.add(f"{p}_duplicated_blocks", r.duplicated_blocks, f"{p}: blocks held on 2+ instances at the end")
        res.add(f"{p}_errors", r.errors, f"{p}: failed requests", row=r.errors > 0)
        res.add(f"{p}_landed_on_best", r.landed_on_best, f"{p}: share of requests sent to a best holder")
        res.add(f"{p}_per_instance", r.per_instance_requests, "", row=False)
    for w in sess.whatif:
        res.add(f"replay_{w.rule}_hit_rate", w.hit_rate, f"REPLAY (not measured): {w.note}")
    rated = {p: r.fleet_hit_rate for p, r in by.items() if r.fleet_hit_rate is not None}
    if not rated:
        raise BenchUnavailable("no policy completed a request")
    best = max(rated, key=rated.get)
    res.add("best_policy", best, "the policy with the highest fleet hit rate")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = os.path.join(ctx.out_dir, f"fleet-trace-{stamp}.json")
    os.makedirs(ctx.out_dir, exist_ok=True)
    trace: FleetTrace = sess.trace({"suite": "fleet", "model": model, "instances": n_inst, "quick": ctx.quick})
    trace.save(path)
    ctx.files.append(path)
    res.figures.append(
        (
            "hit_rate",
            bar_figure(
                "Fleet prefix hit rate by routing policy (release-freeze, 3 servers)",
                list(rated),
                [rated[p] for p in rated],
                "cached / prompt tokens",
            ),
        )
    )
    ctx.done("summaries")
    return res
