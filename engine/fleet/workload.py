"""Send a workload through the gateway and keep a ledger of every request (engine.fleet.state
RequestRow): who served it (the x-kvscope-instance header the router forwards), what each
instance held of its prefix when it was sent (from the collector's event-rebuilt caches), the
cached_tokens the server reported, the router's credited tokens (parsed from its debug log
where it logs them: kv_aware), and why a request got no hit.

Closed loop: each conversation's turns run in order (turn k+1 is sent when turn k finished, so
its prefix can be cached); at most `concurrency` conversations run at once. Arrival times of the
workload are not replayed.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from engine.fleet.state import (
    NO_HIT_ELSEWHERE,
    NO_HIT_EVICTED,
    NO_HIT_NEVER_STORED,
    PolicyRun,
    RequestRow,
)
from engine.observe import rates

INSTANCE_HEADER = "x-kvscope-instance"
REQUEST_TIMEOUT_S = 300.0


def release_freeze(n: int = 24, seed: int = 0, **params):
    """The release-freeze scenario of engine/lab/workloads.py (conversations that share repo
    context and grow turn by turn)."""
    from engine.lab.workloads import make_workload

    return make_workload("release-freeze", n, seed, **params)


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))
    return v[k]


def tokenize(urls: list[str], prompt: str, model: str, timeout: float = 10.0) -> list[int] | None:
    """The prompt's token ids from the first instance that answers /tokenize (as /v1/completions
    tokenizes a text prompt: no special tokens added)."""
    body = json.dumps({"model": model, "prompt": prompt, "add_special_tokens": False}).encode()
    for u in urls:
        try:
            req = urllib.request.Request(u + "/tokenize", data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return list(json.loads(r.read())["tokens"])
        except Exception:  # noqa: BLE001 - try the next instance
            continue
    return None


def _no_hit_reason(cached, held: dict, served_by: str, ever: bool, block_size: int) -> str:
    if cached is None or cached >= block_size:
        return ""
    if any(v > 0 for k, v in held.items() if k != served_by):
        return NO_HIT_ELSEWHERE
    return NO_HIT_EVICTED if ever else NO_HIT_NEVER_STORED


class Ledger:
    def __init__(self):
        self.rows: list[RequestRow] = []
        self.lock = threading.Lock()

    def add(self, row: RequestRow) -> None:
        with self.lock:
            self.rows.append(row)


def send_one(client, model: str, req, ids, collector, t0: float, policy: str, block_size: int) -> RequestRow:
    held = collector.held_prefix(ids) if (collector is not None and ids) else {}
    ever = collector.ever_stored(ids) if (collector is not None and ids) else False
    best = max(held.items(), key=lambda kv: (kv[1], kv[0] == ""), default=("", 0))
    best_holder, best_tokens = (best[0], best[1]) if best[1] > 0 else ("", 0)
    t_sent = time.perf_counter()
    served, ttft, usage, n_out, err = "", None, None, 0, ""
    try:
        with client.completions.with_streaming_response.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": bool(req.ignore_eos)},
        ) as resp:
            served = resp.headers.get(INSTANCE_HEADER, "") or ""
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and ttft is None:
                    ttft = rates.ttft(t_sent, time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as e:  # noqa: BLE001 - the ledger keeps the failure
        err = f"{type(e).__name__}: {str(e)[:300]}"
    e2e = time.perf_counter() - t_sent
    cached = None
    if usage:
        n_out = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
    return RequestRow(
        request_id=req.request_id,
        t_sent=round(t_sent - t0, 4),
        policy=policy,
        served_by=served,
        prompt_tokens=int(usage.get("prompt_tokens")) if usage else len(ids or ()),
        held_at_arrival=held,
        best_holder=best_holder,
        best_tokens=best_tokens,
        cached_tokens=cached,
        no_hit_reason="" if err else _no_hit_reason(cached, held, served, ever, block_size),
        ttft_s=round(ttft, 5) if ttft is not None else None,
        e2e_s=round(e2e, 5),
        output_tokens=n_out,
        error=err,
        conversation=req.conversation_id or "",
        turn=req.turn,
    )


def run_workload(
    router_url: str,
    model: str,
    requests,
    *,
    instance_urls: list[str],
    collector=None,
    policy: str = "",
    concurrency: int = 4,
    block_size: int = 16,
    on_row=None,
    stop: threading.Event | None = None,
    stream_out: list | None = None,
) -> list[RequestRow]:
    """Send `requests` (engine.lab.workloads.WorkloadRequest) through the gateway; returns the
    ledger in send order. `on_row(row)` is called as each request finishes (from a worker thread);
    `stream_out` gets one engine.fleet.whatif.StreamRequest per request (the what-if's input)."""
    import openai

    from engine.fleet.whatif import StreamRequest, block_keys

    if not 1 <= concurrency <= 64:
        raise ValueError(f"concurrency must be in [1, 64], got {concurrency}")
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    convs: dict[str, list] = defaultdict(list)
    for r in requests:
        convs[r.conversation_id or r.request_id].append(r)
    ledger = Ledger()
    t0 = time.perf_counter()
    ids_cache: dict[str, list[int] | None] = {}

    def run_conv(turns):
        for r in sorted(turns, key=lambda x: x.turn):
            if stop is not None and stop.is_set():
                return
            ids = ids_cache.get(r.prompt)
            if ids is None:
                ids = ids_cache[r.prompt] = tokenize(instance_urls, r.prompt, model)
            row = send_one(client, model, r, ids, collector, t0, policy, block_size)
            ledger.add(row)
            if stream_out is not None and ids:
                with ledger.lock:
                    stream_out.append(
                        StreamRequest(
                            r.request_id,
                            row.t_sent,
                            row.e2e_s or 0.0,
                            row.prompt_tokens,
                            block_keys(ids, block_size),
                            row.served_by,
                        )
                    )
            if on_row is not None:
                on_row(row)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="fleet-load") as ex:
        list(ex.map(run_conv, convs.values()))
    return sorted(ledger.rows, key=lambda r: r.t_sent)


_DECISION = re.compile(r'KV prefix decision .*?worker="([^"]+)" input_tokens=(\d+) .*?credited_prefix_tokens=(\d+)')


def router_credits(log_text: str) -> list[tuple[str, int, int]]:
    """vllm-router's kv_aware decisions from its debug log: (worker url, input tokens, credited)."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", log_text)
    return [(m.group(1), int(m.group(2)), int(m.group(3))) for m in _DECISION.finditer(clean)]


def attach_router_credits(rows: list[RequestRow], credits, url_of: dict[str, str]) -> list[RequestRow]:
    """Match each row to the first unused decision for (its serving instance's url, its prompt
    tokens), in log order; rows without a match keep router_credited=None."""
    from dataclasses import replace

    pool: dict[tuple, list[int]] = defaultdict(list)
    for url, n_in, credited in credits:
        pool[(url.rstrip("/"), n_in)].append(credited)
    out = []
    for r in rows:
        key = (url_of.get(r.served_by, "").rstrip("/"), r.prompt_tokens)
        got = pool.get(key)
        out.append(replace(r, router_credited=got.pop(0)) if got else r)
    return out


def summarize(
    policy: str,
    rows: list[RequestRow],
    wall_s: float,
    *,
    duplicated_blocks: int = 0,
    preemptions: int = 0,
    workload: str = "release-freeze",
    model: str = "",
) -> PolicyRun:
    ok = [r for r in rows if not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    per: dict[str, int] = defaultdict(int)
    for r in ok:
        per[r.served_by or "?"] += 1
    held_any = [r for r in ok if r.best_tokens > 0]
    on_best = sum(1 for r in held_any if r.held_at_arrival.get(r.served_by, 0) >= r.best_tokens)
    out_tokens = sum(r.output_tokens for r in ok)
    return PolicyRun(
        policy=policy,
        requests=len(rows),
        errors=len(rows) - len(ok),
        fleet_hit_rate=round(cached / prompt, 4) if prompt else None,
        ttft_p50_s=percentile([r.ttft_s for r in ok], 50),
        ttft_p99_s=percentile([r.ttft_s for r in ok], 99),
        output_tok_s=round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        wall_s=round(wall_s, 3),
        per_instance_requests=dict(per),
        duplicated_blocks=duplicated_blocks,
        preemptions=preemptions,
        landed_on_best=round(on_best / len(held_any), 4) if held_any else None,
        workload=workload,
        model=model,
    )


__all__ = [
    "attach_router_credits",
    "percentile",
    "release_freeze",
    "router_credits",
    "run_workload",
    "summarize",
    "tokenize",
]
