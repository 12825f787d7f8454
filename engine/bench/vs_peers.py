"""`python -m engine bench peers`: kvscope against the engines users run, on the same weights, in one
run, alternating (best and median of the rounds):

(a) batch-1 decode tok/s: kvscope (default weight format) at 1 and 2 threads, llama.cpp on the same
    GGUF at 1 and 2 threads (bench/peers.llamacpp_decode_bs1, a subprocess), vLLM CPU as one stream
    over HTTP (content-chunk gaps; vLLM serves with the thread count it was started with);
(b) W16 over HTTP: 16 concurrent requests, 64 tokens, ignore_eos, kvscope's server vs vLLM's
    (bench/serve's client, in a child process);
(c) greedy text agreement on 8 prompts: identical, or the first differing character;
(d) TTFT of requests sharing a 1k-token prefix, the prefix already cached on both servers.

vLLM runs from the peer venv scripts/peers.sh installs (its own ports, its own pid file), serving the
default model's HF folder (engine.models.default_hf_folder) in fp32. Without that venv the suite is
unavailable and says why. Peers are measurement tools: nothing here is a project dependency."""

from __future__ import annotations

import os
import statistics
import subprocess

from engine.bench import common as C
from engine.bench import peers
from engine.bench.common import SuiteResult
from engine.bench.roofline import decode_steps
from engine.bench.serve import pct, run_client
from engine.serve.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _client(spec: dict) -> dict:
    out = run_client(spec)
    errs = [r["error"] for r in out["results"] if "error" in r]
    if errs:
        raise RuntimeError(f"{len(errs)} request(s) to {spec['base']} failed: {errs[0]}")
    return out


def _tok_s(out: dict) -> float:
    return sum(r["usage"]["completion_tokens"] for r in out["results"]) / out["wall"]


def _best_median(xs: list[float]) -> tuple[float | None, float | None]:
    return (max(xs), statistics.median(xs)) if xs else (None, None)


class _Vllm:
    """vLLM CPU started by scripts/peers.sh on free ports; stopped on exit."""

    def __init__(self):
        if peers.vllm_command() is None:
            raise C.BenchUnavailable(f"no vLLM peer venv in {peers.peers_dir()}/vllm (scripts/peers.sh install-vllm)")
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.env = dict(
            os.environ,
            VLLM_PORT=str(port),
            VLLM_EVENTS=f"tcp://127.0.0.1:{free_port()}",
            VLLM_REPLAY=f"tcp://127.0.0.1:{free_port()}",
            VLLM_PIDFILE=os.path.join(peers.peers_dir(), f"vllm-bench-{port}.pid"),
            VLLM_LOG=os.path.join(peers.peers_dir(), f"vllm-bench-{port}.log"),
            **peers.vllm_isa_env(),
        )

    def __enter__(self):
        self._sh("vllm-start", 1200)
        return self

    def __exit__(self, *exc):
        self._sh("vllm-stop", 90, check=False)

    def _sh(self, cmd: str, timeout: float, check: bool = True) -> None:
        script = os.path.join(ROOT, "scripts", "peers.sh")
        subprocess.run(["bash", script, cmd], env=self.env, timeout=timeout, check=check)


def _agreement(a: list[str], b: list[str]) -> list[dict]:
    out = []
    for x, y in zip(a, b):
        d = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if d is None and len(x) != len(y):
            d = min(len(x), len(y))
        out.append({"identical": d is None, "first_divergence_char": d})
    return out


def suite_peers(ctx: C.BenchContext) -> SuiteResult:
    _, SamplingParams, _ = C.require_engine()
    from engine.core.thread import EngineThread
    from engine.model.models import default_gguf_path, load_model
    from engine.serve import create_app, run_in_background

    res = SuiteResult()
    from engine.model import kernel_isa

    res.add("kernel_isa", kernel_isa.summary(), "the vector path of the engine's C kernels (model/kernel_isa.py)")
    if limits := peers.vllm_isa_limits():
        res.add("vllm_isa", limits, "vLLM's run-time ISA (bench/peers.py)", row=False)
    rounds = ctx.pick(3, 2, smoke=1)
    new = ctx.pick(64, 64, smoke=8)
    nreq = 16
    ctx.start("prompts + kvscope engines")
    tok = load_model(ctx.model, "cpu")[1]
    prompts, source = C.chat_prompts(tok, nreq, seed=0, min_tokens=30, max_tokens=300)
    lens = [len(p) for p in prompts]
    shared = (prompts[0] * 40)[:1024]  # a 1k-token prefix of real chat tokens
    ttft_prompts = [shared + p[:16] for p in prompts[1:7]]
    res.add("workload", f"W{nreq}: {min(lens)}-{max(lens)}-token chat prompts, {new} new, greedy", source, row=False)
    ctx.done("prompts")

    # (a) batch-1 decode, kvscope at 1 and 2 threads, llama.cpp at 1 and 2 threads, alternating
    ctx.start("batch-1 decode: kvscope vs llama.cpp")
    p1, n1 = prompts[0], ctx.pick(64, 32, smoke=8)
    bs1: dict[str, list[float]] = {}
    llms = {
        t: C.make_llm(ctx, num_threads=t, max_num_seqs=2, num_kv_blocks=C.blocks_for([len(p1)], n1) + 8) for t in (1, 2)
    }
    # llama.cpp kept loaded at each thread count (peers.LlamaCppBs1), one pass after each of kvscope's
    lcs = {t: peers.LlamaCppBs1(default_gguf_path(), p1, n1, t, max_passes=rounds) for t in llms}
    try:
        for t, llm in llms.items():
            C.warm_up(llm, SamplingParams, p1)
        for i in range(rounds):
            for t, llm in llms.items():
                steps, secs, _ = decode_steps(llm, p1, C.greedy(SamplingParams, n1), f"peers-bs1-{t}-{i}")
                bs1.setdefault(f"kvscope_t{t}", []).append(steps / secs)
                rate = lcs[t].one()
                if rate is not None:
                    bs1.setdefault(f"llamacpp_t{t}", []).append(rate)
    finally:
        for llm in llms.values():
            C.free_llm(llm)
        for lc in lcs.values():
            lc.close()
    for t, lc in lcs.items():
        if lc.why is not None:
            res.add(f"llamacpp_t{t}_why", lc.why, "", row=False)
    ctx.done("batch-1")

    ctx.start("kvscope server + vLLM server")
    cfg = {
        "max_num_seqs": nreq,
        "num_kv_blocks": C.blocks_for(lens + [len(p) for p in ttft_prompts], new) + 128,
        "max_model_len": 4096,
    }
    llm = C.make_llm(ctx, **cfg)
    th = EngineThread(engine=llm.engine)
    port = free_port()
    server = run_in_background(create_app(th, model_name="bench", max_waiting=4096), "127.0.0.1", port)
    k = {"base": f"http://127.0.0.1:{port}", "model": "bench"}
    w16: dict[str, list[float]] = {"kvscope": [], "vllm": []}
    ttft: dict[str, list[float]] = {"kvscope": [], "vllm": []}
    texts: dict[str, list[str]] = {}
    try:
        with _Vllm() as v:
            ctx.done("servers up")
            sides = {"kvscope": k, "vllm": {"base": v.base, "model": "default"}}
            ctx.start("W16, agreement, TTFT (alternating)")
            for i in range(rounds):
                for name, s in sides.items():
                    out = _client({**s, "prompts": prompts, "new": new})
                    w16[name].append(_tok_s(out))
                    texts.setdefault(name, [r["text"] for r in out["results"]])
                    _client({**s, "prompts": [shared + [13]], "new": 1})  # the prefix now cached
                    for tp in ttft_prompts:
                        r = _client({**s, "prompts": [tp], "new": 1})["results"][0]
                        if r["times"]:
                            ttft[name].append(r["times"][0] - r["t0"])
            # vLLM batch-1 over HTTP: one stream, content-chunk gaps
            r = _client({**sides["vllm"], "prompts": [p1], "new": n1})["results"][0]
            gaps = [b - a for a, b in zip(r["times"], r["times"][1:])]
            if gaps:
                bs1["vllm_http_1stream"] = [1 / statistics.median(gaps)]
    finally:
        server.should_exit = True
        server.thread.join(10)
        th.shutdown()
        C.free_llm(llm)
    ctx.done("peers measured")

    ctx.start("summary")
    for key, xs in bs1.items():
        b, m = _best_median(xs)
        res.add(f"decode_bs1_{key}_tok_s", b, f"best of {len(xs)}; median {m:.1f}" if m else "")
    for t in (1, 2):
        kv, lc = bs1.get(f"kvscope_t{t}"), bs1.get(f"llamacpp_t{t}")
        if kv and lc:
            res.add(f"decode_bs1_vs_llamacpp_t{t}", max(kv) / max(lc), "kvscope / llama.cpp, best vs best (goal >= 1)")
    for name, xs in w16.items():
        b, m = _best_median(xs)
        res.add(f"w16_{name}_tok_s", b, f"HTTP, {nreq} concurrent, {new} tokens each; median {m:.1f}")
    if w16["kvscope"] and w16["vllm"]:
        res.add("w16_kvscope_vs_vllm", max(w16["kvscope"]) / max(w16["vllm"]), "best vs best (goal >= 1)")
    agree = _agreement(texts.get("kvscope", []), texts.get("vllm", []))
    res.add("greedy_identical", f"{sum(a['identical'] for a in agree)}/{len(agree)}", "W16 texts, kvscope vs vLLM fp32")
    res.add("greedy_first_divergence", [a["first_divergence_char"] for a in agree], "char index, None = identical")
    for name, xs in ttft.items():
        res.add(f"ttft_1k_prefix_{name}_p50_s", pct(xs, 0.5), f"{len(xs)} requests, 1k-token prefix cached")
    ctx.done("summary")
    return res


# public names for the other suites that drive the peers (engine/bench/scaling.py)
VllmServer = _Vllm
http_client = _client
http_tok_s = _tok_s
