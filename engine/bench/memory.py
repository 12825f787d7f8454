"""The memory suite: paged vs contiguous allocation on the release-freeze workload."""

from __future__ import annotations

import time

from engine.bench import common as C
from engine.bench.common import SuiteResult
from engine.bench.report import BenchUnavailable, line_figure
from engine.lab import prompt_sets as PS
from engine.observe import recording


def _drive(eng, arrivals, on_step):
    """recording.drive with the final token ids of each request; on_step(step index from 0)."""
    outputs = {}

    def after(n, outs, _dt):
        for o in outs:
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        on_step(n - 1)

    return outputs, recording.drive(eng, arrivals, on_step=after, max_idle_steps=2000)


def suite_memory(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, EngineConfig = C.require_engine()
    res = SuiteResult()
    ctx.start("load tokenizer")
    tok = ctx.tokenizer()
    ctx.done("tokenizer")
    work, max_len = PS.release_freeze_workload(tok, ctx.quick)
    if ctx.smoke:
        work, max_len = [(a, ids[:20], 4) for a, ids, _ in work[:4]], 64
    n = len(work)
    slabs, bs = 4, 16
    blocks = slabs * max_len // bs
    res.add(
        "workload",
        f"release-freeze: {n} requests (growing conversations), {min(len(w[1]) for w in work)}-"
        f"{max(len(w[1]) for w in work)} prompt tokens, arrivals over {max(w[0] for w in work)} steps",
        "",
        row=False,
    )
    res.add("kv_budget_tokens", blocks * bs, f"{blocks} blocks of {bs} = {slabs} slabs of max_model_len {max_len}")
    stats, outs = {}, {}
    for alloc in ("paged", "contiguous"):
        ctx.start(f"{alloc} allocator")
        llm = C.make_llm(
            ctx,
            allocator=alloc,
            num_kv_blocks=blocks,
            block_size=bs,
            max_model_len=max_len,
            max_num_seqs=n,
            enable_prefix_caching=False,
        )
        try:
            eng = llm.engine
            acc = {"alloc": 0, "fill": 0, "max_running": 0, "max_gap": 0, "series": [], "alloc_name": None}

            def on_step(step, eng=eng, acc=acc):
                snap = eng.snapshot()
                m = snap.metrics
                acc["alloc"] += m.slots_allocated
                acc["fill"] += m.slots_filled
                acc["max_running"] = max(acc["max_running"], m.num_running)
                acc["alloc_name"] = snap.info.allocator
                for r in snap.requests:
                    if r.state == "running":
                        acc["max_gap"] = max(acc["max_gap"], r.slots_allocated - r.num_computed_tokens)
                if m.slots_allocated:
                    acc["series"].append(m.waste_fraction)

            arrivals = [(a, f"conv-{i}", ids, C.greedy(SamplingParams, mt)) for i, (a, ids, mt) in enumerate(work)]
            t0 = time.perf_counter()
            outs[alloc], steps = _drive(eng, arrivals, on_step)
            acc["wall"] = time.perf_counter() - t0
            acc["steps"] = steps
        finally:
            C.free_llm(llm)
        if acc["alloc_name"] != alloc:
            raise BenchUnavailable(f"engine ran allocator {acc['alloc_name']!r} when asked for {alloc!r}")
        stats[alloc] = acc
        ctx.done(f"{alloc} allocator")
    if stats["contiguous"]["max_gap"] < max_len // 2:
        raise BenchUnavailable(
            "allocator='contiguous' accepted but no running request ever held a reserved slab "
            f"(largest reserved-but-unfilled gap {stats['contiguous']['max_gap']} slots)"
        )
    for alloc in ("paged", "contiguous"):
        s = stats[alloc]
        waste = 1 - s["fill"] / s["alloc"] if s["alloc"] else None
        res.add(f"{alloc}_waste", waste, f"1 - filled/allocated slot-steps over {s['steps']} steps (time-averaged)")
        res.add(f"{alloc}_max_concurrency", s["max_running"], "most requests running in one step")
        res.add(f"{alloc}_wall_s", s["wall"], "", row=not ctx.quick)
    res.add(
        "outputs_match",
        outs["paged"] == outs["contiguous"] and len(outs["paged"]) == n,
        "greedy tokens identical on both allocators, every request finished",
    )
    res.figures.append(
        (
            "memory_waste",
            line_figure(
                "KV waste per step (fraction of allocated slots not holding a token)",
                {a: (list(range(len(stats[a]["series"]))), stats[a]["series"]) for a in stats},
                "step (with KV allocated)",
                "waste fraction",
            ),
        )
    )
    return res
