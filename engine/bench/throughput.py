"""The throughput suite: kvscope vs transformers (sequential, static batch, generate_batch) on W16/W64."""

from __future__ import annotations

from engine.bench import common as C
from engine.bench import machine_rates as MR
from engine.bench import peers
from engine.bench import roofline as R
from engine.bench.common import SuiteResult, ratio, spread
from engine.bench.report import bar_figure


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
    res.add(
        "workload",
        f"W{nreq}: {nreq} chat prompts, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / nreq:.0f}), "
        f"{new} new tokens each, greedy, ignore_eos",
        source,
        row=False,
    )
    n_gen = nreq * new

    ctx.start("kvscope W16")
    k_toks, k_wall, info = C.kvscope_workload(ctx, prompts, new, "W16")
    kv_tok_s = sum(len(t) for t in k_toks) / k_wall
    res.add("kvscope_tok_s", kv_tok_s, f"W{nreq}, {sum(len(t) for t in k_toks)} tokens in {k_wall:.1f} s")
    ctx.done("kvscope W16")

    seq_idx = spread(prompts, ctx.pick(16, 4, smoke=nreq))
    ctx.start(f"transformers sequential ({len(seq_idx)} requests)")
    peers.hf_sequential(model, tok, [prompts[0][:8]], 2)  # warm-up
    s_toks, s_wall = peers.hf_sequential(model, tok, [prompts[i] for i in seq_idx], new)
    seq_tok_s = sum(len(t) for t in s_toks) / s_wall
    res.add(
        "hf_seq_tok_s",
        seq_tok_s,
        f"model.generate one at a time, {len(seq_idx)} of {nreq} requests"
        + (" (--quick: length-spread subset)" if len(seq_idx) < nreq else ""),
    )
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
        res.add(
            "hf_cb_tok_s",
            cb_tok_s,
            f"model.generate_batch (sdpa, KV sized to {cb_info['num_blocks']} "
            f"blocks of {cb_info['page_size']})" + (f"; errors: {cb_info['errors']}" if cb_info["errors"] else ""),
        )
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
    mm, _ = MR.measure_best_matmuls(shape, rows=roof_rows, dtype=dt, min_time=ctx.pick(0.3, 0.2, smoke=0.01))
    peak_m = max(mm, key=lambda m: mm[m]["all_gflops"])
    roof = R.compute_roof(shape, mm[peak_m]["all_gflops"], lens, new)["compute_roof_tok_s"]
    res.add(
        "compute_roof_w16_tok_s",
        roof,
        f"W{nreq} FLOPs at {mm[peak_m]['all_gflops']:.0f} GFLOP/s "
        f"(M={peak_m}, {mm[peak_m]['kernel']} kernel); the roofline suite measures it next to its own run",
    )
    res.add(
        "roof_over_hf_static",
        ratio(roof, st_tok_s),
        "compute roof / static batch: the largest speedup over the static batch this machine allows",
    )
    ctx.done("compute roof")

    res.add("speedup_vs_hf_seq", ratio(kv_tok_s, seq_tok_s), "kvscope / sequential")
    res.add("speedup_vs_hf_static", ratio(kv_tok_s, st_tok_s), "kvscope / static batch (target >= 5)")
    res.add("speedup_vs_hf_cb", ratio(kv_tok_s, cb_tok_s), "kvscope / generate_batch")

    mm = C.mismatches([k_toks[i] for i in seq_idx], s_toks)
    for m in mm:
        if m.get("request") is not None:
            m["request"] = seq_idx[m["request"]]
    res.add(
        "outputs_match",
        not mm,
        f"kvscope vs transformers sequential greedy, token for token, {len(seq_idx)} requests x {new} tokens",
    )
    res.add("mismatches", mm, "", row=bool(mm))
    st_mm = C.mismatches(k_toks, st_toks)
    res.add(
        "hf_static_outputs_match", not st_mm, "static batch vs kvscope (padding changes fp32 rounding; informational)"
    )
    if cb_toks is not None:
        res.add("hf_cb_outputs_match", not C.mismatches(k_toks, cb_toks), "generate_batch vs kvscope (informational)")

    if ctx.quick:
        ctx.note("throughput --quick: W64 skipped; transformers sequential timed on a 4-request length-spread subset")
    else:
        ctx.start("W64 prompts + kvscope W64")
        p64, _ = C.chat_prompts(tok, 64, seed=1, min_tokens=30, max_tokens=300)
        k64, k64_wall, _ = C.kvscope_workload(ctx, p64, new, "W64")
        kv64 = sum(len(t) for t in k64) / k64_wall
        res.add("kvscope_w64_tok_s", kv64, "W64 (64 requests)")
        ctx.done("kvscope W64")
        ctx.start("transformers static batch W64")
        st64, st64_wall = peers.hf_static(model, tok, p64, new)
        res.add("hf_static_w64_tok_s", 64 * new / st64_wall, "one left-padded batch of 64")
        res.add("speedup_vs_hf_static_w64", ratio(kv64, 64 * new / st64_wall), "")
        ctx.done("transformers static W64")

    res.add("kvscope_dtype", info.get("dtype", ctx.dtype()), "", row=False)
    res.add("kvscope_max_num_batched_tokens", info.get("max_num_batched_tokens"), "", row=False)
    labels = ["kvscope", "hf sequential", "hf static", "hf generate_batch"]
    vals = [kv_tok_s, seq_tok_s, st_tok_s, cb_tok_s or 0.0]
    res.figures.append(
        (
            "throughput_w16",
            bar_figure(
                "W16 throughput (generated tokens / s)",
                labels,
                vals,
                "tokens / s",
                note=f"{ctx.model}, {ctx.dtype()}, torch threads {C.torch_threads()}",
            ),
        )
    )
    return res
