"""`python -m engine bench scaling`: cost as the work grows, kvscope against llama.cpp and vLLM CPU
in one run, each point beside the machine's limit.

- prefill: TTFT of one request against its prompt length (128 -> 8k);
- decode: tokens/s of that same request's decode steps, at that context;
- concurrency: output tokens/s of N concurrent requests (1 -> 64), all sent at once.

kvscope runs in this process (prefill / decode: engine steps timed directly, as `bench roofline`
does; concurrency: its HTTP server, as vLLM is measured). llama.cpp runs the same GGUF in its peer
venv (engine/bench/peers.llamacpp_scaling); llama-cpp-python's API runs one sequence at a time,
so its concurrency point is N = 1 only. vLLM CPU is served from its peer venv with
max_model_len 8,192 and measured over HTTP by the same streaming client as kvscope's server. A
peer that is not installed is named in `peers` and the others still run; one that fails midway
keeps the points it measured. Every request's prompt is unique (a different window of filler
text), so no engine serves one from its prefix cache.

The engines take turns point by point (vLLM's server stays up, idle, while the others run): each
length, then each concurrency level, is measured on every engine within the same minute or two,
the order reversed from one point to the next, so a slow spell of the shared machine lands on all
engines' points at that x rather than on one engine's whole axis (measured one engine after the
other, a 2026-12-05 grid had both engines' 8k points 7-30% apart between runs of the same tree).

Limits (engine/bench/roofline.py's formulas, the one home of each):
- prefill: the prompt's FLOPs (workload_flops: linears, causal attention, one lm_head) at the peak
  matmul rate measured at the model's shapes -> a TTFT floor in seconds;
- decode: the bytes one step reads (the weights in the format kvscope reads them, plus the K/V of
  the context) at the measured read bandwidth (memory_roof_tok_s);
- concurrency: the lower of the workload's compute roof (compute_roof) and the batch-N memory roof.
The matmul rate and bandwidth are measured at the start and the end of the run; the best is used.

With KVSCOPE_BENCH_LOCK=<path> every timed segment holds an exclusive flock on that file (other
benchmarks on a shared machine wait; nothing else is timed meanwhile), and each segment's 1-minute
load average is stored beside its points."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from engine.bench import common as C
from engine.bench import peers
from engine.bench import scaling_points as SP
from engine.bench.common import SuiteResult
from engine.bench.machine_rates import measure_best_matmuls, measure_read_bandwidth
from engine.bench.roofline import ModelShape, compute_roof, memory_roof_tok_s, workload_flops
from engine.observe import rates


def prefill_limit_s(shape: ModelShape, peak_gflops: float, prompt_len: int) -> float:
    """The TTFT floor: the prompt's FLOPs (first token included) at the peak matmul rate."""
    return workload_flops(shape, [prompt_len], 1) / (peak_gflops * 1e9)


def decode_limit_tok_s(shape: ModelShape, bw_gb_s: float, dtype_bytes: int, weight_bytes: int, context: float) -> float:
    return memory_roof_tok_s(shape, bw_gb_s, dtype_bytes, context, weight_bytes=weight_bytes)


def concurrency_limit_tok_s(
    shape: ModelShape, peak_gflops: float, bw_gb_s: float, dtype_bytes: int, weight_bytes: int, n: int, p: int, new: int
) -> float:
    comp = compute_roof(shape, peak_gflops, [p] * n, new)["compute_roof_tok_s"]
    mem = memory_roof_tok_s(shape, bw_gb_s, dtype_bytes, p + new / 2, weight_bytes=weight_bytes, batch=n)
    return min(comp, mem)


def limits_for(shape: ModelShape, g: dict, roofs: dict, dtype_bytes: int) -> list[dict]:
    """The limit at every grid point (pure: the grid, the model shape, the measured rates)."""
    peak, bw, wb = roofs["peak_matmul_gflops"], roofs["mem_bw_gb_s"], roofs["weight_bytes_read_per_step"]
    out = []
    for L in g["lengths"]:
        out.append(
            {"axis": "prefill", "x": L, "value": prefill_limit_s(shape, peak, L), "basis": "FLOPs / peak matmul"}
        )
        ctx_mid = L + g["new_tokens"] / 2
        out.append(
            {
                "axis": "decode",
                "x": L,
                "value": decode_limit_tok_s(shape, bw, dtype_bytes, wb, ctx_mid),
                "basis": "bandwidth / (weights read + K/V)",
            }
        )
    for n in g["concurrency"]:
        v = concurrency_limit_tok_s(shape, peak, bw, dtype_bytes, wb, n, g["conc_prompt_len"], g["conc_new_tokens"])
        out.append({"axis": "concurrency", "x": n, "value": v, "basis": "min(compute roof, batch memory roof)"})
    return out


# the kvscope engines' warm-up request (vLLM's warm-up is the same token repeated): no filler window
# starts with it, so nothing a timed request reads comes from the prefix cache
WARM_UP_PROMPT = [13] * 32


FIRST_BLOCK = 16  # tokens: the smallest block any engine here caches prefixes by (kvscope's and vLLM's >= 16)


def take_windows(base: list[int], sizes: list[int], taken: set, start: int = 1) -> tuple[list[list[int]], int]:
    """Windows of `base` of the given sizes, each starting one token after the one before (from
    offset `start`), skipping any whose first block `taken` already holds: filler text repeats its
    sentences, and two prompts that begin alike would let a prefix cache serve the second's first
    block. Adds each window's first block to `taken`; returns the windows and the next offset."""
    out, off = [], start
    for n in sizes:
        while tuple(base[off : off + FIRST_BLOCK]) in taken:
            off += 1
        if off + n > len(base):
            raise ValueError(f"the filler text has no window of {n} tokens left from offset {off}")
        taken.add(tuple(base[off : off + FIRST_BLOCK]))
        out.append(base[off : off + n])
        off += 1
    return out, off


class _Segments:
    """Timed segments: each optionally under an exclusive flock ($KVSCOPE_BENCH_LOCK), with the
    1-minute load average at its start recorded."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.path = os.environ.get("KVSCOPE_BENCH_LOCK")
        self.log: list[dict] = []
        self.on_done = None  # called after each segment (the suite saves its points so far)

    @contextlib.contextmanager
    def __call__(self, name: str, lock: bool = True):
        """lock=False: a segment nothing is timed in (a server starting) leaves the lock to others."""
        self.ctx.start(name)
        f = open(self.path, "a") if (self.path and lock) else None  # noqa: SIM115 (closed below)
        try:
            if f is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
            load = round(os.getloadavg()[0], 2)
            t = time.perf_counter()
            rec = {"name": name, "load_1m": load}
            self.log.append(rec)
            yield rec
            rec["wall_s"] = time.perf_counter() - t
            if self.on_done is not None:
                self.on_done()
        finally:
            if f is not None:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            self.ctx.done(name)

    def load(self) -> float | None:
        return self.log[-1]["load_1m"] if self.log else None


def _measure_roofs(shape, dt, quick: bool, smoke: bool) -> tuple[dict, float]:
    rows = (16,) if smoke else (256, 512)
    mm, _ = measure_best_matmuls(shape, rows=rows, dtype=dt, min_time=0.01 if smoke else 0.3)
    m = max(mm, key=lambda r: mm[r]["all_gflops"])
    bw = measure_read_bandwidth(16 if smoke else (256 if quick else 1024))
    return {"gflops": mm[m]["all_gflops"], "rows": m, "kernel": mm[m]["kernel"]}, bw


def _kvscope_length(llm, SamplingParams, prompt: list[int], new: int, i: int) -> tuple:
    """(TTFT s, decode tok/s) of one request on the in-process engine, its steps timed directly."""
    marks = C.token_times(llm, prompt, C.greedy(SamplingParams, new), f"scaling-{i}")
    return (rates.ttft(marks[0][0], marks[1][0]) if len(marks) > 1 else None), C.decode_rate(marks)


def _http_point(base: dict, prompt: list[int], new: int) -> tuple[float | None, float | None]:
    """(TTFT s, decode tok/s) of one streamed request, as a client sees it."""
    from engine.bench.vs_peers import http_client

    r = http_client({**base, "prompts": [prompt], "new": new})["results"][0]
    times = r["times"]
    if not times:
        return None, None
    ttft = rates.ttft(r["t0"], times[0])
    n = (r.get("usage") or {}).get("completion_tokens") or len(times)
    dec = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return ttft, dec


def _http_concurrency(base: dict, prompts: list[list[int]], new: int) -> float:
    from engine.bench.vs_peers import http_client, http_tok_s

    return http_tok_s(http_client({**base, "prompts": prompts, "new": new}))


@contextlib.contextmanager
def _kvscope_server(ctx, max_seqs: int, max_len: int, blocks: int):
    from engine.core.thread import EngineThread
    from engine.serve import create_app, run_in_background
    from engine.serve.ports import free_port

    llm = C.make_llm(ctx, max_num_seqs=max_seqs, max_model_len=max_len, num_kv_blocks=blocks)
    th = EngineThread(engine=llm.engine)
    port = free_port()
    server = run_in_background(create_app(th, model_name="bench", max_waiting=4096), "127.0.0.1", port)
    try:
        yield {"base": f"http://127.0.0.1:{port}", "model": "bench"}
    finally:
        server.should_exit = True
        server.thread.join(10)
        th.shutdown()
        C.free_llm(llm)


def grid_prompts(tok, g: dict) -> list[tuple[list[list[int]], dict[int, list[list[int]]]]]:
    """The token ids a run of grid g measures, per round: one prompt per length, and N prompts of
    conc_prompt_len tokens per concurrency level N. No two prompts of the whole run (nor the
    warm-up) share a first block, so no engine's prefix cache serves any of them, in any round."""
    rounds = g.get("rounds", 1)
    base = C.filler_ids(tok, max(g["lengths"]) + rounds * len(g["lengths"]) + 64, seed=0)
    conc_base = C.filler_ids(tok, g["conc_prompt_len"] + rounds * sum(g["concurrency"]) + 64, seed=1)
    taken = {tuple(WARM_UP_PROMPT[:FIRST_BLOCK])}
    off, conc_off, out = 1, 1, []
    for _ in range(rounds):
        lengths, off = take_windows(base, g["lengths"], taken, off)
        conc = {}
        for n in g["concurrency"]:
            conc[n], conc_off = take_windows(conc_base, [g["conc_prompt_len"]] * n, taken, conc_off)
        out.append((lengths, conc))
    return out


def suite_scaling(ctx: C.BenchContext) -> SuiteResult:
    import torch

    from engine.model import kernel_isa

    _, SamplingParams, _ = C.require_engine()
    res = SuiteResult()
    try:
        g = SP.with_overrides(
            SP.grid(ctx.quick, ctx.smoke),
            os.environ.get("KVSCOPE_SCALING_LENGTHS"),
            os.environ.get("KVSCOPE_SCALING_CONCURRENCY"),
            os.environ.get("KVSCOPE_SCALING_ROUNDS"),
        )
    except ValueError as e:
        raise C.BenchUnavailable(str(e)) from None
    seg = _Segments(ctx)
    points: list[dict] = []
    peer_state: dict[str, str] = {}
    threads = C.torch_threads()

    model, tok = ctx.hf()
    shape = ModelShape.from_config(model.config)
    limit_model = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    max_len = max(SP.max_len_needed(g), 64)
    if limit_model and max_len > limit_model:
        raise C.BenchUnavailable(f"the grid needs {max_len} tokens, the model holds {limit_model}")
    dt = getattr(torch, ctx.dtype())
    dbytes = torch.tensor([], dtype=dt).element_size()
    per_round = grid_prompts(tok, g)
    rounds = len(per_round)

    partial = os.path.join(ctx.out_dir, "scaling-partial.json")

    def save_partial():  # a run cut short keeps what it measured (not read as a result: no stamp)
        import json

        with open(partial, "w") as f:
            json.dump(
                {"grid": g, "roofs_at_start": roofs0, "points": points, "peers": peer_state, "segments": seg.log}, f
            )

    roofs0: dict = {}
    seg.on_done = save_partial

    with seg("roofs (matmul, bandwidth)"):
        mm0, bw0 = _measure_roofs(shape, dt, ctx.quick, ctx.smoke)
    roofs0.update(peak_matmul_gflops=mm0["gflops"], mem_bw_gb_s=bw0)

    wanted = set((os.environ.get("KVSCOPE_SCALING_PEERS") or "llamacpp,vllm").split(","))
    vllm = _start_vllm(ctx, wanted, threads, max_len, seg, peer_state)
    gguf = _llamacpp_gguf(ctx, wanted, peer_state)
    up = {"vllm": vllm is not None, "llamacpp": gguf is not None}

    def order(i: int) -> list[str]:  # every engine still running, reversed at every other point
        es = ["kvscope"] + [e for e in ("vllm", "llamacpp") if up[e]]
        return es if i % 2 == 0 else es[::-1]

    def peer_point(e: str, fn):
        """A peer's measurement; one that raises or reports why it cannot go on is stopped."""
        try:
            out = fn()
        except Exception as ex:  # a peer failing must not lose the other engines' points
            out = {"why": f"failed: {type(ex).__name__}: {str(ex)[:300]}"}
        if isinstance(out, dict) and "why" in out:
            peer_state[e] = out["why"]
            up[e] = False
            return None
        return out

    def tag(rnd: int) -> str:  # a round's name in a segment's (none where the grid has one round)
        return f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""

    def point(axis: str, x: int, e: str, v, rnd: int) -> dict:
        return {"axis": axis, "x": x, "engine": e, "value": v, "load_1m": seg.load(), "round": rnd}

    def measure_length(llm, e: str, p: list[int], rnd: int, i: int):
        with seg(f"{SP.ENGINE_LABELS[e]}: length {len(p)}{tag(rnd)}"):
            if e == "kvscope":
                return _kvscope_length(llm, SamplingParams, p, g["new_tokens"], rnd * len(g["lengths"]) + i)
            if e == "vllm":
                return peer_point(e, lambda: _http_point(vllm[0], p, g["new_tokens"]))
            return peer_point(e, lambda: _llamacpp_job(gguf, p, g["new_tokens"], threads, max_len))

    def measure_concurrency(k: dict, e: str, ps: list[list[int]], rnd: int):
        with seg(f"{SP.ENGINE_LABELS[e]}: concurrency {len(ps)}{tag(rnd)}"):
            if e == "kvscope":
                return _http_concurrency(k, ps, g["conc_new_tokens"])
            if e == "vllm":
                return peer_point(e, lambda: _http_concurrency(vllm[0], ps, g["conc_new_tokens"]))
            r = peer_point(e, lambda: _llamacpp_job(gguf, ps[0], g["conc_new_tokens"], threads, max_len))
            return g["conc_new_tokens"] / r[2] if r is not None and r[2] else None

    try:
        llm = C.make_llm(
            ctx,
            max_num_seqs=2,
            max_model_len=max_len,
            num_kv_blocks=C.blocks_for([max(g["lengths"])], g["new_tokens"]) + 8,
        )
        try:
            # the warm-up shares no block with a measured prompt (a window of prompts[0] would leave
            # its first 32 tokens in the prefix cache, and the first length's TTFT would skip them)
            C.warm_up(llm, SamplingParams, WARM_UP_PROMPT)
            info = llm.engine.info()
            for rnd, (prompts, _) in enumerate(per_round):
                for i, p in enumerate(prompts):
                    # each engine first at every other point, and at each point in turn by round
                    for e in order(i + rnd):
                        r = measure_length(llm, e, p, rnd, i)
                        if r is not None:
                            for axis, v in zip(("prefill", "decode"), r[:2]):
                                points.append(point(axis, len(p), e, v, rnd))
                        if e == "llamacpp" and r is not None:
                            peer_state[e] = f"ok (llama-cpp-python {r[3]}, one sequence at a time)"
        finally:
            C.free_llm(llm)

        blocks = C.blocks_for([g["conc_prompt_len"]] * max(g["concurrency"]), g["conc_new_tokens"]) + 16
        with _kvscope_server(ctx, max(g["concurrency"]), max_len, blocks) as k:
            _http_concurrency(k, [WARM_UP_PROMPT[:16]], 2)  # warm-up
            for rnd, (_, conc) in enumerate(per_round):
                for j, (n, ps) in enumerate(conc.items()):
                    for e in order(j + rnd):
                        if e == "llamacpp" and n != 1:
                            continue
                        v = measure_concurrency(k, e, ps, rnd)
                        if v is not None:
                            points.append(point("concurrency", n, e, v, rnd))
    finally:
        if vllm is not None:
            vllm[1].__exit__(None, None, None)
    if up["vllm"]:
        peer_state["vllm"] = "ok" + peers.vllm_isa_label()

    with seg("roofs again"):
        mm1, bw1 = _measure_roofs(shape, dt, ctx.quick, ctx.smoke)
    mm_best = max((mm0, mm1), key=lambda m: m["gflops"])
    roofs = {
        "peak_matmul_gflops": mm_best["gflops"],
        "peak_matmul_rows": mm_best["rows"],
        "matmul_kernel": mm_best["kernel"],
        "mem_bw_gb_s": max(bw0, bw1),
        "weight_bytes_read_per_step": int(info.weight_bytes_per_step),
        "weight_format": info.weight_format,
        "kv_bytes_per_token": shape.kv_token_bytes(dbytes),
    }
    fields = {
        "grid": g,
        "roofs": roofs,
        "points": points,
        "limits": limits_for(shape, g, roofs, dbytes),
        "peers": peer_state,
        "isa": kernel_isa.summary(),
        "threads": threads,
        "max_model_len": max_len,
        "segments": seg.log,
    }
    for k_, v in fields.items():
        res.add(k_, v, row=False)
    rows = SP.table(fields)
    for r in rows:
        unit = SP.AXES[r["axis"]][1]
        note = ", ".join(f"{SP.ENGINE_LABELS[e]} {SP.fmt(r[e], unit)}" for e in SP.ENGINES[1:] if r[e] is not None)
        note += f"; limit {SP.fmt(r['limit'], unit)}"
        if r["vs_best_peer"] is not None:
            note += f"; vs best peer {r['vs_best_peer']:.2f}x"
        if r["of_limit"] is not None:
            note += f"; of limit {r['of_limit']:.2f}"
        res.rows.append((f"{r['axis']}_{r['x']}_kvscope_{unit.replace('/', '_')}", r["kvscope"], note))
    gl = SP.goals(rows, fields)
    res.add("goals", gl, row=False)
    for k_, v in gl.items():
        res.rows.append((k_, v, ""))
    for e, why in peer_state.items():
        res.rows.append((f"peer_{e}", why, ""))
    res.rows.append(("isa", fields["isa"], "the C kernels' path (engine/model/kernel_isa.py)"))
    res.rows.append(("peak_matmul_gflops", roofs["peak_matmul_gflops"], f"M={roofs['peak_matmul_rows']}, best of 2"))
    res.rows.append(("mem_bw_gb_s", roofs["mem_bw_gb_s"], "best of 2"))
    return res


def _start_vllm(ctx, wanted: set, threads: int, max_len: int, seg, peer_state: dict):
    """vLLM CPU's server for the run, as (client base, server), or None with the reason in
    peer_state (not wanted, not installed, another model, failed to start)."""
    from engine.bench.vs_peers import VllmServer

    if "vllm" not in wanted:
        peer_state["vllm"] = "not run: left out by $KVSCOPE_SCALING_PEERS"
    elif peers.vllm_command() is None:
        peer_state["vllm"] = f"not installed ({peers.peers_dir()}/vllm: scripts/peers.sh install-vllm)"
    elif ctx.model != "default":
        peer_state["vllm"] = f"not run: scripts/peers.sh serves the default model, not {ctx.model!r}"
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
        extra = os.environ.get("VLLM_EXTRA_ARGS", "")
        os.environ["VLLM_EXTRA_ARGS"] = f"{extra} --max-model-len {max_len}".strip()  # the last flag wins
        v = None
        try:
            with seg("vLLM: start (not timed, unlocked)", lock=False):
                v = VllmServer()
                v.__enter__()
                base = {"base": v.base, "model": "default"}
                _http_point(base, [13] * 8, 2)  # warm-up
            return base, v
        except Exception as e:  # a peer failing must not lose kvscope's and the other peer's points
            peer_state["vllm"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            if v is not None:
                v.__exit__(None, None, None)
        finally:
            os.environ["VLLM_EXTRA_ARGS"] = extra
    return None


def _llamacpp_gguf(ctx, wanted: set, peer_state: dict) -> str | None:
    """The GGUF llama.cpp runs (the model's own), or None with the reason in peer_state."""
    from engine.model.models import gguf_source

    if "llamacpp" not in wanted:
        peer_state["llamacpp"] = "not run: left out by $KVSCOPE_SCALING_PEERS"
        return None
    if peers.llamacpp_python() is None:
        peer_state["llamacpp"] = f"not installed (scripts/peers.sh install-llamacpp: {peers.LLAMACPP_PIN})"
        return None
    try:
        gguf = gguf_source(C.load_hf_model(ctx.model, ctx.dtype())[0])
    except Exception:
        gguf = None
    if not gguf:
        peer_state["llamacpp"] = f"no GGUF file for model {ctx.model!r}"
    return gguf or None


def _llamacpp_job(gguf: str, prompt: list[int], new: int, threads: int, max_len: int):
    """llama.cpp on the same GGUF, one request in its own subprocess (the model loads in about a
    second): (TTFT s, decode tok/s, wall s, llama-cpp-python version), or {"why"}."""
    lc = peers.llamacpp_scaling(gguf, [{"prompt": prompt, "n_new": new}], threads, n_ctx=max_len + 8)
    if "results" not in lc:
        return {"why": lc.get("why", "failed")}
    r = lc["results"][0]
    return r["ttft_s"], r["decode_tok_s"], r.get("wall_s"), lc.get("version")
