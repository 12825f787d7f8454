"""The benchmark suites. Each takes a BenchContext and returns a SuiteResult (JSON fields, table
rows, figures). A suite that needs a missing engine feature raises BenchUnavailable."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import common as C
from . import peers
from . import roofline as R
from .report import BenchUnavailable, bar_figure, line_figure


@dataclass
class SuiteResult:
    fields: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)      # (name, value, note)
    figures: list = field(default_factory=list)   # (file stem, plotly figure)

    def add(self, name, value, note: str = "", row: bool = True):
        self.fields[name] = value
        if row:
            self.rows.append((name, value, note))


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _spread(items: list, k: int) -> list[int]:
    """Indices of k items spread evenly over the items sorted by length (a representative subset)."""
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    if k >= len(items):
        return list(range(len(items)))
    return sorted(order[round(j * (len(items) - 1) / (k - 1))] for j in range(k)) if k > 1 else [order[len(order) // 2]]


# ---------------------------------------------------------------------------- kvscope on a workload

def kvscope_workload(ctx: C.BenchContext, prompts: list[list[int]], new_tokens: int, tag: str):
    """kvscope on a batch workload (all requests submitted at once via LLM.generate).
    Returns (token lists, wall seconds, engine info dict). Cached per (tag, size) in the context."""
    cache = ctx.__dict__.setdefault("_kv_runs", {})
    key = (tag, len(prompts), new_tokens)
    if key in cache:
        return cache[key]
    LLM, SamplingParams, _ = C.require_engine()
    llm = C.make_llm(ctx, max_num_seqs=max(len(prompts), 1),
                     num_kv_blocks=C.blocks_for([len(p) for p in prompts], new_tokens),
                     max_model_len=max(2048, max(len(p) for p in prompts) + new_tokens + 16))
    try:
        C.warm_up(llm, SamplingParams, prompts[0])
        outs, wall = C.timed_generate(llm, prompts, C.greedy(SamplingParams, new_tokens))
        toks = [C.token_ids_of(o) for o in outs]
        info = {}
        try:
            snap = llm.engine.snapshot()
            info = {"dtype": snap.info.dtype, "block_size": snap.info.block_size,
                    "max_num_batched_tokens": snap.info.max_num_batched_tokens,
                    "num_blocks": snap.info.num_blocks}
        except Exception:
            pass
    finally:
        C.free_llm(llm)
    cache[key] = (toks, wall, info)
    return cache[key]


# ---------------------------------------------------------------------------- throughput

def suite_throughput(ctx: C.BenchContext) -> SuiteResult:
    C.require_engine()
    res = SuiteResult()
    new = ctx.pick(64, 64, smoke=8)
    nreq = ctx.pick(16, 16, smoke=4)
    ctx.start("load model + W16 prompts")
    model, tok = ctx.hf()
    prompts, source = C.chat_prompts(tok, nreq, seed=0, min_tokens=30, max_tokens=300)
    ctx.done("W16 ready")
    lens = [len(p) for p in prompts]
    res.add("workload", f"W{nreq}: {nreq} chat prompts, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / nreq:.0f}), "
            f"{new} new tokens each, greedy, ignore_eos", source, row=False)
    n_gen = nreq * new

    ctx.start("kvscope W16")
    k_toks, k_wall, info = kvscope_workload(ctx, prompts, new, "W16")
    kv_tok_s = sum(len(t) for t in k_toks) / k_wall
    res.add("kvscope_tok_s", kv_tok_s, f"W{nreq}, {sum(len(t) for t in k_toks)} tokens in {k_wall:.1f} s")
    ctx.done("kvscope W16")

    seq_idx = _spread(prompts, ctx.pick(16, 4, smoke=nreq))
    ctx.start(f"transformers sequential ({len(seq_idx)} requests)")
    peers.hf_sequential(model, tok, [prompts[0][:8]], 2)  # warm-up
    s_toks, s_wall = peers.hf_sequential(model, tok, [prompts[i] for i in seq_idx], new)
    seq_tok_s = sum(len(t) for t in s_toks) / s_wall
    res.add("hf_seq_tok_s", seq_tok_s, f"model.generate one at a time, {len(seq_idx)} of {nreq} requests"
            + (" (--quick: length-spread subset)" if len(seq_idx) < nreq else ""))
    ctx.done("transformers sequential")

    ctx.start("transformers static batch")
    peers.hf_static(model, tok, [prompts[0][:8], prompts[1][:6]], 2)  # warm-up
    st_toks, st_wall = peers.hf_static(model, tok, prompts, new)
    st_tok_s = n_gen / st_wall
    res.add("hf_static_tok_s", st_tok_s, f"one left-padded batch of {nreq}")
    ctx.done("transformers static batch")

    ctx.start("transformers generate_batch")
    try:
        cb_toks, cb_wall, cb_info = peers.hf_continuous_batching(model, tok, prompts, new)
        cb_tok_s = sum(len(t) for t in cb_toks) / cb_wall if not cb_info["errors"] else None
        res.add("hf_cb_tok_s", cb_tok_s, f"model.generate_batch (sdpa, KV sized to {cb_info['num_blocks']} "
                f"blocks of {cb_info['page_size']})"
                + (f"; errors: {cb_info['errors']}" if cb_info["errors"] else ""))
    except Exception as e:
        cb_toks, cb_tok_s = None, None
        res.add("hf_cb_tok_s", None, f"generate_batch failed: {type(e).__name__}: {str(e)[:120]}")
    ctx.done("transformers generate_batch")

    # the machine's compute roof for this very workload, so the speedups can be read against the
    # most any engine could reach here (every FLOP of W16, prefill included, at the best matmul rate)
    ctx.start("compute roof for W16")
    import torch
    dt = getattr(torch, ctx.dtype())
    shape = R.ModelShape.from_config(model.config)
    roof_rows = ctx.pick((256, 512), (256, 512), smoke=(16,))
    mm, _ = R.measure_best_matmuls(shape, rows=roof_rows, dtype=dt, min_time=ctx.pick(0.3, 0.2, smoke=0.01))
    peak_m = max(mm, key=lambda m: mm[m]["all_gflops"])
    roof = R.compute_roof(shape, mm[peak_m]["all_gflops"], lens, new)["compute_roof_tok_s"]
    res.add("compute_roof_w16_tok_s", roof, f"W{nreq} FLOPs at {mm[peak_m]['all_gflops']:.0f} GFLOP/s "
            f"(M={peak_m}, {mm[peak_m]['kernel']} kernel); the roofline suite measures it next to its own run")
    res.add("roof_over_hf_static", _ratio(roof, st_tok_s), "compute roof / static batch: the largest speedup "
            "over the static batch this machine allows")
    ctx.done("compute roof")

    res.add("speedup_vs_hf_seq", _ratio(kv_tok_s, seq_tok_s), "kvscope / sequential")
    res.add("speedup_vs_hf_static", _ratio(kv_tok_s, st_tok_s), "kvscope / static batch (target >= 5)")
    res.add("speedup_vs_hf_cb", _ratio(kv_tok_s, cb_tok_s), "kvscope / generate_batch")

    mm = C.mismatches([k_toks[i] for i in seq_idx], s_toks)
    for m in mm:
        if m.get("request") is not None:
            m["request"] = seq_idx[m["request"]]
    res.add("outputs_match", not mm, f"kvscope vs transformers sequential greedy, token for token, "
            f"{len(seq_idx)} requests x {new} tokens")
    res.add("mismatches", mm, "", row=bool(mm))
    st_mm = C.mismatches(k_toks, st_toks)
    res.add("hf_static_outputs_match", not st_mm,
            "static batch vs kvscope (padding changes fp32 rounding; informational)")
    if cb_toks is not None:
        res.add("hf_cb_outputs_match", not C.mismatches(k_toks, cb_toks), "generate_batch vs kvscope (informational)")

    if ctx.quick:
        ctx.note("throughput --quick: W64 skipped; transformers sequential timed on a 4-request length-spread subset")
    else:
        ctx.start("W64 prompts + kvscope W64")
        p64, _ = C.chat_prompts(tok, 64, seed=1, min_tokens=30, max_tokens=300)
        k64, k64_wall, _ = kvscope_workload(ctx, p64, new, "W64")
        kv64 = sum(len(t) for t in k64) / k64_wall
        res.add("kvscope_w64_tok_s", kv64, "W64 (64 requests)")
        ctx.done("kvscope W64")
        ctx.start("transformers static batch W64")
        st64, st64_wall = peers.hf_static(model, tok, p64, new)
        res.add("hf_static_w64_tok_s", 64 * new / st64_wall, "one left-padded batch of 64")
        res.add("speedup_vs_hf_static_w64", _ratio(kv64, 64 * new / st64_wall), "")
        ctx.done("transformers static W64")

    res.add("kvscope_dtype", info.get("dtype", ctx.dtype()), "", row=False)
    res.add("kvscope_max_num_batched_tokens", info.get("max_num_batched_tokens"), "", row=False)
    labels = ["kvscope", "hf sequential", "hf static", "hf generate_batch"]
    vals = [kv_tok_s, seq_tok_s, st_tok_s, cb_tok_s or 0.0]
    res.figures.append(("throughput_w16", bar_figure("W16 throughput (generated tokens / s)", labels, vals,
                                                    "tokens / s", note=f"{ctx.model}, {ctx.dtype()}, "
                                                    f"torch threads {C.torch_threads()}")))
    return res


# ---------------------------------------------------------------------------- roofline

def _shape_of(model) -> R.ModelShape:
    return R.ModelShape.from_config(model.config)


def suite_roofline(ctx: C.BenchContext) -> SuiteResult:
    import torch
    C.require_engine()
    res = SuiteResult()
    ctx.start("load model")
    model, tok = ctx.hf()
    shape = _shape_of(model)
    dt = getattr(torch, ctx.dtype())
    dbytes = torch.tensor([], dtype=dt).element_size()
    ctx.done("model")

    # The roofs are measured right next to the kvscope runs they bound (matmul before and after
    # W16, bandwidth before and after batch-1 decode; best of each pair): on a shared machine the
    # CPU share changes minute to minute, and a roof from another moment is not a roof.
    # 512 rows: the engine's prefill chunks (max_num_batched_tokens) run there, so the roof must too
    rows = ctx.pick((1, 16, 64, 256, 512, 1024), (1, 16, 64, 256, 512), smoke=(1, 16))
    min_t = ctx.pick(0.5, 0.2, smoke=0.01)
    ctx.start(f"matmul GFLOP/s at M in {rows}")
    mm, by_kernel = R.measure_best_matmuls(shape, rows=rows, dtype=dt, min_time=min_t)
    ctx.done("matmul")

    ctx.start("kvscope W16")
    prompts, _ = C.chat_prompts(tok, ctx.pick(16, 16, smoke=4), seed=0, min_tokens=30, max_tokens=300)
    new = ctx.pick(64, 64, smoke=8)
    # best of two runs, as the roof is the best of two measurements (not reused from another suite)
    runs = [kvscope_workload(ctx, prompts, new, f"W16-roofline-{i}") for i in range(ctx.pick(2, 2, smoke=1))]
    k_toks, k_wall, _ = min(runs, key=lambda r: r[1])
    n_gen = sum(len(t) for t in k_toks)
    kv_tok_s = n_gen / k_wall
    ctx.done("kvscope W16")

    peak_m = max(mm, key=lambda m: mm[m]["all_gflops"])
    ctx.start(f"matmul again at M={peak_m}")
    again, _ = R.measure_best_matmuls(shape, rows=(peak_m,), dtype=dt, min_time=min_t)
    if again[peak_m]["all_gflops"] > mm[peak_m]["all_gflops"]:
        mm[peak_m] = again[peak_m]
    peak = mm[peak_m]["all_gflops"]
    for m in rows:
        res.add(f"matmul_gflops_m{m}", mm[m]["all_gflops"],
                f"{shape.layers} layers' q,k,v,o,gate,up,down + lm_head at {m} rows; {mm[m]['slab_ms']:.1f} ms per pass "
                f"({mm[m]['kernel']} kernel)")
    for name, per_m in by_kernel.items():
        for m in rows:
            res.add(f"matmul_{name}_gflops_m{m}", per_m[m]["all_gflops"], "", row=False)
    res.add("peak_matmul_gflops", peak, f"best of the above (M={peak_m}, {mm[peak_m]['kernel']} kernel, measured "
            f"before and after W16), {ctx.dtype()}")
    res.add("peak_matmul_kernel", mm[peak_m]["kernel"], "torch: F.linear per projection; packed: the engine's "
            "packed, merged Linears (engine/linear.py)", row=False)
    ctx.done("matmul again")

    lens = [len(p) for p in prompts]
    cr = R.compute_roof(shape, peak, lens, new)
    res.add("gflop_per_generated_token", cr["gflop_per_generated_token"],
            f"2 x {shape.linear_params() / 1e6:.1f} M matmul params + attention at mean prompt length")
    res.add("workload_gflop", cr["workload_gflop"], f"W16 with a KV cache: {sum(lens)} prompt + {n_gen} generated tokens")
    res.add("kvscope_tok_s", kv_tok_s, f"W16 generated tokens / s, best of {len(runs)} runs")
    res.add("kvscope_achieved_gflops", cr["workload_gflop"] / k_wall, "workload FLOPs / kvscope wall time")
    res.add("compute_roof_tok_s", cr["compute_roof_tok_s"],
            "generated tok/s if every FLOP of W16 (prefill included) ran at peak matmul rate")
    res.add("compute_roof_fraction", R.fraction(kv_tok_s, cr["compute_roof_tok_s"]), "= achieved / peak FLOP rate")
    res.add("compute_roof_naive_tok_s", cr["compute_roof_naive_tok_s"],
            "peak / FLOPs of one generated token (prompt tokens counted as free)")
    res.add("compute_roof_naive_fraction", R.fraction(kv_tok_s, cr["compute_roof_naive_tok_s"]), "")

    # batch-1 decode: one request alone, prefill excluded, with bandwidth measured around it
    LLM, SamplingParams, _ = C.require_engine()
    ctx.start("memory read bandwidth")
    bw_mb = ctx.pick(1024, 256, smoke=16)
    bw = R.measure_read_bandwidth(bw_mb, dtype=torch.float32)
    ctx.done("bandwidth")
    ctx.start("kvscope batch-1 decode")
    p1 = prompts[_spread(prompts, 1)[0]]
    n1 = ctx.pick(64, 32, smoke=6)
    by_fmt = R.decode_bs1_by_format(ctx, p1, n1, rounds=ctx.pick(3, 2, smoke=1))
    dec, dec32 = by_fmt["auto"]["tok_s"], by_fmt["fp32"]["tok_s"]
    ctx.done("kvscope bs1")

    bw = max(bw, R.measure_read_bandwidth(bw_mb, dtype=torch.float32))
    res.add("mem_bw_gb_s", bw, "torch.sum over a large fp32 tensor, best pass before/after bs1 decode (GB = 1e9 B)")
    ctx.start("transformers batch-1 decode")
    _, t1 = peers.hf_sequential(model, tok, [p1], 1)
    _, tn = peers.hf_sequential(model, tok, [p1], n1)
    hf_dec = (n1 - 1) / (tn - t1) if tn > t1 else None
    ctx.done("transformers bs1")

    ctxlen = len(p1) + n1 / 2
    mroof = R.memory_roof_tok_s(shape, bw, dbytes, ctxlen)
    read = by_fmt["auto"]["weight_bytes"]
    kv_step = shape.kv_bytes_per_token(dbytes) * ctxlen
    mroof_read = bw * 1e9 / (read + kv_step)
    res.add("weight_bytes", shape.weight_bytes(dbytes), f"matmul weights per decode step in {ctx.dtype()}", row=False)
    res.add("weight_format", by_fmt["auto"]["format"], "what the default engine's Linears read: 'gguf' = the "
            "file's quantized blocks (engine/csrc/quant_linear.c), 'fp32' = de-quantized copies")
    res.add("weight_bytes_read_per_step", read, f"weight bytes one decode step reads in that format "
            f"(fp32 copies: {by_fmt['fp32']['weight_bytes']})")
    res.add("kv_bytes_per_token", shape.kv_bytes_per_token(dbytes), "K+V, all layers")
    res.add("memory_roof_tok_s", mroof_read, f"bandwidth / (weight bytes read + KV of {ctxlen:.0f} tokens) per step")
    res.add("memory_roof_fp32_tok_s", mroof, "the same with fp32 weights", row=False)
    res.add("decode_bs1_tok_s", dec, f"kvscope, default weight format ({by_fmt['auto']['format']}), one request, "
            f"prompt {len(p1)} tokens, {n1} new, prefill excluded, best of {len(by_fmt['auto']['rates'])}")
    res.add("decode_bs1_fp32_tok_s", dec32, "the same request with weight_format='fp32', rounds alternating with "
            "the above in this process")
    res.add("decode_bs1_speedup_vs_fp32", R.fraction(dec, dec32), "target >= 3")
    res.add("memory_roof_fraction", R.fraction(dec, mroof_read), "against the bytes actually read; target >= 0.8")
    for f, name in (("auto", ""), ("fp32", "_fp32")):
        for key, unit in (("split_ms", "ms"), ("split_cpu_ms", "cpu_ms")):
            split = by_fmt[f].get(key)
            for part in ("step", "weights", "attention", "rest") if split else ():
                res.add(f"bs1{name}_{part}_{unit}", split[part], "" if part != "step" else
                        f"one timed decode run ({by_fmt[f]['format']}): {unit.replace('_', ' ')} per step in the "
                        "Linears (weights), the paged attention kernel and everything else", row=unit == "cpu_ms")
    res.add("hf_decode_bs1_tok_s", hf_dec, "transformers generate, same request, prefill excluded")
    gguf_path = None
    try:
        from engine.models import gguf_source
        gguf_path = gguf_source(C.load_hf_model(ctx.model, ctx.dtype())[0])
    except Exception:
        pass
    if gguf_path:
        ctx.start("llama.cpp batch-1 decode")
        lc = peers.llamacpp_decode_bs1(gguf_path, p1, n1, C.torch_threads(), reps=ctx.pick(3, 2, smoke=1))
        ctx.done("llama.cpp bs1")
        if "tok_s" in lc:
            res.add("llamacpp_decode_bs1_tok_s", lc["tok_s"], f"llama.cpp (llama-cpp-python {lc['version']}) on the "
                    f"same GGUF and request, {C.torch_threads()} threads, best of {len(lc['rates'])}, prefill excluded")
            res.add("decode_bs1_vs_llamacpp", R.fraction(dec, lc["tok_s"]), "target >= 1")
        else:
            ctx.note(f"llama.cpp peer not measured: {lc.get('why')}")

    if not ctx.quick and C.torch_threads() > 1:
        ctx.start("matmul at 1 thread")
        old = C.torch_threads()
        torch.set_num_threads(1)
        try:
            mm1 = R.measure_model_matmuls(shape, rows=(1, 64, 256), dtype=dt, min_time=0.3)
        finally:
            torch.set_num_threads(old)
        for m in (1, 64, 256):
            res.add(f"matmul_gflops_m{m}_1thread", mm1[m]["all_gflops"], "same pass with torch.set_num_threads(1)")
        ctx.done("1 thread")

    res.figures.append(("roofline_matmul", line_figure(
        f"Matmul GFLOP/s at the model's shapes ({ctx.dtype()}, {C.torch_threads()} threads)",
        {"all (body + lm_head)": (list(rows), [mm[m]["all_gflops"] for m in rows]),
         "decoder body": (list(rows), [mm[m]["body_gflops"] for m in rows]),
         "lm_head": (list(rows), [mm[m]["lm_head_gflops"] for m in rows])}, "rows (M)", "GFLOP/s")))
    res.figures.append(("roofline_vs_roofs", bar_figure(
        "kvscope vs the machine's roofs (tokens / s)",
        ["W16 kvscope", "W16 compute roof", "bs1 decode kvscope", "bs1 memory roof"],
        [kv_tok_s, cr["compute_roof_tok_s"] or 0, dec or 0, mroof], "tokens / s")))
    return res


# ---------------------------------------------------------------------------- memory

def release_freeze_workload(tok, quick: bool, seed: int = 0):
    """The release-freeze scenario (engine.workloads.release_freeze: code-review conversations
    growing turn by turn, arriving within a short window), as [(arrival_step, ids, max_tokens)],
    plus max_model_len (the engine's default, 2048: the worst case a contiguous slab reserves). Arrivals map to engine steps (2 steps per simulated second) so that both
    allocators see exactly the same arrival pattern."""
    from engine import workloads as W
    if quick:
        reqs = W.release_freeze(n=12, seed=seed, turns=3, window_s=10.0, prompt_median=80, prompt_max=200,
                                context_max=360, output_median=32, output_max=64)
    else:
        reqs = W.release_freeze(n=32, seed=seed, turns=4, window_s=20.0)
    from engine.config import EngineConfig
    max_len = EngineConfig().max_model_len  # the engine's default context cap: what a slab reserves
    out = []
    for r in reqs:
        ids = list(r.prompt_token_ids) if r.prompt_token_ids else list(tok(r.prompt)["input_ids"])
        ids = ids[: max_len - r.max_tokens - 1]
        out.append((int(r.arrival_s * 2), ids, int(r.max_tokens)))
    return out, max_len


def _drive(eng, arrivals, SamplingParams, on_step=None, max_idle_steps: int = 2000):
    """Adds requests at their arrival steps and steps until done. Returns {rid: tokens}."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outputs, step, idle = {}, 0, 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            a, rid, ids, params = pending.pop(0)
            eng.add_request(rid, ids, params)
        outs = eng.step() or []
        progressed = False
        for o in outs:
            progressed = True
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        if on_step:
            on_step(step)
        idle = 0 if progressed or pending else idle + 1
        if idle > max_idle_steps:
            raise RuntimeError(f"engine made no progress for {max_idle_steps} steps")
        step += 1
    return outputs, step


def suite_memory(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, EngineConfig = C.require_engine()
    res = SuiteResult()
    ctx.start("load tokenizer")
    tok = ctx.tokenizer()
    ctx.done("tokenizer")
    work, max_len = release_freeze_workload(tok, ctx.quick)
    if ctx.smoke:
        work, max_len = [(a, ids[:20], 4) for a, ids, _ in work[:4]], 64
    n = len(work)
    slabs, bs = 4, 16
    blocks = slabs * max_len // bs
    res.add("workload", f"release-freeze: {n} requests (growing conversations), {min(len(w[1]) for w in work)}-"
            f"{max(len(w[1]) for w in work)} prompt tokens, arrivals over {max(w[0] for w in work)} steps",
            "", row=False)
    res.add("kv_budget_tokens", blocks * bs, f"{blocks} blocks of {bs} = {slabs} slabs of max_model_len {max_len}")
    stats, outs = {}, {}
    for alloc in ("paged", "contiguous"):
        ctx.start(f"{alloc} allocator")
        llm = C.make_llm(ctx, allocator=alloc, num_kv_blocks=blocks, block_size=bs, max_model_len=max_len,
                         max_num_seqs=n, enable_prefix_caching=False)
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
            outs[alloc], steps = _drive(eng, arrivals, SamplingParams, on_step)
            acc["wall"] = time.perf_counter() - t0
            acc["steps"] = steps
        finally:
            C.free_llm(llm)
        if acc["alloc_name"] != alloc:
            raise BenchUnavailable(f"engine ran allocator {acc['alloc_name']!r} when asked for {alloc!r}")
        stats[alloc] = acc
        ctx.done(f"{alloc} allocator")
    if stats["contiguous"]["max_gap"] < max_len // 2:
        raise BenchUnavailable("allocator='contiguous' accepted but no running request ever held a reserved slab "
                               f"(largest reserved-but-unfilled gap {stats['contiguous']['max_gap']} slots)")
    for alloc in ("paged", "contiguous"):
        s = stats[alloc]
        waste = 1 - s["fill"] / s["alloc"] if s["alloc"] else None
        res.add(f"{alloc}_waste", waste, f"1 - filled/allocated slot-steps over {s['steps']} steps (time-averaged)")
        res.add(f"{alloc}_max_concurrency", s["max_running"], "most requests running in one step")
        res.add(f"{alloc}_wall_s", s["wall"], "", row=not ctx.quick)
    res.add("outputs_match", outs["paged"] == outs["contiguous"] and len(outs["paged"]) == n,
            "greedy tokens identical on both allocators, every request finished")
    res.figures.append(("memory_waste", line_figure(
        "KV waste per step (fraction of allocated slots not holding a token)",
        {a: (list(range(len(stats[a]["series"]))), stats[a]["series"]) for a in stats}, "step (with KV allocated)",
        "waste fraction")))
    return res


# ---------------------------------------------------------------------------- prefix

_QUESTIONS = [
    "How do I reset my password?", "Can I change the billing date of my plan?",
    "What happens to my files if I cancel?", "How do I add a teammate to my workspace?",
    "Why was my payment declined?", "Is there a student discount?", "How do I export my data as CSV?",
    "Can two people edit the same document at once?", "Where can I download invoices?",
    "How do I turn on two-factor authentication?", "What are the API rate limits?",
    "How long are deleted items kept?", "Can I move my account to another region?",
    "How do I report a security issue?", "Do you offer an on-premises version?", "How do I close my account?",
]


def shared_prefix_prompts(tok, n: int, prefix_tokens: int = 1000, seed: int = 0):
    """A ~prefix_tokens system prompt shared by n chat prompts that differ only in the question."""
    rng = random.Random(seed)
    sents = []

    def ids_for(k, q):
        system = "You are the support assistant of a software company. Policies follow. " + " ".join(sents[:k])
        ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    while len(ids_for(len(sents), "")) < prefix_tokens:
        sents.append(f"Policy {len(sents) + 1}: " + rng.choice(C._SENTENCES) + f" It concerns {rng.choice(C._TOPICS)}.")
    prompts = [ids_for(len(sents), _QUESTIONS[i % len(_QUESTIONS)]) for i in range(n)]
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts) and shared < min(map(len, prompts)) - 1:
        shared += 1
    return prompts, shared


def suite_prefix(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, _ = C.require_engine()
    res = SuiteResult()
    ctx.start("prompts")
    tok = ctx.tokenizer()
    n = ctx.pick(16, 6, smoke=2)
    prompts, shared = shared_prefix_prompts(tok, n + 1, prefix_tokens=ctx.pick(1000, 1000, smoke=80))
    warm, prompts = prompts[0], prompts[1:]
    ctx.done("prompts")
    res.add("shared_prefix_tokens", shared, f"{n} questions behind one system prompt")
    blocks = C.blocks_for([len(p) for p in prompts] + [len(warm)], 2) + 16
    ttft, first = {}, {}
    for mode, caching in (("cold", False), ("hit", True)):
        ctx.start(f"TTFT {mode}")
        llm = C.make_llm(ctx, enable_prefix_caching=caching, num_kv_blocks=blocks, max_num_seqs=4)
        try:
            C.warm_up(llm, SamplingParams, [t for t in reversed(warm)])  # unrelated tokens: no shared prefix
            llm.generate([warm], C.greedy(SamplingParams, 1))            # fills the prefix cache when on
            times, toks = [], []
            for p in prompts:  # one at a time: TTFT without batching effects
                outs, wall = C.timed_generate(llm, [p], C.greedy(SamplingParams, 1))
                times.append(wall)
                toks.append(C.token_ids_of(outs[0]))
            m = C.snapshot_metrics(llm)
        finally:
            C.free_llm(llm)
        if caching and not m.prefix_cache_hits:
            raise BenchUnavailable("enable_prefix_caching=True accepted but the snapshot shows no prefix-cache hits")
        if not caching and m.prefix_cache_hits:
            raise BenchUnavailable("enable_prefix_caching=False still reported prefix-cache hits")
        ttft[mode], first[mode] = sorted(times)[len(times) // 2], toks
        if caching:
            res.add("prefix_cache_hit_rate", m.prefix_cache_hit_rate, "tokens found / tokens looked up (engine metric)")
        ctx.done(f"TTFT {mode}")
    res.add("ttft_cold_s", ttft["cold"], "median, prefix caching off (wall time of a 1-token request)")
    res.add("ttft_hit_s", ttft["hit"], "median, prefix caching on, shared prefix already cached")
    res.add("ttft_reduction", 1 - ttft["hit"] / ttft["cold"], "1 - hit / cold (target >= 0.8)")
    res.add("outputs_match", first["cold"] == first["hit"], "first token identical with and without the cache")
    res.figures.append(("prefix_ttft", bar_figure("TTFT with a ~1,000-token shared system prompt",
                                                 ["cold (no prefix cache)", "prefix-cache hit"],
                                                 [ttft["cold"], ttft["hit"]], "seconds (median)")))
    return res


# ---------------------------------------------------------------------------- speculative

_PASSAGES = [
    ("Mara", "Jonas", "Mara opened the workshop at seven, as she did every morning. She swept the sawdust from the "
     "bench, checked the glue pots and set out the chisels in order of size. Mara liked the hour before the "
     "apprentices arrived, when the only sound was the kettle and the radio murmuring about the weather. By eight "
     "the first customer was at the door with a chair that had lost a leg, and Mara promised it would be ready by "
     "Friday."),
    ("the river", "the canal", "In spring the river rose quickly. The old path along the river flooded first, then "
     "the meadow, and for a week the town watched the river creep toward the bakery. Children dropped sticks from "
     "the bridge to see how fast the river ran. When the water finally fell, the river left a line of mud on every "
     "wall it had touched, and the town spent a month scrubbing it away."),
    ("server", "cluster", "The server restarted at midnight after the update. For ten minutes the server refused "
     "connections while it rebuilt its indexes, and the on-call engineer watched the dashboard with a cup of cold "
     "tea. Once the server came back, latency was lower than before, and the engineer wrote a short note explaining "
     "what the update had changed and why the server had needed the restart."),
    ("Tuesday", "Thursday", "The committee meets every Tuesday in the small room on the second floor. On Tuesday "
     "mornings the agenda is sent out at nine, and members are asked to read the minutes of the previous Tuesday "
     "before they arrive. If a Tuesday falls on a holiday, the meeting moves to the following day, and the "
     "secretary sends a reminder so that nobody turns up to an empty room."),
]
_OPEN = [
    "Write a short poem about the first snow of winter.", "Give me three ideas for a weekend project with kids.",
    "Why do people enjoy scary movies?", "Describe an imaginary city built on the back of a giant turtle.",
]


def speculative_sets(tok):
    def ids(text):
        x = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(x["input_ids"] if hasattr(x, "keys") else x)
    edit = [ids(f"Rewrite the passage below, replacing every '{a}' with '{b}'. Change nothing else and output only "
                f"the rewritten passage.\n\n{p}") for a, b, p in _PASSAGES]
    return {"passage_edit": edit, "open_ended": [ids(t) for t in _OPEN]}


def theory_tokens_per_pass(alpha, k: int):
    if alpha is None:
        return None
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def spec_cfg_enabled_fallback(cfg) -> bool:
    return bool(getattr(cfg, "enable_fallback", False))


def suite_speculative(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, _ = C.require_engine()
    from engine.config import SpeculativeConfig
    res = SuiteResult()
    ctx.start("prompts")
    model, tok = ctx.hf()
    sets = speculative_sets(tok)
    k = 4
    drafters = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=k)}
    if not ctx.quick:
        drafters["self_draft_int8"] = SpeculativeConfig(method="self_draft", num_speculative_tokens=k, draft_quantize="int8")
        drafters["self_draft_l24"] = SpeculativeConfig(method="self_draft", num_speculative_tokens=2, draft_layers=24)
    if ctx.quick:
        sets = {name: ps[:ctx.pick(4, 2, smoke=1)] for name, ps in sets.items()}
    max_new = ctx.pick(128, 64, smoke=8)
    ctx.done("prompts")

    ctx.start("verify cost (transformers forward, k+1 vs 1 token)")
    vc = peers.verify_cost_ratios(model, sets["passage_edit"][0], ks=(1, 2, 4, 8), reps=ctx.pick(10, 6, smoke=1))
    for key, v in vc.items():
        res.add(key, v, "best-of timing, KV cache of the prompt" if key.startswith("verify_cost") else "")
    ctx.done("verify cost")

    # Plain and speculative engines run the same prompt back to back, alternating which goes
    # first, and the whole set is run `rounds` times; each side's best round is compared. Run one
    # after the other once, the open-ended ratio (~1.0 by construction once the class falls back)
    # swung between 0.90 and 1.18 on a shared 2-core machine, as did two identical plain engines.
    rounds = ctx.pick(3, 2, smoke=1)

    def make(spec_cfg):
        llm = C.make_llm(ctx, speculative=spec_cfg, max_num_seqs=4,
                         num_kv_blocks=C.blocks_for([max(map(len, ps)) for ps in sets.values()], max_new + 16) + 32)
        try:
            if spec_cfg is not None and not llm.engine.snapshot().info.speculative:
                raise BenchUnavailable(f"speculative={spec_cfg.method} accepted but the engine reports no speculation")
            C.warm_up(llm, SamplingParams, sets["open_ended"][0])
        except BaseException:
            C.free_llm(llm)
            raise
        return llm

    def one(llm, p, sname):
        o, w = C.timed_generate(llm, [p], C.greedy(SamplingParams, max_new, ignore_eos=False, request_class=sname))
        return w, C.token_ids_of(o[0])

    def interleaved(plain_llm, spec_llm):
        """{set: (best round wall, tokens of round 1, None)} for plain and {set: (..., spec deltas)}."""
        plain, spec = {}, {}
        for sname, ps in sets.items():
            before = C.snapshot_metrics(spec_llm).spec
            walls = {"plain": [], "spec": []}
            toks = {"plain": [], "spec": []}
            for rnd in range(rounds):
                pw = sw = 0.0
                for i, p in enumerate(ps):       # batch 1: speculation is a latency tool
                    if (i + rnd) % 2 == 0:
                        (w1, t1), (w2, t2) = one(plain_llm, p, sname), one(spec_llm, p, sname)
                    else:
                        (w2, t2), (w1, t1) = one(spec_llm, p, sname), one(plain_llm, p, sname)
                    pw, sw = pw + w1, sw + w2
                    toks["plain"].append(t1)
                    toks["spec"].append(t2)
                walls["plain"].append(pw)
                walls["spec"].append(sw)
            after = C.snapshot_metrics(spec_llm).spec
            d = {f: getattr(after, f) - getattr(before, f) for f in
                 ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_passes", "num_emitted_tokens")}
            d["engine_verify_cost_ratio"] = after.verify_cost_ratio
            d["fell_back"] = sname in after.fallback_classes  # this set's request class
            d["rounds_match"] = toks["spec"] == toks["plain"]
            n = len(ps)
            plain[sname] = (min(walls["plain"]), toks["plain"][:n], None)
            spec[sname] = (min(walls["spec"]), toks["spec"][:n], d)
        return plain, spec

    ctx.start("plain decoding")
    plain_llm = make(None)
    ctx.done("plain")
    try:
        for dname, cfg in drafters.items():
            ctx.start(f"drafter {dname} (interleaved with plain)")
            try:
                spec_llm = make(cfg)
            except (ValueError, NotImplementedError) as e:
                if dname == "ngram":
                    raise BenchUnavailable(f"speculative={cfg} rejected: {e}") from None
                res.add(f"{dname}", None, f"not available: {type(e).__name__}: {str(e)[:100]}")
                ctx.done(dname)
                continue
            try:
                plain, spec = interleaved(plain_llm, spec_llm)
            finally:
                C.free_llm(spec_llm)
            for sname in sets:
                pw, pt, _ = plain[sname]
                sw, st, d = spec[sname]
                alpha = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
                mal = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
                tpp = d["num_emitted_tokens"] / d["num_target_passes"] if d["num_target_passes"] else None
                ntok = sum(map(len, st))
                speedup = (ntok / sw) / (sum(map(len, pt)) / pw) if sw and pw else None
                pre = f"{dname}_{sname}"
                kk = cfg.num_speculative_tokens
                res.add(f"{pre}_acceptance_rate", alpha, "accepted / draft tokens")
                res.add(f"{pre}_mean_acceptance_length", mal, "1 + accepted / drafts")
                res.add(f"{pre}_tokens_per_target_pass", tpp, "emitted tokens / target passes")
                res.add(f"{pre}_theory_tokens_per_pass", theory_tokens_per_pass(alpha, kk),
                        f"(1 - a^(k+1)) / (1 - a), k={kk}")
                res.add(f"{pre}_speedup", speedup, f"tok/s vs plain, same prompts, batch 1, best of {rounds} interleaved rounds"
                        + (" (target >= 2)" if (dname, sname) == ("ngram", "passage_edit") else "")
                        + (" (target >= 0.95)" if (dname, sname) == ("ngram", "open_ended") else ""))
                res.add(f"{pre}_outputs_match", st == pt and d["rounds_match"],
                        "greedy tokens identical to plain decoding (every round)")
                if spec_cfg_enabled_fallback(cfg):
                    res.add(f"{pre}_fell_back", d["fell_back"],
                            "this set's request class was on plain-decoding fallback at the end")
                if d["engine_verify_cost_ratio"] is not None:
                    res.add(f"{pre}_engine_verify_cost_ratio", d["engine_verify_cost_ratio"],
                            "the engine's own measurement (SpecMetrics.verify_cost_ratio)")
            ctx.done(dname)
    finally:
        C.free_llm(plain_llm)
    per = {}
    for key, v in list(res.fields.items()):
        for d in drafters:
            for sname in sets:
                pre = f"{d}_{sname}_"
                if key.startswith(pre):
                    per.setdefault(d, {}).setdefault(sname, {})[key[len(pre):]] = v
    res.add("by_drafter", per, "", row=False)
    res.add("verify_cost_ratio", vc.get(f"verify_cost_ratio_k{k}"), "", row=False)
    names = [f"{d}/{s}" for d in drafters for s in sets if f"{d}_{s}_speedup" in res.fields]
    res.figures.append(("speculative_speedup", bar_figure(
        "Speculative decoding speedup vs plain (batch 1, greedy)", names,
        [res.fields[n.replace("/", "_") + "_speedup"] or 0 for n in names], "x plain tok/s")))
    # flat aliases of the headline drafter (n-gram) for readers of the JSON
    for sname in sets:
        for f in ("acceptance_rate", "mean_acceptance_length", "tokens_per_target_pass", "theory_tokens_per_pass", "speedup"):
            res.fields.setdefault(f"{sname}_{f}", res.fields.get(f"ngram_{sname}_{f}"))
    return res


# ---------------------------------------------------------------------------- cache

def suite_cache(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, _ = C.require_engine()
    res = SuiteResult()
    tok = ctx.tokenizer()
    lengths = ctx.pick((64, 256, 512, 1024), (256, 1024), smoke=(16, 32))
    # decode with the cache is cheap: time more tokens there for a steadier per-token figure
    n_new_of = {True: ctx.pick(33, 17, smoke=3), False: ctx.pick(9, 5, smoke=3)}
    per_tok = {True: {}, False: {}}
    for use_cache in (True, False):
        label = "with KV cache" if use_cache else "without KV cache"
        ctx.start(label)
        n_new = n_new_of[use_cache]
        llm = C.make_llm(ctx, kv_cache=use_cache, max_num_seqs=2, max_model_len=2048,
                         num_kv_blocks=C.blocks_for([max(lengths)], n_new) + 8)
        try:
            if llm.engine.snapshot().info.kv_cache != use_cache:
                raise BenchUnavailable(f"kv_cache={use_cache} accepted but the engine reports kv_cache="
                                       f"{llm.engine.snapshot().info.kv_cache}")
            C.warm_up(llm, SamplingParams, C.filler_ids(tok, 32, seed=9))
            for n in lengths:
                marks = C.token_times(llm, C.filler_ids(tok, n, seed=n), C.greedy(SamplingParams, n_new),
                                      request_id=f"ctx{n}-{use_cache}")
                r = C.decode_rate(marks)
                if r is None:
                    raise BenchUnavailable("engine.step() did not report tokens as they were generated")
                per_tok[use_cache][n] = 1.0 / r
        finally:
            C.free_llm(llm)
        ctx.done(label)
    for n in lengths:
        res.add(f"cache_ms_per_token_at_{n}", per_tok[True][n] * 1e3, "decode, prefill excluded")
        res.add(f"nocache_ms_per_token_at_{n}", per_tok[False][n] * 1e3, "every step recomputes the whole prefix")
        res.add(f"nocache_over_cache_at_{n}", per_tok[False][n] / per_tok[True][n], "")
    res.figures.append(("cache_cost", line_figure(
        "Cost per generated token as context grows", {
            "with KV cache": (list(lengths), [per_tok[True][n] * 1e3 for n in lengths]),
            "without KV cache": (list(lengths), [per_tok[False][n] * 1e3 for n in lengths])},
        "context (tokens)", "ms per token", log_y=True)))
    return res


# ---------------------------------------------------------------------------- threads

_SPIN = "import time\nend = time.time() + {secs}\nwhile time.time() < end:\n    pass\n"


def suite_threads(ctx: C.BenchContext) -> SuiteResult:
    """Matmul pass time at 1 thread vs all cores, on the machine as it is now and with one core
    kept busy by a spinning child process (what happens on a shared box), at decode-like rows."""
    import torch
    res = SuiteResult()
    model, _ = ctx.hf()
    shape = _shape_of(model)
    dt = getattr(torch, ctx.dtype())
    ncpu = os.cpu_count() or 1
    counts = sorted({1, ncpu})
    rows = (1, 16, 64)
    old = torch.get_num_threads()
    table = {}
    try:
        for busy in (False, True):
            spinner = None
            ctx.start("one core kept busy" if busy else "machine as it is")
            if busy:
                spinner = subprocess.Popen([sys.executable, "-c", _SPIN.format(secs=120)])
            try:
                for th in counts:
                    torch.set_num_threads(th)
                    mm = R.measure_model_matmuls(shape, rows=rows, dtype=dt, min_time=0.2)
                    for m in rows:
                        table[(busy, th, m)] = mm[m]["slab_ms"]
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            ctx.done("one core kept busy" if busy else "machine as it is")
    finally:
        torch.set_num_threads(old)
    for (busy, th, m), ms in sorted(table.items()):
        res.add(f"slab_ms_{'busy' if busy else 'now'}_t{th}_m{m}", ms, "one pass of all linears + lm_head"
                + (" + a spinning process" if busy else ""))
    if ncpu > 1:
        for busy in (False, True):
            tag = "busy" if busy else "now"
            res.add(f"threads_speedup_{tag}_m16", table[(busy, 1, 16)] / table[(busy, ncpu, 16)],
                    f"1-thread time / {ncpu}-thread time at 16 rows" + (" with one core busy" if busy else ""))
    res.add("load_avg_1m", round(os.getloadavg()[0], 2), "other processes on the machine during the run")
    return res


SUITE_FUNCS = {
    "throughput": suite_throughput,
    "roofline": suite_roofline,
    "memory": suite_memory,
    "prefix": suite_prefix,
    "speculative": suite_speculative,
    "cache": suite_cache,
    "threads": suite_threads,
}
