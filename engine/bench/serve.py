"""`python -m engine bench serve`: W16 through the OpenAI-compatible HTTP API with 16 concurrent
streams vs the same requests in-process (LLM.generate), in one run, on the same engine config.

The server runs in this process (EngineThread + uvicorn on 127.0.0.1, a free port); the clients
run in a child process (as real clients do, so they do not share this process's GIL), send token
-id prompts to /v1/completions with stream=true, and time every chunk: TTFT = first content chunk
- request sent, ITL = gaps between content chunks, as a client measures them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from engine.bench import common as C
from engine.bench.common import SuiteResult, kvscope_workload
from engine.observe import rates
from engine.serve.ports import free_port


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _client_run(spec: dict) -> dict:
    import asyncio

    import httpx

    async def one(i, prompt):
        body = {
            "model": spec["model"],
            "prompt": prompt,
            "max_tokens": spec["new"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        times, text, usage = [], "", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    usage = d["usage"]
                for ch in d.get("choices", []):
                    if ch.get("text"):
                        times.append(time.perf_counter())
                        text += ch["text"]
        return {"t0": t0, "times": times, "text": text, "usage": usage, "t_end": time.perf_counter()}

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=spec["base"], limits=limits, timeout=httpx.Timeout(3600.0)) as client:
        await one(-1, spec["prompts"][0][:16])  # warm-up (connection, first request)
        t = time.perf_counter()
        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(spec["prompts"])))
        wall = time.perf_counter() - t
    return {"wall": wall, "results": res}


def client_main() -> None:
    """Child-process entry: a JSON spec on stdin, one JSON result line on stdout."""
    import asyncio

    spec = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_client_run(spec))))


def run_client(spec: dict) -> dict:
    """Run `client_main` in a process of its own on `spec` (so the client's event loop and GIL
    are not the server's) and return its JSON result line."""
    p = subprocess.run(
        [sys.executable, "-c", "from engine.bench.serve import client_main; client_main()"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"client process failed: {p.stderr[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def suite_serve(ctx: C.BenchContext) -> SuiteResult:
    C.require_engine()
    from engine.core.thread import EngineThread
    from engine.serve import create_app, run_in_background

    res = SuiteResult()
    new = ctx.pick(64, 32, smoke=8)
    nreq = ctx.pick(16, 16, smoke=4)
    ctx.start("load model + W16 prompts")
    from engine.model.models import load_model

    tok = load_model(ctx.model, "cpu")[1]  # the engine's own tokenizer (cached with its model)
    prompts, source = C.chat_prompts(tok, nreq, seed=0, min_tokens=30, max_tokens=300)
    lens = [len(p) for p in prompts]
    res.add(
        "workload",
        f"W{nreq}: {nreq} chat prompts, {min(lens)}-{max(lens)} tokens, {new} new tokens each, "
        f"greedy, ignore_eos; {nreq} concurrent streams",
        source,
        row=False,
    )
    ctx.done("W16 ready")

    ctx.start("in-process LLM.generate")
    k_toks, k_wall, _ = kvscope_workload(ctx, prompts, new, "W16")
    inproc = sum(len(t) for t in k_toks) / k_wall
    res.add("inprocess_tok_s", inproc, f"LLM.generate, {sum(len(t) for t in k_toks)} tokens in {k_wall:.2f} s")
    ctx.done("in-process")

    ctx.start("HTTP API, 16 streams")
    cfg = {
        "max_num_seqs": max(nreq, 1),
        "num_kv_blocks": C.blocks_for(lens, new),
        "max_model_len": max(2048, max(lens) + new + 16),
    }
    llm = C.make_llm(ctx, **cfg)
    th = EngineThread(engine=llm.engine)
    port = free_port()
    server = run_in_background(create_app(th, model_name="bench", max_waiting=4096), "127.0.0.1", port)
    try:
        spec = {"base": f"http://127.0.0.1:{port}", "model": "bench", "prompts": prompts, "new": new}
        out = run_client(spec)
    finally:
        server.should_exit = True
        server.thread.join(10)
        th.shutdown()
        C.free_llm(llm)
    ctx.done("HTTP")

    ctx.start("summary")
    results = out["results"]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} HTTP request(s) failed: {errors[0]}")
    n_tok = sum(r["usage"]["completion_tokens"] for r in results)
    http = n_tok / out["wall"]
    ttft = [rates.ttft(r["t0"], r["times"][0]) for r in results if r["times"]]
    itl = [gap for r in results for gap in rates.itl(r["times"])]
    ref_text = [tok.decode(t, skip_special_tokens=True) for t in k_toks]
    match = sum(1 for r, ref in zip(results, ref_text) if r["text"] == ref)
    res.add(
        "http_tok_s",
        http,
        f"{nreq} concurrent streams to /v1/completions, {n_tok} tokens in "
        f"{out['wall']:.2f} s (clients in a child process)",
    )
    res.add("http_vs_inprocess", http / inproc if inproc else None, "goal >= 0.9")
    for q in (0.5, 0.9, 0.99):
        res.add(f"http_ttft_p{int(q * 100)}_s", pct(ttft, q), "first content chunk - request sent (client clock)")
    for q in (0.5, 0.9, 0.99):
        res.add(f"http_itl_p{int(q * 100)}_s", pct(itl, q), "gap between content chunks (client clock)")
    res.add("outputs_match", f"{match}/{nreq}", "HTTP text equals the in-process greedy text")
    ctx.done("summary")
    return res
