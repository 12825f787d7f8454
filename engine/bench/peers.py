"""transformers baselines, run in the same process on a private copy of the same weights.

- sequential: `model.generate` one request at a time (greedy, EOS ignored);
- static: one padded batch (left padding + attention_mask), the classic batch `generate`;
- continuous batching: `model.generate_batch` (transformers' paged continuous batching; on CPU it
  runs with the sdpa attention implementation, outside inference_mode, which it cannot use).

Each returns (generated token ids per request, wall seconds). Greedy EOS is disabled at the
model level (ctx.hf() sets generation_config.eos_token_id = None) and in every config passed.
"""

from __future__ import annotations

import logging
import os
import time

from engine.model import kernel_isa
from engine.model.kv_layout import cdiv


def _gen_config(tok, max_new_tokens: int):
    from transformers import GenerationConfig

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
        num_beams=1,
        use_cache=True,
    )


def hf_sequential(model, tok, prompts: list[list[int]], max_new_tokens: int, on_each=None):
    import torch

    gc_ = _gen_config(tok, max_new_tokens)
    outs = []
    t = time.perf_counter()
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], dtype=torch.long, device=next(model.parameters()).device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
            outs.append(g[0, len(p) :].tolist())
            if on_each:
                on_each(i)
    return outs, time.perf_counter() - t


def left_pad(prompts: list[list[int]], pad_id: int):
    import torch

    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p) :] = 1
    return ids, mask


def hf_static(model, tok, prompts: list[list[int]], max_new_tokens: int):
    import torch

    gc_ = _gen_config(tok, max_new_tokens)
    ids, mask = left_pad(prompts, gc_.pad_token_id)
    dev = next(model.parameters()).device
    ids, mask = ids.to(dev), mask.to(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        g = model.generate(ids, attention_mask=mask, generation_config=gc_)
    wall = time.perf_counter() - t
    return [row.tolist() for row in g[:, ids.shape[1] :]], wall


def hf_continuous_batching(model, tok, prompts: list[list[int]], max_new_tokens: int, warmup: bool = True):
    """transformers' `generate_batch`. Returns (outputs, wall seconds, info). The call builds its
    own manager and cache each time (that setup is part of what a user of the API pays); a short
    warm-up call first keeps one-time library initialisation out of the timing."""
    from transformers import ContinuousBatchingConfig

    gc_ = _gen_config(tok, max_new_tokens)
    # On CPU, generate_batch sizes its KV cache from *system* RAM (90% of it by default): on a
    # shared machine that zero-fills tens of GB and dominates the run. Size it for the workload
    # instead (blocks of page_size tokens, every request resident at once), like kvscope's pool.
    page = ContinuousBatchingConfig().page_size
    num_blocks = sum(cdiv(len(p) + max_new_tokens, page) for p in prompts) + 2
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    old = cb_logger.level
    cb_logger.setLevel(logging.ERROR)  # it warns that eos is disabled: that is the point
    try:
        if warmup:
            model.generate_batch(
                [p[:8] for p in prompts[:2]],
                generation_config=_gen_config(tok, 2),
                continuous_batching_config=ContinuousBatchingConfig(num_blocks=4),
                progress_bar=False,
            )
        t = time.perf_counter()
        res = model.generate_batch(
            prompts,
            generation_config=gc_,
            progress_bar=False,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=num_blocks),
        )
        wall = time.perf_counter() - t
    finally:
        cb_logger.setLevel(old)
    outs, errors = [], []
    for rid, r in res.items():
        outs.append(list(r.generated_tokens))
        if r.error:
            errors.append(f"{rid}: {r.error}")
    if len(outs) != len(prompts):
        errors.append(f"{len(prompts) - len(outs)} request(s) missing from generate_batch results")
    return outs, wall, {"num_blocks": num_blocks, "page_size": page, "errors": errors[:4]}


# ---------------------------------------------------------------------------- llama.cpp (optional)

LLAMACPP_PIN = "llama-cpp-python==0.3.36"
NO_LLAMACPP = f"no llama.cpp peer environment (scripts/peers.sh install-llamacpp installs {LLAMACPP_PIN})"
_LLAMACPP_BS1_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, n_new, max_passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt = json.loads(sys.stdin.readline())
llm = Llama(model_path=path, n_ctx=len(prompt) + n_new + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)
def one_pass():
    llm.reset()
    llm.eval(prompt)
    out, t = [], time.perf_counter()
    for _ in range(n_new):
        tok = llm.sample(temp=0.0)
        out.append(tok)
        llm.eval([tok])
    return n_new / (time.perf_counter() - t), out   # n_new single-token decode passes
one_pass()                                          # warms up (page cache, allocations)
import llama_cpp
print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
for _ in range(max_passes):                         # one timed pass per "pass" line; bounded
    if sys.stdin.readline().strip() != "pass":      # "quit" or the parent gone
        break
    rate, toks = one_pass()
    print(json.dumps({"tok_s": rate, "tokens": toks}), flush=True)
"""


def peers_dir() -> str:
    """Where scripts/peers.sh keeps the peers' venvs: <kvscope cache>/peers."""
    import os

    from engine.model.models import cache_dir

    return os.path.join(cache_dir(), "peers")


def llamacpp_python() -> str | None:
    """The Python of the llama.cpp peer venv that scripts/peers.sh installs ($KVSCOPE_PEERS_VENV,
    else <kvscope cache>/peers/llamacpp, else the older <kvscope cache>/peers-venv), where it exists."""
    import os

    from engine.model.models import cache_dir

    env = os.environ.get("KVSCOPE_PEERS_VENV")
    venvs = [env] if env else [os.path.join(peers_dir(), "llamacpp"), os.path.join(cache_dir(), "peers-venv")]
    for venv in venvs:
        py = os.path.join(venv, "bin", "python")
        if os.path.exists(py):
            return py
    return None


# Under KVSCOPE_ISA=avx2 the bench's vLLM runs with kernel_isa.AVX2_RUNTIME_ENV's limits, as kvscope's
# own process does (llama.cpp is built with -mno-avx512f, scripts/peers.sh). vLLM's own kernels come
# in an AVX2 build too (vllm._C_AVX2), which it loads where torch.cpu finds no AVX-512:
# engine/bench/avx2_site (put first on the peer's PYTHONPATH) makes torch.cpu's AVX-512 / AMX probes
# answer False there.
AVX2_SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "avx2_site")


def vllm_isa_env() -> dict[str, str]:
    """The variables that limit the vLLM peer to the ISA kvscope's kernels were built for ({} for
    the native build)."""
    import os

    from engine.model import cpu_kernels

    if cpu_kernels.isa_flags() != cpu_kernels.ISA_FLAGS["avx2"]:
        return {}
    env = kernel_isa.runtime_limits()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (AVX2_SITE_DIR, os.environ.get("PYTHONPATH")) if p)
    return env


def vllm_isa_limits() -> str:
    """vllm_isa_env in words: the NAME=value limits and vLLM's AVX2 kernels ("" for the native build)."""
    env = vllm_isa_env()
    if not env:
        return ""
    limits = " ".join(f"{k}={env[k]}" for k in kernel_isa.AVX2_RUNTIME_ENV)
    return limits + " and vLLM's own AVX2 kernels (vllm._C_AVX2)"


def vllm_isa_label() -> str:
    """How vLLM's run-time ISA was set, for a result's peer state ("" for the native build)."""
    limits = vllm_isa_limits()
    return f" (run with {limits}, as on an AVX2-only CPU)" if limits else ""


def vllm_command() -> str | None:
    """The `vllm` command of the vLLM CPU peer venv (scripts/peers.sh install-vllm), where it exists."""
    import os

    cmd = os.path.join(peers_dir(), "vllm", "bin", "vllm")
    return cmd if os.path.exists(cmd) else None


def _run_llamacpp(script_args: list[str], stdin: str, timeout: float) -> dict:
    """One llama.cpp peer script (`python -c script args...` in the peer venv, input on stdin): its
    last stdout line as JSON, or {"why"} where the peer is missing or failed."""
    import json
    import subprocess

    py = llamacpp_python()
    if py is None:
        return {"why": NO_LLAMACPP}
    try:
        proc = subprocess.run(
            [py, "-c", *script_args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        return {"why": f"llama.cpp peer failed: {type(e).__name__}: {e}"}
    if proc.returncode != 0:
        return {"why": f"llama.cpp peer failed: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


class LlamaCppBs1:
    """llama.cpp's single-stream greedy decode of a GGUF kept loaded in a subprocess of this run
    (llama-cpp-python in the peer environment), one timed pass per `one()` call: a run can put its
    passes between kvscope's own rounds, so both engines are timed in the same minutes (on a shared
    machine one engine's rounds a minute after the other's can differ by 20-40% from the machine
    alone). The worker warms up with one untimed pass, answers at most `max_passes` requests and
    stops at `close()` (or when this process goes). `why` says why it cannot run; `one()` then
    returns None. Prefill is excluded from each pass's tok/s."""

    def __init__(
        self, gguf_path: str, prompt: list[int], n_new: int, threads: int, max_passes: int = 64, timeout: float = 600
    ):
        import json
        import queue
        import subprocess
        import tempfile
        import threading

        self.rates: list[float] = []
        self.tokens: list[int] | None = None
        self.version: str | None = None
        self.why: str | None = None
        self.timeout, self.max_passes, self.proc = timeout, max_passes, None
        self.returncode: int | None = None  # the worker's exit status once closed
        py = llamacpp_python()
        if py is None:
            self.why = NO_LLAMACPP
            return
        self._err = tempfile.TemporaryFile(mode="w+")
        args = [py, "-c", _LLAMACPP_BS1_WORKER, gguf_path, str(threads), str(n_new), str(max_passes)]
        self._lines: queue.Queue = queue.Queue()
        try:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, bufsize=1
            )
            self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
            self._reader.start()
            self.proc.stdin.write(json.dumps(prompt) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")
            return
        ready = self._answer()
        if ready is not None:
            self.version = ready.get("version")

    def _read(self, stream) -> None:
        """The worker's stdout, line by line into the queue; None at its end."""
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def _fail(self, why: str) -> None:
        if self.why is None:
            self._err.seek(0)
            tail = self._err.read().strip()[-300:]
            self.why = f"llama.cpp peer failed: {why}" + (f": {tail}" if tail else "")
        self.close(kill=True)

    def _answer(self) -> dict | None:
        """The worker's next JSON line (other output skipped), or None (and `why`) where it died,
        hung or closed its output."""
        import json
        import queue

        while True:
            try:
                line = self._lines.get(timeout=self.timeout)
            except queue.Empty:
                self._fail(f"no answer in {self.timeout:.0f} s")
                return None
            if line is None:
                self._fail(f"exited with {self.proc.wait() if self.proc else '?'}")
                return None
            try:
                out = json.loads(line)
            except ValueError:
                continue
            if isinstance(out, dict):
                return out

    def one(self) -> float | None:
        """One timed pass: its tok/s (also appended to `rates`), or None where the peer cannot run."""
        if self.why is not None or self.proc is None:
            return None
        if len(self.rates) >= self.max_passes:
            self.why = f"the worker answers at most {self.max_passes} passes"
            return None
        try:
            self.proc.stdin.write("pass\n")
            self.proc.stdin.flush()
        except OSError as e:
            self._fail(f"{type(e).__name__}: {e}")
            return None
        out = self._answer()
        if out is None:
            return None
        self.rates.append(out["tok_s"])
        self.tokens = out["tokens"]
        return out["tok_s"]

    def close(self, kill: bool = False) -> None:
        """Stops the worker: asked to quit (killed where `kill`, or where it does not within 30 s)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.returncode = None
        try:
            if kill:
                proc.kill()
            else:
                proc.stdin.write("quit\n")
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait()
        self.returncode = proc.returncode
        self._reader.join(timeout=5)  # at the pipe's end now that the worker has exited
        proc.stdout.close()
        self._err.close()

    def result(self) -> dict:
        """As llamacpp_decode_bs1 returns it: best tok/s, every pass's rate, the last pass's tokens."""
        if not self.rates:
            return {"why": self.why or "no pass timed"}
        return {"tok_s": max(self.rates), "rates": list(self.rates), "tokens": self.tokens, "version": self.version}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def llamacpp_decode_bs1(
    gguf_path: str, prompt: list[int], n_new: int, threads: int, reps: int = 2, timeout: float = 600
) -> dict:
    """llama.cpp's single-stream greedy decode of the same GGUF on its own (LlamaCppBs1): best tok/s
    over `reps` timed passes after a warm-up, prefill excluded, `threads` threads. Returns {"why"}
    where it cannot run."""
    with LlamaCppBs1(gguf_path, prompt, n_new, threads, max_passes=reps, timeout=timeout) as lc:
        for _ in range(reps):
            if lc.one() is None:
                break
        return lc.result()


_LLAMACPP_SCALING_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
spec = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=spec["n_ctx"], n_threads=threads, n_threads_batch=threads, n_batch=512,
            verbose=False)
llm.reset()
llm.eval(spec["jobs"][0]["prompt"][:32])          # warm-up (page cache, allocations)
out = []
for job in spec["jobs"]:
    llm.reset()                                     # from position 0: nothing of the last job reused
    t0 = time.perf_counter()
    llm.eval(job["prompt"])
    tok = llm.sample(temp=0.0)                      # the first token: TTFT
    t1 = time.perf_counter()
    for _ in range(job["n_new"] - 1):
        llm.eval([tok])
        tok = llm.sample(temp=0.0)
    t2 = time.perf_counter()
    n = job["n_new"] - 1
    out.append({"ttft_s": t1 - t0, "decode_tok_s": n / (t2 - t1) if n > 0 and t2 > t1 else None, "wall_s": t2 - t0})
import llama_cpp
print(json.dumps({"results": out, "version": llama_cpp.__version__}))
"""


def llamacpp_scaling(gguf_path: str, jobs: list[dict], threads: int, n_ctx: int, timeout: float = 1800) -> dict:
    """llama.cpp on the same GGUF, one request at a time (llama-cpp-python's high-level API runs
    one sequence): per job {"prompt": ids, "n_new": n}, its TTFT (prompt evaluated in 512-token
    batches, then the first greedy token), its decode tok/s over the other n_new - 1 tokens and its
    wall time. Returns {"results": [...], "version"} or {"why"} where it cannot run."""
    import json

    return _run_llamacpp(
        [_LLAMACPP_SCALING_SCRIPT, gguf_path, str(threads)], json.dumps({"n_ctx": n_ctx, "jobs": jobs}), timeout
    )
