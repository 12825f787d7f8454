"""The fleet suite: 3 kvscope servers behind vllm-router (engine/fleet/), the release-freeze
workload through the gateway under round_robin, kv_aware and cache_aware, one after the other on
cleared caches: fleet prefix hit rate (cached / prompt tokens, from each response's
cached_tokens), TTFT p50 / p99 (client side, streamed), output tokens/s, duplicated blocks (held
on more than one instance at the end, from the instances' KV events). Also writes the run as a
FleetTrace (fleet-trace-<stamp>.json) with the offline what-if replays, labelled as replays."""

from __future__ import annotations

import os
import time

from engine.bench import common as C
from engine.bench.common import SuiteResult
from engine.bench.report import BenchUnavailable, bar_figure

POLICIES = ("round_robin", "kv_aware", "cache_aware")


def suite_fleet(ctx: C.BenchContext) -> SuiteResult:
    from engine.fleet.state import FleetTrace

    res = SuiteResult()
    model = "tiny" if ctx.quick else ctx.model
    n_inst = 3
    n_req = ctx.pick(48, 24, smoke=8)
    ctx.start("fleet up + policies")
    from engine.fleet import launcher, runs

    try:
        launcher.router_binary()
    except launcher.FleetError as e:
        raise BenchUnavailable(str(e)) from None
    try:
        base = runs.free_base_port(n_inst)
    except launcher.FleetError as e:
        raise BenchUnavailable(str(e)) from None
    sess = runs.run_session(
        base_port=base,
        model=model,
        n_instances=n_inst,
        n_requests=n_req,
        num_blocks=ctx.pick(256, 128, smoke=128),
        concurrency=ctx.pick(4, 4, smoke=2),
        output_median=ctx.pick(32, 16, smoke=4),
        policies=POLICIES,
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
