"""`python -m engine.lab.gpu_check OUT_DIR [--cpu-smoke]`: the one prepared check of kvscope on a GPU.

Runs on a bare GPU machine with only this repository and torch + transformers installed (no
streamlit, plotly, gguf or tokenizer files; nothing here imports them): the models are random-weight
models of real architectures built in code — the default model's shape (SmolLM2-135M: Llama, 30
layers, 9 query / 3 KV heads, head dim 64, vocab 49,152) and a ~1.2B Llama (Llama-3.2-1B's shape)
— fed prompts as token ids. It measures, each phase under its own time budget:

1. exactness in float32: engine greedy tokens vs transformers' `generate` on the same weights and
   device, per attention backend (ragged batch, chunked prefill, prefix-cache hits);
2. agreement in bfloat16 (fraction of identical tokens, first divergence; never claimed exact);
3. W16 throughput (16 prompts of 30-300 tokens, 64 new tokens each, greedy, EOS ignored): the
   engine per backend vs transformers' static left-padded batch and `generate_batch`;
4. batch-1 decode vs the memory roof: device bandwidth measured with a large copy, roof = bandwidth
   / bytes of weights read per token;
5. invariants after a preemption-heavy run (recompute and swap): the block manager's invariants at
   every step, preemption counts, and the tokens vs the same requests run without pressure.

Writes OUT_DIR/gpu_check.log and OUT_DIR/gpu_check.json, and prints one line
`GPU_CHECK_JSON {...}` with every figure. `--cpu-smoke` runs the same code on the CPU with a tiny
config and tiny workloads (the test suite runs it so the script cannot rot); its numbers say
nothing about any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback

from engine.model.kv_layout import cdiv

VERSION = 1
BUDGET_S = 450  # the whole run stays under 8 minutes on the GPU


def model_configs(smoke: bool) -> dict:
    from transformers import LlamaConfig

    if smoke:
        return {
            "tiny-llama": LlamaConfig(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=2048,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                bos_token_id=1,
                eos_token_id=2,
            )
        }
    return {
        # SmolLM2-135M-Instruct's config values (the embedded default model), weights random
        "smollm2-135m": LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            hidden_act="silu",
        ),
        # Llama-3.2-1B's shape (plain rope: the llama3 frequency scaling does not change the check)
        "llama-1b": LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
            hidden_act="silu",
        ),
    }


def token_prompts(n: int, lo: int, hi: int, vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random token ids (ids >= 3: clear of bos/eos/pad); the first
    `shared_prefix` ids are common to every prompt (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, vocab) for _ in range(max(1, rng.randint(lo, hi) - shared_prefix))] for _ in range(n)
    ]


class Check:
    def __init__(self, out_dir: str, smoke: bool, budget_s: float):
        self.out_dir = out_dir
        self.smoke = smoke
        self.budget_s = budget_s
        self.t0 = time.perf_counter()
        os.makedirs(out_dir, exist_ok=True)
        self.log_f = open(os.path.join(out_dir, "gpu_check.log"), "w")
        self.res: dict = {
            "kvscope_gpu_check": VERSION,
            "mode": "cpu-smoke" if smoke else "gpu",
            "errors": [],
            "skipped": [],
        }

    def log(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_f.write(line + "\n")
        self.log_f.flush()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def phase(self, name: str, fn, need_s: float) -> None:
        if self.left() < need_s:
            self.res["skipped"].append(f"{name}: {self.left():.0f} s left of the budget, needs ~{need_s:.0f} s")
            self.log(f"SKIP {name}: time budget")
            return
        self.log(f"== {name}")
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # one failed phase must not lose the others' figures
            self.res["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            self.log(traceback.format_exc())
        self.log(f"   {name} done in {time.perf_counter() - t:.1f} s")
        self.sync_empty()

    def guard(self, label: str, fn) -> None:
        """One backend's failure is recorded and logged; the phase goes on with the others."""
        try:
            fn()
        except Exception as e:
            self.res["errors"].append(f"{label}: {type(e).__name__}: {str(e)[:400]}")
            self.log(f"   FAILED {label}\n{traceback.format_exc()}")

    def sync_empty(self):
        """Collect garbage and give CUDA's cached memory back (between phases and models)."""
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- phases


def _engine(name: str, device: str, dtype: str, **cfg):
    from engine import LLM

    return LLM(model=name, device=device, dtype=dtype, **cfg)


def _run_engine(llm, prompts, max_tokens: int, check_invariants: bool = False):
    """Greedy, EOS ignored; returns (token ids per prompt, wall s, engine stats)."""
    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", list(p), params)
    outs, steps, max_running = {}, 0, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                if o.error:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                outs[o.request_id] = o.outputs[0].token_ids
        steps += 1
        max_running = max(max_running, len(eng.scheduler.running))
        if check_invariants:
            eng.check_invariants()
    wall = time.perf_counter() - t
    eng.check_invariants()
    kinds: dict = {}
    for e in eng.events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return (
        [outs[f"r{i}"] for i in range(len(prompts))],
        wall,
        {"steps": steps, "max_running": max_running, "events": kinds},
    )


def _backends(device) -> list[str]:
    """Each distinct attention path once: "auto" only where it is not one of the others
    (the C kernel on CPU; on CUDA it currently means "torch", engine/model/device.py)."""
    from engine.model.device import auto_attention_backend
    from engine.model.paged_flex import unavailable_reason

    out = ["torch"]
    if auto_attention_backend(device.type, True, True) not in ("torch", "flex"):
        out.insert(0, "auto")
    if unavailable_reason(device, 16) is None:
        out.append("flex")
    return out


def _free_llm(llm):
    """Drops the engine's pools now (the weights stay registered for the next phase)."""
    from engine.bench.common import free_llm

    free_llm(llm)


def run(out_dir: str, smoke: bool = False, budget_s: float = BUDGET_S) -> dict:
    import torch
    import transformers

    from engine.lab.agreement import agreement, hf_greedy
    from engine.model.models import build_random, register_model, unregister_model

    ck = Check(out_dir, smoke, budget_s)
    res = ck.res
    dev = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if not smoke and dev.type != "cuda":
        ck.log("no CUDA device: run with --cpu-smoke to exercise the script on the CPU")
        res["errors"].append("no CUDA device visible to torch")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the exactness phase
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    res.update(
        {
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "device_type": dev.type,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "generate_batch_available": hasattr(transformers.GenerationMixin, "generate_batch"),
        }
    )
    cfgs = model_configs(smoke)
    small = next(iter(cfgs))
    big = list(cfgs)[-1]
    backends = _backends(dev)
    res["backends"] = backends
    n_new = 8 if smoke else 32
    exact_prompts = token_prompts(
        4 if smoke else 8, 5, 40 if smoke else 200, cfgs[small].vocab_size, seed=1, shared_prefix=16 if smoke else 48
    )
    ck.log(f"device {res['device']} torch {res['torch']} transformers {res['transformers']} backends {backends}")

    models: dict = {}

    def model(name: str, dtype):
        key = (name, str(dtype))
        if key not in models:
            models.clear()
            ck.sync_empty()
            m = build_random(cfgs[name], dev, dtype, seed=0)
            register_model(f"mem:{name}", m)
            models[key] = m
        return models[key]

    def engine_kw(**extra):
        kw = dict(
            max_model_len=1024,
            max_num_batched_tokens=64 if smoke else 512,
            block_size=16,
            num_kv_blocks=256 if smoke else 2048,
        )
        kw.update(extra)
        return kw

    # 1 + 2: exactness (fp32) and agreement (bf16) vs transformers on the same weights
    def exact(dtype_name: str, key: str):
        dt = getattr(torch, dtype_name)
        m = model(small, dt)
        ref = hf_greedy(m, exact_prompts, n_new)
        out = res[key] = {}

        def one(be):
            # a small token budget splits prompts into chunks; the shared prefix gives prefix hits
            llm = _engine(
                f"mem:{small}",
                str(dev),
                dtype_name,
                attention_backend=be,
                **engine_kw(max_num_batched_tokens=32 if smoke else 96),
            )
            got, wall, stats = _run_engine(llm, exact_prompts, n_new, check_invariants=True)
            a = agreement(got, ref).as_dict()
            a["attention_backend"] = llm.engine.info().attention_backend
            a["prefix_hit_events"] = stats["events"].get("prefix_hit", 0)
            a["prefill_chunks"] = stats["events"].get("prefill", 0)
            out[be] = a
            ck.log(
                f"   {key} {be}: {a['identical']}/{a['tokens']} identical, exact={a['exact']}, "
                f"first divergence {a['first_divergence']}"
            )
            _free_llm(llm)

        for be in backends:
            ck.guard(f"{key} {be}", lambda be=be: one(be))

    ck.phase("exactness float32", lambda: exact("float32", "exact_fp32"), 20)
    ck.phase("agreement bfloat16", lambda: exact("bfloat16", "agreement_bf16"), 20)

    # 3: W16 throughput, engine vs transformers in one run
    def w16(name: str):
        from engine.bench import peers
        from engine.model.models import IdTokenizer

        dt = torch.float32 if smoke else torch.bfloat16
        m = model(name, dt)
        nreq, new = (4, 8) if smoke else (16, 64)
        prompts = token_prompts(nreq, 30 if not smoke else 5, 300 if not smoke else 40, cfgs[name].vocab_size, seed=2)
        row: dict = {
            "dtype": str(dt).replace("torch.", ""),
            "requests": nreq,
            "new_tokens": new,
            "prompt_tokens": sum(len(p) for p in prompts),
        }

        def one(be):
            llm = _engine(f"mem:{name}", str(dev), row["dtype"], attention_backend=be, **engine_kw())
            _run_engine(llm, [p[:8] for p in prompts[:2]], 2)  # warm-up (flex compiles here)
            toks, wall, stats = _run_engine(llm, prompts, new)
            row[f"kvscope_{be}_tok_s"] = round(sum(len(t) for t in toks) / wall, 2)
            row[f"kvscope_{be}_backend"] = llm.engine.info().attention_backend
            ck.log(f"   {name} kvscope {be}: {row[f'kvscope_{be}_tok_s']} tok/s ({stats['steps']} steps)")
            _free_llm(llm)

        for be in backends:
            ck.guard(f"W16 {name} {be}", lambda be=be: one(be))
        tok = IdTokenizer(cfgs[name].vocab_size)
        m.generation_config.eos_token_id = None
        peers.hf_static(m, tok, [prompts[0][:8], prompts[1][:6]], 2)  # warm-up
        st, wall = peers.hf_static(m, tok, prompts, new)
        row["hf_static_tok_s"] = round(nreq * new / wall, 2)
        ck.log(f"   {name} transformers static batch: {row['hf_static_tok_s']} tok/s")
        if res["generate_batch_available"]:
            try:
                cb, wall, info = peers.hf_continuous_batching(m, tok, prompts, new)
                cb_tok_s = round(sum(len(t) for t in cb) / wall, 2)
                row["hf_generate_batch_tok_s"] = None if info["errors"] else cb_tok_s
                row["hf_generate_batch_errors"] = info["errors"]
            except Exception as e:
                row["hf_generate_batch_tok_s"] = None
                row["hf_generate_batch_errors"] = [f"{type(e).__name__}: {str(e)[:200]}"]
            ck.log(f"   {name} transformers generate_batch: {row['hf_generate_batch_tok_s']} tok/s")
        res.setdefault("w16", {})[name] = row

    for name in cfgs:
        ck.phase(f"W16 throughput {name}", lambda name=name: w16(name), 40)

    # 4: bandwidth and batch-1 decode vs the memory roof
    def bandwidth():
        n = (16 << 20) if smoke else (2 << 30)
        a = torch.empty(n // 4, dtype=torch.float32, device=dev)
        b = torch.empty_like(a)
        a.fill_(1.0)
        best = None
        for _ in range(3 if smoke else 10):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            b.copy_(a)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt_ = time.perf_counter() - t
            best = dt_ if best is None else min(best, dt_)
        res["bandwidth_gb_s"] = round(2 * n / best / 1e9, 1)  # read + write
        res["bandwidth_copy_bytes"] = n
        ck.log(f"   copy bandwidth {res['bandwidth_gb_s']} GB/s (best of copies of {n >> 20} MiB)")

    ck.phase("memory bandwidth", bandwidth, 5)

    def bs1(name: str):
        dt = torch.float32 if smoke else torch.bfloat16
        m = model(name, dt)
        weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        embed = m.get_input_embeddings().weight
        tied = m.get_output_embeddings() is not None and m.get_output_embeddings().weight is embed
        # per token a decode reads every weight once except the input embedding table (one row);
        # with tied embeddings that table is read as lm_head anyway
        read = weight_bytes - (0 if tied else embed.numel() * embed.element_size())
        prompt = token_prompts(1, 128, 128, cfgs[name].vocab_size, seed=3)[0] if not smoke else [5, 6, 7, 8]
        new = 8 if smoke else 128
        row: dict = {"dtype": str(dt).replace("torch.", ""), "weight_bytes_read_per_token": read}

        def one(be):
            llm = _engine(f"mem:{name}", str(dev), row["dtype"], attention_backend=be, **engine_kw())
            _run_engine(llm, [prompt[:8]], 4)  # warm-up
            eng = llm.engine
            from engine import SamplingParams

            eng.add_request("bs1", list(prompt), SamplingParams(max_tokens=new, ignore_eos=True))
            marks = []
            while eng.has_unfinished_requests():
                eng.step()
                marks.append(time.perf_counter())
            # the first step is the prefill; decode rate over the rest
            rate = (len(marks) - 2) / (marks[-1] - marks[1]) if len(marks) > 2 else None
            row[f"kvscope_{be}_tok_s"] = round(rate, 2) if rate else None
            ck.log(f"   {name} batch-1 decode {be}: {row[f'kvscope_{be}_tok_s']} tok/s")
            _free_llm(llm)

        for be in backends:
            ck.guard(f"batch-1 {name} {be}", lambda be=be: one(be))
        if "bandwidth_gb_s" in res:
            roof = res["bandwidth_gb_s"] * 1e9 / read
            row["memory_roof_tok_s"] = round(roof, 1)
            rates = [v for k, v in row.items() if k.startswith("kvscope_") and k.endswith("_tok_s") and v]
            best = max(rates, default=None)
            row["best_fraction_of_roof"] = round(best / roof, 3) if best else None
        res.setdefault("bs1_decode", {})[name] = row

    ck.phase(f"batch-1 decode {big}", lambda: bs1(big), 30)

    # 5: invariants after a preemption-heavy run
    def preemption():
        model(small, torch.float32)  # built and registered on the device
        nreq, new = (6, 8) if smoke else (16, 32)
        prompts = token_prompts(
            nreq,
            10 if smoke else 40,
            40 if smoke else 160,
            cfgs[small].vocab_size,
            seed=4,
            shared_prefix=8 if smoke else 32,
        )
        llm = _engine(f"mem:{small}", str(dev), "float32", **engine_kw())
        base, _, _ = _run_engine(llm, prompts, new)
        _free_llm(llm)
        out = {}
        bs = 16
        need = max(cdiv(len(p) + new, bs) for p in prompts)
        for mode in ("recompute", "swap"):
            llm = _engine(
                f"mem:{small}",
                str(dev),
                "float32",
                preemption_mode=mode,
                num_kv_blocks=need + 2,
                block_size=bs,
                max_model_len=1024,
                max_num_batched_tokens=64 if smoke else 256,
            )
            got, wall, stats = _run_engine(llm, prompts, new, check_invariants=True)
            a = agreement(got, base)
            ev = stats["events"]
            out[mode] = {
                "num_kv_blocks": need + 2,
                "steps": stats["steps"],
                "invariants_ok": True,
                "preemptions": ev.get("preempt", 0),
                "swap_outs": ev.get("swap_out", 0),
                "swap_ins": ev.get("swap_in", 0),
                "tokens_identical_to_unpressured": a.exact,
                "identical_fraction": round(a.fraction, 4),
            }
            ck.log(f"   {mode}: {out[mode]}")
            _free_llm(llm)
        res["preemption"] = out

    ck.phase("preemption-heavy invariants", preemption, 20)
    models.clear()
    for name in cfgs:
        unregister_model(f"mem:{name}")
    res["wall_s"] = round(time.perf_counter() - ck.t0, 1)
    line = json.dumps(res, sort_keys=True, default=str)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        f.write(line + "\n")
    ck.log(f"wrote {os.path.join(out_dir, 'gpu_check.json')}")
    print("GPU_CHECK_JSON " + line, flush=True)
    ck.log_f.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.lab.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="folder for gpu_check.log and gpu_check.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU (tests): exercises the code only")
    ap.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="time budget in seconds (phases past it are skipped)"
    )
    a = ap.parse_args(argv)
    res = run(a.out_dir, smoke=a.cpu_smoke, budget_s=a.budget_s)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
