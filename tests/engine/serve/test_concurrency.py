"""200 concurrent streamed requests against the server, a seeded third of them dropped by the
client mid-stream: every request finishes or is aborted, no block leaks (check_invariants, no
block owned afterwards), and the outputs of the finished ones equal LLM.generate."""

import asyncio
import concurrent.futures
import json
import random

import httpx

from engine import SamplingParams
from tests.waiting import wait_until

from .conftest import API_KEY

N_REQUESTS = 200
PROMPTS = [f"Request {i}: the scheduler admits waiting requests when blocks are free and" for i in range(10)] + [
    f"A shared system prompt for every tenant, then question {i}" for i in range(10)
]


async def one(client, i, rng_plan):
    prompt, max_tokens, drop_after = rng_plan
    body = {
        "model": "kvscope-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return i, text, True
            d = json.loads(line[6:])
            assert "error" not in d, d
            text += d["choices"][0]["text"]
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return i, text, False  # leaving the block closes the connection mid-stream
    return i, text, False


async def run_all(base, plans):
    limits = httpx.Limits(max_connections=N_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, limits=limits, timeout=httpx.Timeout(600.0)
    ) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(plans)))


def test_200_concurrent_streams_with_disconnects(server, llm):
    th = server.thread
    start_seq = th.events.last_seq
    rng = random.Random(13)
    plans = []
    for _ in range(N_REQUESTS):
        drop = rng.randint(1, 3) if rng.random() < 1 / 3 else None
        prompt, max_tokens = rng.choice(PROMPTS), rng.randint(3, 6)
        # a client that drops asks for a long answer, so it drops while its request still runs (on an
        # idle machine 3-6 tokens can all arrive before the client's first read, and nothing aborts)
        plans.append((prompt, 200 if drop is not None else max_tokens, drop))
    # a thread of its own: Playwright's sync API (the browser tests, same session) leaves an event
    # loop running in the main thread, where asyncio.run() refuses to start
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results = pool.submit(lambda: asyncio.run(run_all(server.base, plans))).result()
    # the server notices each dropped client and aborts its request; wait (bounded) for the engine to drain

    def drained() -> bool:
        with th.lock:
            return not th.engine.has_unfinished_requests()

    wait_until(drained, "the engine to drain after the dropped clients", 60, 0.05)
    with th.lock:
        th.engine.check_invariants()
        assert not th.engine.has_unfinished_requests()
        assert th.engine.bm.num_used_blocks == 0, "blocks still owned after every request ended"
        assert not [h for h in th.handles if h.startswith("http-")]
    events = th.events.since(start_seq)
    ended = {
        e.request_id: e.kind
        for e in events
        if e.kind in ("finish", "abort", "error") and (e.request_id or "").startswith("http-")
    }
    assert len(ended) == N_REQUESTS
    assert "error" not in ended.values()
    completed = [r for r in results if r[2]]
    dropped = [r for r in results if not r[2]]
    assert all(plans[i][2] is not None for i, _, _ in dropped) and len(dropped) >= 30
    n_abort = sum(1 for k in ended.values() if k == "abort")
    assert 0 < n_abort <= len(dropped)  # a client may drop after its request's last token
    # every completed stream equals the in-process reference
    refs = {}
    for prompt, max_tokens, _ in {(p[0], p[1], None) for p in plans}:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        refs[(prompt, max_tokens)] = out.outputs[0].text
    for i, text, _ in completed:
        prompt, max_tokens, _ = plans[i]
        assert text == refs[(prompt, max_tokens)], (i, prompt)
    # the server still serves
    r = httpx.post(
        server.base + "/v1/completions",
        headers=server.headers,
        json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200
