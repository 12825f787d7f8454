"""`python -m engine bench weights`: seed 002's "fewer weight bytes, faster decode" at batch 1.

One request decoded alone with each weight format, the formats alternating round by round in one
process (engine/bench/decode_bs1.py, the same runs `bench roofline` makes): the de-quantized fp32
copies, the GGUF's Q4_1 blocks read in place (the default model's file), and Q8_0 blocks read in
place (`q8_0_variant`: the same Q4_1 values re-quantized to Q8_0 in a GGUF written to the cache
dir; the lm_head is the file's Q8_0 in both). Per format: tok/s, the weight bytes one step reads
(EngineInfo.weight_bytes_per_step) and the step split from the C stack's own per-op timer. The
memory read bandwidth is measured around the runs, so each format's Linears can be set against
the time reading their bytes takes. The Claims page's `weight_bytes` row reads these fields.
"""

from __future__ import annotations

import copy
import hashlib
import os

from engine.bench import common as C
from engine.bench.report import side_by_side_bars

Q8_MODEL = "mem:default-q8_0"
FORMATS = ("fp32", "q8_0", "q4_1")


def cpu_simd() -> str:
    """The widest x86 vector extension the kernels can use here: "AVX-512", "AVX2" or "none"."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "none"


def q8_0_variant() -> str:
    """Registers (once per process) Q8_MODEL: the default model with each decoder Linear's Q4_1
    weights re-quantized to Q8_0, in a GGUF kept in the cache dir (written once per source file),
    and the model's fp32 weights set to that file's blocks de-quantized, so weight_format="gguf"
    reads them in place. Returns the model name."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFWriter, quants

    from engine.model.gguf_weights import read_quant_tensors
    from engine.model.models import cache_dir, gguf_source, load_model, register_model

    model, tok = load_model("default", "cpu", "float32")
    src = gguf_source(model)
    if src is None:
        raise C.BenchUnavailable("the default model has no GGUF source here")
    st = os.stat(src)
    tag = hashlib.sha256(f"{os.path.realpath(src)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    path = os.path.join(cache_dir(), f"default-q8_0-{tag}.gguf")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        w = GGUFWriter(tmp, "llama")
        for t in GGUFReader(src, "r").tensors:
            if t.tensor_type == T.Q4_1:
                w.add_tensor(t.name, quants.quantize(quants.dequantize(t.data, T.Q4_1), T.Q8_0), raw_dtype=T.Q8_0)
            elif t.tensor_type == T.Q8_0:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=T.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    clone = copy.deepcopy(model)  # tied lm_head / embedding stay tied
    with torch.no_grad():
        for name, qt in read_quant_tensors(path, clone, {"Q8_0": int(T.Q8_0)}).items():
            deq = quants.dequantize(qt.blocks, T.Q8_0).reshape(qt.shape)
            clone.get_submodule(name).weight.copy_(torch.from_numpy(np.ascontiguousarray(deq[qt.rows])))
    register_model(Q8_MODEL, clone, tok, gguf_path=path)
    return Q8_MODEL


def suite_weights(ctx) -> C.SuiteResult:
    import torch

    from engine.bench.decode_bs1 import decode_bs1_by_format
    from engine.bench.machine_rates import measure_read_bandwidth
    from engine.model.fused_decode import LINEAR_OPS
    from engine.model.models import load_tokenizer

    C.require_engine()
    if ctx.model != "default":
        raise C.BenchUnavailable("bench weights compares the default model's GGUF formats (--model default)")
    res = C.SuiteResult()
    ctx.start("Q8_0 copy of the default model")
    configs = {
        "fp32": {"weight_format": "fp32"},
        "q8_0": {"model": q8_0_variant(), "weight_format": "gguf"},
        "q4_1": {"weight_format": "gguf"},
    }
    ctx.done("Q8_0 copy")
    prompts, _ = C.chat_prompts(load_tokenizer(), 4, seed=0, min_tokens=30, max_tokens=200)
    n_new = ctx.pick(48, 24, smoke=4)
    bw_mb = ctx.pick(1024, 256, smoke=16)
    ctx.start("batch-1 decode per format")
    bw = measure_read_bandwidth(bw_mb, dtype=torch.float32)
    by = decode_bs1_by_format(ctx, prompts[0], n_new, formats=FORMATS, rounds=ctx.pick(3, 2, smoke=1), configs=configs)
    bw = max(bw, measure_read_bandwidth(bw_mb, dtype=torch.float32))
    ctx.done("decode")
    info = C.machine_info()
    res.add("cpu", info["cpu"], "lscpu's model name")
    res.add("cpu_simd", cpu_simd(), "the widest vector extension (AVX-512 sums Q4_1 / Q8_0 blocks factorized)")
    res.add("weights_mem_bw_gb_s", bw, "torch.sum over a large fp32 tensor, best pass before / after (GB = 1e9 B)")
    res.add("weights_new_tokens", n_new, f"one request, prompt {len(prompts[0])} tokens, prefill excluded")
    res.add("weights_note", "CPU shared with other work: rates are the best of alternating rounds", "", row=False)
    for f in FORMATS:
        d = by[f]
        res.add(f"weights_{f}_resolved", d.get("format"), "the format the engine resolved", row=False)
        res.add(f"weights_{f}_tok_s", d.get("tok_s"), f"best of {len(d['rates'])} alternating rounds")
        res.add(f"weights_{f}_bytes_per_step", d.get("weight_bytes"), "weight bytes one decode step reads")
        # wall time: the C stack's per-op timer reads the wall clock, so the step is split in the same
        # units (its CPU-time split mixes the two where other processes take slices of the core)
        split = d.get("split_ms") or {}
        for part in ("step", "weights", "attention", "rest"):
            note = "ms per decode step, one timed run: the Linears (weights), the attention kernel, the rest"
            res.add(f"weights_{f}_{part}_ms", split.get(part), note if part == "step" else "")
        ops = d.get("ops_ms") or {}
        for op, ms in ops.items():
            res.add(f"weights_{f}_op_{op}_ms", ms, "", row=False)
        lin = sum(ops.get(k, 0.0) for k in LINEAR_OPS) if ops else None
        res.add(f"weights_{f}_layer_linears_ms", lin, "the decoder layers' Linears per step (C per-op timer)")
        if d.get("weight_bytes") and bw:
            floor = d["weight_bytes"] / (bw * 1e9) * 1e3
            res.add(f"weights_{f}_read_floor_ms", floor, "its weight bytes at weights_mem_bw_gb_s")
    labels = [{"fp32": "fp32 copies", "q8_0": "Q8_0 blocks", "q4_1": "Q4_1 blocks"}[f] for f in FORMATS]
    res.figures.append(
        (
            "weights_speed_vs_bytes",
            side_by_side_bars(
                "Batch-1 decode: speed per weight format beside the bytes it reads",
                labels,
                ("decode tokens / s", [by[f].get("tok_s") or 0 for f in FORMATS], "tokens / s"),
                ("weight MB read per step", [(by[f].get("weight_bytes") or 0) / 1e6 for f in FORMATS], "MB"),
                note=f"{info['cpu']} ({cpu_simd()}); CPU shared with other work: best of alternating rounds",
            ),
        )
    )
    return res
