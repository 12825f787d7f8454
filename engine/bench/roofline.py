"""The machine's physical limits for this model, measured in-process, and the model's arithmetic.

Math (pure functions of a model config; unit-tested from fixed inputs):
- linear layers per token: q/k/v/o, gate/up/down per layer, plus the lm_head (V x H);
  a matmul of M rows through a [N x K] weight is 2*M*N*K FLOPs.
- attention per token at context c (QK^T and AV, all query heads, all layers): 4 * L * Hq * d * c.
- prefill tokens need no lm_head except the last one of each prompt; each generated token needs it.
- weight bytes read per decode step = all linear weights (the tied embedding is read once, as the
  lm_head); KV bytes read per step = 2 * L * Hkv * d * context * dtype bytes.

Roofs:
- compute roof for a workload = generated tokens / (workload FLOPs / peak matmul FLOP/s): the
  highest generated-token rate the machine could reach if every FLOP the workload needs ran at the
  best measured matmul rate. Its fraction = achieved FLOP rate / peak FLOP rate.
- naive compute roof = peak FLOP/s / FLOPs of one generated token (treats prompt tokens as free).
- memory roof at batch 1 = read bandwidth / (weight bytes + KV bytes at the measured context).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.bench import common as C
from engine.bench import peers
from engine.bench.common import SuiteResult, spread
from engine.bench.decode_bs1 import KernelTimer, decode_bs1_by_format, decode_steps  # noqa: F401 (re-exported)
from engine.bench.machine_rates import measure_best_matmuls, measure_model_matmuls, measure_read_bandwidth
from engine.bench.report import bar_figure, line_figure
from engine.model.kv_layout import (
    HEADS_FIELDS,
    HIDDEN_FIELDS,
    INTER_FIELDS,
    VOCAB_FIELDS,
    config_int,
    kv_bytes_per_token,
    kv_geometry,
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        layers, kv, hd = kv_geometry(cfg)
        return cls(
            hidden=config_int(cfg, HIDDEN_FIELDS, "the linear shapes"),
            intermediate=config_int(cfg, INTER_FIELDS, "the MLP shapes"),
            layers=layers,
            heads=config_int(cfg, HEADS_FIELDS, "the attention FLOPs"),
            kv_heads=kv,
            head_dim=hd,
            vocab=config_int(cfg, VOCAB_FIELDS, "the lm_head shape"),
        )

    def layer_linears(self) -> list[tuple[str, int, int]]:
        """(name, K in, N out) of one decoder layer's linear layers (Llama layout)."""
        H, I, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            ("q_proj", H, q),
            ("k_proj", H, kv),
            ("v_proj", H, kv),
            ("o_proj", q, H),
            ("gate_proj", H, I),
            ("up_proj", H, I),
            ("down_proj", I, H),
        ]

    def lm_head(self) -> tuple[str, int, int]:
        return ("lm_head", self.hidden, self.vocab)

    def layer_params(self) -> int:
        return sum(k * n for _, k, n in self.layer_linears())

    def linear_params(self) -> int:
        """All matmul weights touched per generated token (decoder linears + lm_head)."""
        return self.layers * self.layer_params() + self.hidden * self.vocab

    def flops_body(self) -> int:
        """Linear FLOPs of one token through the decoder layers (no lm_head)."""
        return 2 * self.layers * self.layer_params()

    def flops_lm_head(self) -> int:
        return 2 * self.hidden * self.vocab

    def flops_attention(self, context: float) -> float:
        """QK^T + AV FLOPs for one query token attending over `context` positions."""
        return 4.0 * self.layers * self.heads * self.head_dim * context

    def flops_per_generated_token(self, context: float = 0.0) -> float:
        return self.flops_body() + self.flops_lm_head() + self.flops_attention(context)

    def kv_token_bytes(self, dtype_bytes: int) -> int:
        """K+V bytes of one token, all layers (kv_layout.kv_bytes_per_token, no scales)."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)

    def weight_bytes(self, dtype_bytes: int) -> int:
        return self.linear_params() * dtype_bytes


def workload_flops(shape: ModelShape, prompt_lens, new_tokens) -> float:
    """Minimum FLOPs to serve requests (prompt length p_i, n_i generated tokens each) with a KV
    cache: prefill of p tokens (lm_head only for the last), then n-1 decode tokens."""
    if isinstance(new_tokens, int):
        new_tokens = [new_tokens] * len(prompt_lens)
    total = 0.0
    for p, n in zip(prompt_lens, new_tokens):
        p, n = int(p), int(n)
        # prefill: token i (0-based) attends over i+1 positions
        total += p * shape.flops_body() + shape.flops_attention(p * (p + 1) / 2) + shape.flops_lm_head()
        # decode: the j-th extra token attends over p + j positions
        steps = max(0, n - 1)
        ctx_sum = steps * p + steps * (steps + 1) / 2
        total += steps * (shape.flops_body() + shape.flops_lm_head()) + shape.flops_attention(ctx_sum)
    return total


def compute_roof(shape: ModelShape, peak_gflops: float, prompt_lens, new_tokens) -> dict:
    n_gen = sum(new_tokens) if not isinstance(new_tokens, int) else new_tokens * len(prompt_lens)
    flops = workload_flops(shape, prompt_lens, new_tokens)
    t_min = flops / (peak_gflops * 1e9)
    mean_ctx = sum(prompt_lens) / max(1, len(prompt_lens))
    return {
        "workload_gflop": flops / 1e9,
        "compute_roof_tok_s": n_gen / t_min if t_min > 0 else None,
        "compute_roof_naive_tok_s": peak_gflops * 1e9 / shape.flops_per_generated_token(mean_ctx),
        "gflop_per_generated_token": shape.flops_per_generated_token(mean_ctx) / 1e9,
    }


def memory_roof_tok_s(
    shape: ModelShape,
    bandwidth_gb_s: float,
    dtype_bytes: int,
    context: float,
    weight_bytes: int | None = None,
    batch: int = 1,
) -> float:
    """Decode rate if each step only had to stream the weights once and every sequence's KV cache
    once: `batch` sequences at `context` tokens each, weights of `weight_bytes` (default: the
    linears in `dtype_bytes`, i.e. fp32 copies; pass the bytes a quantized format reads)."""
    w = shape.weight_bytes(dtype_bytes) if weight_bytes is None else weight_bytes
    step_bytes = w + shape.kv_token_bytes(dtype_bytes) * context * batch
    return batch * bandwidth_gb_s * 1e9 / step_bytes


def fraction(achieved, roof):
    if achieved is None or roof in (None, 0):
        return None
    return achieved / roof


def _q4_1_roof(res, shape, dt, min_t, peak, lens, new, kv_tok_s, ctx) -> None:
    """Where the engine's own Q4_1 kernel runs the Linears faster than any fp32 matmul here (AMX's
    tiles), the compute roof above (fp32) is not a bound on kvscope: W16 is also put against a roof
    with every FLOP at that kernel's best rate (a higher bar than the real one: attention's FLOPs
    stay fp32)."""
    ctx.start("Q4_1 kernel GFLOP/s at M in (16, 512)")
    try:
        q4 = measure_model_matmuls(shape, rows=(16, 512), dtype=dt, min_time=min_t, kernel="q4_1")
    except ValueError:
        ctx.done("Q4_1 kernel rate")
        return
    ctx.done("Q4_1 kernel rate")
    for m, r in q4.items():
        res.add(f"matmul_q4_1_gflops_m{m}", r["all_gflops"], "the engine's Q4_1 kernel, the same FLOPs", row=False)
    best = max(r["all_gflops"] for r in q4.values())
    if best <= peak:
        return
    roof = compute_roof(shape, best, lens, new)["compute_roof_tok_s"]
    res.add(
        "compute_roof_q4_1_fraction",
        fraction(kv_tok_s, roof),
        f"W16 against every FLOP at the Q4_1 kernel's best rate ({best:.0f} GFLOP/s, above the fp32 peak)",
    )


def quant_row_path() -> str:
    """Which of quant_linear.c's two bitwise-equal row paths this CPU was tuned to."""
    from engine.model import cpu_kernels

    lib = cpu_kernels.load()
    rows = cpu_kernels.ql_scratch_rows(lib) if lib is not None else 0
    if rows <= 0:
        return "n/a"
    return "codes in registers" if rows >= 2**31 - 1 else f"scratch buffer from {rows} rows"


def shape_of(model) -> ModelShape:
    return ModelShape.from_config(model.config)


def suite_roofline(ctx: C.BenchContext) -> SuiteResult:
    import torch

    C.require_engine()
    res = SuiteResult()
    from engine.model import kernel_isa

    res.add("kernel_isa", kernel_isa.summary(), "the vector path of the C kernels (KVSCOPE_ISA=avx2 forces AVX2)")
    ctx.start("load model")
    model, tok = ctx.hf()
    shape = shape_of(model)
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
    mm, by_kernel = measure_best_matmuls(shape, rows=rows, dtype=dt, min_time=min_t)
    ctx.done("matmul")

    ctx.start("kvscope W16")
    prompts, _ = C.chat_prompts(tok, ctx.pick(16, 16, smoke=4), seed=0, min_tokens=30, max_tokens=300)
    new = ctx.pick(64, 64, smoke=8)
    # best of two runs, as the roof is the best of two measurements (not reused from another suite)
    runs = [C.kvscope_workload(ctx, prompts, new, f"W16-roofline-{i}") for i in range(ctx.pick(2, 2, smoke=1))]
    k_toks, k_wall, _ = min(runs, key=lambda r: r[1])
    n_gen = sum(len(t) for t in k_toks)
    kv_tok_s = n_gen / k_wall
    # one more run with the C stack's per-op timer on (not one of the timed runs above)
    _, p_wall, p_info = C.kvscope_workload(ctx, prompts, new, "W16-roofline-ops", profile=True)
    ctx.done("kvscope W16")

    peak_m = max(mm, key=lambda m: mm[m]["all_gflops"])
    ctx.start(f"matmul again at M={peak_m}")
    again, _ = measure_best_matmuls(shape, rows=(peak_m,), dtype=dt, min_time=min_t)
    if again[peak_m]["all_gflops"] > mm[peak_m]["all_gflops"]:
        mm[peak_m] = again[peak_m]
    peak = mm[peak_m]["all_gflops"]
    for m in rows:
        res.add(
            f"matmul_gflops_m{m}",
            mm[m]["all_gflops"],
            f"{shape.layers} layers' q,k,v,o,gate,up,down + lm_head at {m} rows; {mm[m]['slab_ms']:.1f} ms per pass "
            f"({mm[m]['kernel']} kernel)",
        )
    for name, per_m in by_kernel.items():
        for m in rows:
            res.add(f"matmul_{name}_gflops_m{m}", per_m[m]["all_gflops"], "", row=False)
    res.add(
        "peak_matmul_gflops",
        peak,
        f"best of the above (M={peak_m}, {mm[peak_m]['kernel']} kernel, measured before and after W16), {ctx.dtype()}",
    )
    res.add(
        "peak_matmul_kernel",
        mm[peak_m]["kernel"],
        "torch: F.linear per projection; packed: the engine's packed, merged Linears (engine/model/linear.py)",
        row=False,
    )
    ctx.done("matmul again")

    lens = [len(p) for p in prompts]
    cr = compute_roof(shape, peak, lens, new)
    res.add(
        "gflop_per_generated_token",
        cr["gflop_per_generated_token"],
        f"2 x {shape.linear_params() / 1e6:.1f} M matmul params + attention at mean prompt length",
    )
    res.add(
        "workload_gflop", cr["workload_gflop"], f"W16 with a KV cache: {sum(lens)} prompt + {n_gen} generated tokens"
    )
    res.add("kvscope_tok_s", kv_tok_s, f"W16 generated tokens / s, best of {len(runs)} runs")
    res.add("kvscope_achieved_gflops", cr["workload_gflop"] / k_wall, "workload FLOPs / kvscope wall time")
    res.add(
        "compute_roof_tok_s",
        cr["compute_roof_tok_s"],
        "generated tok/s if every FLOP of W16 (prefill included) ran at peak matmul rate",
    )
    res.add("compute_roof_fraction", fraction(kv_tok_s, cr["compute_roof_tok_s"]), "= achieved / peak FLOP rate")
    res.add(
        "compute_roof_naive_tok_s",
        cr["compute_roof_naive_tok_s"],
        "peak / FLOPs of one generated token (prompt tokens counted as free)",
    )
    res.add("compute_roof_naive_fraction", fraction(kv_tok_s, cr["compute_roof_naive_tok_s"]), "")
    _q4_1_roof(res, shape, dt, min_t, peak, lens, new, kv_tok_s, ctx)
    w16_ops = p_info.get("ops_s")
    for op, sec in (w16_ops or {}).items():
        res.add(f"w16_op_{op}_s", sec, "W16 seconds in this op of engine/model/csrc/layer.c (all layers, all steps)")
    if w16_ops:
        res.add("w16_profiled_wall_s", p_wall, "that profiled W16 run's wall time")
        res.add(
            "w16_outside_layers_s",
            p_wall - sum(w16_ops.values()),
            "the rest of it: embedding, final norm and lm_head, sampling, scheduling, Python",
        )

    # batch-1 decode: one request alone, prefill excluded, with bandwidth measured around it
    LLM, SamplingParams, _ = C.require_engine()
    ctx.start("memory read bandwidth")
    bw_mb = ctx.pick(1024, 256, smoke=16)
    bw = measure_read_bandwidth(bw_mb, dtype=torch.float32)
    ctx.done("bandwidth")
    ctx.start("kvscope batch-1 decode")
    p1 = prompts[spread(prompts, 1)[0]]
    n1 = ctx.pick(64, 32, smoke=6)
    rounds = ctx.pick(3, 2, smoke=1)
    gguf_path = None
    try:
        from engine.model.models import gguf_source

        gguf_path = gguf_source(C.load_hf_model(ctx.model, ctx.dtype())[0])
    except Exception:
        pass
    # llama.cpp on the same GGUF and request: one pass of it after each round of kvscope's formats
    lc = peers.LlamaCppBs1(gguf_path, p1, n1, C.torch_threads(), max_passes=rounds) if gguf_path else None
    try:
        alongside = (lc.one,) if lc is not None and lc.why is None else ()
        by_fmt = decode_bs1_by_format(
            ctx, p1, n1, formats=("auto", "fp32", "transformers"), rounds=rounds, alongside=alongside
        )
    finally:
        if lc is not None:
            lc.close()
    dec, dec32 = by_fmt["auto"]["tok_s"], by_fmt["fp32"]["tok_s"]
    ctx.done("kvscope bs1")

    bw = max(bw, measure_read_bandwidth(bw_mb, dtype=torch.float32))
    res.add("mem_bw_gb_s", bw, "torch.sum over a large fp32 tensor, best pass before/after bs1 decode (GB = 1e9 B)")
    # the K/V W16's decode steps read: each sequence's context at each of its new_tokens - 1 decode
    # steps (its first token comes from prefill), at the pool's bytes per token
    kv_gb = sum(sum(p + j for j in range(1, new)) for p in lens) * shape.kv_token_bytes(dbytes) / 1e9
    res.add("w16_decode_kv_read_gb", kv_gb, "K/V bytes W16's decode steps read from the pool (GB = 1e9 B)")
    res.add("w16_decode_kv_floor_s", kv_gb / bw if bw else None, "that read at mem_bw_gb_s: attention's floor in W16")
    ctx.start("transformers batch-1 decode")
    _, t1 = peers.hf_sequential(model, tok, [p1], 1)
    _, tn = peers.hf_sequential(model, tok, [p1], n1)
    hf_dec = (n1 - 1) / (tn - t1) if tn > t1 else None
    ctx.done("transformers bs1")

    ctxlen = len(p1) + n1 / 2
    mroof = memory_roof_tok_s(shape, bw, dbytes, ctxlen)
    read = by_fmt["auto"]["weight_bytes"]
    mroof_read = memory_roof_tok_s(shape, bw, dbytes, ctxlen, weight_bytes=read)
    res.add("weight_bytes", shape.weight_bytes(dbytes), f"matmul weights per decode step in {ctx.dtype()}", row=False)
    res.add(
        "weight_format",
        by_fmt["auto"]["format"],
        "what the default engine's Linears read: 'gguf' = the "
        "file's quantized blocks (engine/model/csrc/quant_linear.c), 'fp32' = de-quantized copies",
    )
    res.add("quant_row_path", quant_row_path(), "the factorized Q4_1 / Q8_0 kernel's row paths, measured at load")
    res.add(
        "weight_bytes_read_per_step",
        read,
        f"weight bytes one decode step reads in that format (fp32 copies: {by_fmt['fp32']['weight_bytes']})",
    )
    res.add("kv_bytes_per_token", shape.kv_token_bytes(dbytes), "K+V, all layers")
    res.add("memory_roof_tok_s", mroof_read, f"bandwidth / (weight bytes read + KV of {ctxlen:.0f} tokens) per step")
    res.add("memory_roof_fp32_tok_s", mroof, "the same with fp32 weights", row=False)
    res.add(
        "decode_bs1_tok_s",
        dec,
        f"kvscope, default weight format ({by_fmt['auto']['format']}), one request, "
        f"prompt {len(p1)} tokens, {n1} new, prefill excluded, best of {len(by_fmt['auto']['rates'])}",
    )
    res.add(
        "decode_bs1_fp32_tok_s",
        dec32,
        "the same request with weight_format='fp32', rounds alternating with the above in this process",
    )
    res.add("decode_bs1_speedup_vs_fp32", fraction(dec, dec32), "target >= 3")
    res.add("decode_backend", by_fmt["auto"].get("decode_backend"), "the default engine's layer code", row=False)
    res.add(
        "decode_bs1_transformers_tok_s",
        by_fmt["transformers"]["tok_s"],
        "the same weights with decode_backend='transformers' (HF layer code), alternating with the above",
    )
    res.add("decode_bs1_c_vs_transformers", fraction(dec, by_fmt["transformers"]["tok_s"]), "")
    for op, ms in (by_fmt["auto"].get("ops_ms") or {}).items():
        res.add(f"bs1_op_{op}_ms", ms, "ms per decode step in this op of engine/model/csrc/layer.c (all layers)")
    res.add("memory_roof_fraction", fraction(dec, mroof_read), "against the bytes actually read; target >= 0.8")
    for f, name in (("auto", ""), ("fp32", "_fp32")):
        for key, unit in (("split_ms", "ms"), ("split_cpu_ms", "cpu_ms")):
            split = by_fmt[f].get(key)
            for part in ("step", "weights", "attention", "rest") if split else ():
                res.add(
                    f"bs1{name}_{part}_{unit}",
                    split[part],
                    ""
                    if part != "step"
                    else f"one timed decode run ({by_fmt[f]['format']}): {unit.replace('_', ' ')} per step in the "
                    "Linears (weights), the paged attention kernel and everything else",
                    row=unit == "cpu_ms",
                )
    res.add("hf_decode_bs1_tok_s", hf_dec, "transformers generate, same request, prefill excluded")
    if lc is not None:
        lcr = lc.result()
        if "tok_s" in lcr:
            res.add(
                "llamacpp_decode_bs1_tok_s",
                lcr["tok_s"],
                f"llama.cpp (llama-cpp-python {lcr['version']}) on the same GGUF and request, "
                f"{C.torch_threads()} threads, best of {len(lcr['rates'])}, prefill excluded, its passes "
                "alternating with kvscope's rounds above",
            )
            res.add("decode_bs1_vs_llamacpp", fraction(dec, lcr["tok_s"]), "target >= 1")
        else:
            ctx.note(f"llama.cpp peer not measured: {lcr.get('why')}")

    if not ctx.quick and C.torch_threads() > 1:
        ctx.start("matmul at 1 thread")
        old = C.torch_threads()
        torch.set_num_threads(1)
        try:
            mm1 = measure_model_matmuls(shape, rows=(1, 64, 256), dtype=dt, min_time=0.3)
        finally:
            torch.set_num_threads(old)
        for m in (1, 64, 256):
            res.add(f"matmul_gflops_m{m}_1thread", mm1[m]["all_gflops"], "same pass with torch.set_num_threads(1)")
        ctx.done("1 thread")

    res.figures.append(
        (
            "roofline_matmul",
            line_figure(
                f"Matmul GFLOP/s at the model's shapes ({ctx.dtype()}, {C.torch_threads()} threads)",
                {
                    "all (body + lm_head)": (list(rows), [mm[m]["all_gflops"] for m in rows]),
                    "decoder body": (list(rows), [mm[m]["body_gflops"] for m in rows]),
                    "lm_head": (list(rows), [mm[m]["lm_head_gflops"] for m in rows]),
                },
                "rows (M)",
                "GFLOP/s",
            ),
        )
    )
    res.figures.append(
        (
            "roofline_vs_roofs",
            bar_figure(
                "kvscope vs the machine's roofs (tokens / s)",
                ["W16 kvscope", "W16 compute roof", "bs1 decode kvscope", "bs1 memory roof"],
                [kv_tok_s, cr["compute_roof_tok_s"] or 0, dec or 0, mroof],
                "tokens / s",
            ),
        )
    )
    return res
