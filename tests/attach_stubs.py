"""Stub servers for the Attach page's tests, on 127.0.0.1 only, each with bounded loops.

- VllmStub: an HTTP server answering GET /metrics in vLLM's metric names (hand-written exposition
  text whose counters grow with every scrape) and POST /tokenize, plus a ZeroMQ PUB socket and a
  replay ROUTER sending KV-event batches written as literal msgpack structures (either wire form),
  one per `pump()`.
- KvscopeStub: GET /v1/kvscope/snapshot and GET /v1/kvscope/stream (SSE, `?since=`) serving
  snapshots and events recorded from a real tiny-model engine run.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import zmq

# ------------------------------------------------------------------ vLLM-format metrics

TTFT_BOUNDS = (0.01, 0.05, 0.1, 0.5, 1.0)
ITL_BOUNDS = (0.005, 0.01, 0.05, 0.1)


def vllm_metrics_text(n: int, *, spec: bool = True, itl: bool = True, block_size: int | None = 16) -> str:
    """Scrape number n: each scrape 10 more prefix-cache queries (4 hits), 2 more requests with
    TTFT 0.03 s and 0.2 s, 10 more ITL observations of 0.008 s, one more preemption every 2 scrapes."""
    lab = 'engine="0",model_name="stub-model"'
    out = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {3 + n % 2}.0",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} 1.0",
    ]
    if block_size is not None:  # vLLM's info gauge: CacheConfig fields as labels, value 1
        out += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",'
            f'engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="1000"}} 1.0',
        ]
    out += [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.25",
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{lab}}} {n // 2}.0",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{lab}}} {10 * n}.0",
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{{{lab}}} {4 * n}.0",
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for b in TTFT_BOUNDS:
        c = (n if b >= 0.03 else 0) + (n if b >= 0.2 else 0)
        out.append(f'vllm:time_to_first_token_seconds_bucket{{{lab},le="{b}"}} {c}.0')
    out += [
        f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {2 * n}.0',
        f"vllm:time_to_first_token_seconds_count{{{lab}}} {2 * n}.0",
        f"vllm:time_to_first_token_seconds_sum{{{lab}}} {0.23 * n}",
    ]
    if itl:
        out += [
            "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.",
            "# TYPE vllm:inter_token_latency_seconds histogram",
        ]
        for b in ITL_BOUNDS:
            out.append(f'vllm:inter_token_latency_seconds_bucket{{{lab},le="{b}"}} {10 * n if b >= 0.008 else 0}.0')
        out += [
            f'vllm:inter_token_latency_seconds_bucket{{{lab},le="+Inf"}} {10 * n}.0',
            f"vllm:inter_token_latency_seconds_count{{{lab}}} {10 * n}.0",
            f"vllm:inter_token_latency_seconds_sum{{{lab}}} {0.08 * n}",
        ]
    if spec:
        out += [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{{{lab}}} {100 * max(n, 1)}.0",
            "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
        ]
        for pos, rate in enumerate((0.8, 0.5, 0.25)):
            out.append(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{pos}"}} {rate * 100 * max(n, 1)}'
            )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ KV event batches, as literals


def stored(hashes, parent, tokens, bs, wire):
    if wire == "legacy":
        return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", None]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes, wire):
    if wire == "legacy":
        return ["BlockRemoved", hashes, "GPU"]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def demo_batches(wire: str, tokens_a, tokens_b, bs: int) -> list[bytes]:
    """Two requests sharing their first block: chain 1->2 and 1->3, then block 2 evicted."""
    ev1 = [stored([1, 2], None, list(tokens_a[: 2 * bs]), bs, wire)]
    ev2 = [stored([3], 1, list(tokens_b[bs : 2 * bs]), bs, wire)]
    ev3 = [removed([2], wire)]
    return [msgpack.packb([float(i), evs, 0], use_bin_type=True) for i, evs in enumerate((ev1, ev2, ev3))]


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass


class VllmStub:
    """A vLLM stand-in: /metrics in vLLM's names, /tokenize, /kv_event_sources, and a KV-events
    PUB + replay ROUTER. publisher="connect" (the default) does what vLLM does for a concrete
    endpoint such as tcp://127.0.0.1:5557: its PUB socket CONNECTS there and the subscriber must
    bind it. publisher="bind" binds 127.0.0.1 (what vLLM does for tcp://*:PORT or ipc://)."""

    def __init__(
        self,
        payloads: list[bytes],
        *,
        tokenizer=None,
        spec: bool = True,
        itl: bool = True,
        api_key: str | None = None,
        publisher: str = "connect",
        sources_route: bool = True,
        sources_by_rank: bool = False,
    ):
        stub = self
        self.scrapes = 0
        self.payloads = payloads
        self.sent = 0
        self.api_key = api_key

        class H(_Quiet):
            def _auth(self):
                if stub.api_key and self.headers.get("Authorization") != f"Bearer {stub.api_key}":
                    self.send_response(401)
                    self.end_headers()
                    return False
                return True

            def do_GET(self):
                if not self._auth():
                    return
                if self.path == "/kv_event_sources" and sources_route:
                    src = {"data_parallel_rank": 0, "endpoint": stub.events_endpoint}
                    src |= {"replay_endpoint": stub.replay_endpoint, "topic": ""}
                    # vLLM 0.33: a list; vLLM CPU 0.32: {"0": the whole KVEventsConfig}
                    body = json.dumps({"0": src | {"publisher": "zmq"}} if sources_by_rank else [src]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path != "/metrics":
                    self.send_response(404)
                    self.end_headers()
                    return
                stub.scrapes += 1
                body = vllm_metrics_text(stub.scrapes, spec=spec, itl=itl).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                if not self._auth():
                    return
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(min(n, 1 << 20)))
                if self.path != "/tokenize" or tokenizer is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                toks = tokenizer.encode(req["prompt"], add_special_tokens=req.get("add_special_tokens", True))
                body = json.dumps({"tokens": list(toks), "count": len(toks)}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._http_thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._http_thread.start()
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if publisher == "bind":
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            probe = ctx.socket(zmq.PUB)  # a free loopback port for the subscriber to bind
            port = probe.bind_to_random_port("tcp://127.0.0.1")
            probe.close(linger=0)
            self.pub.connect(f"tcp://127.0.0.1:{port}")
        self.events_endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"

    def pump(self) -> None:
        """Publish the next batch (if any) and answer pending replay requests (vLLM 0.33 framing)."""
        if self.sent < len(self.payloads):
            self.pub.send_multipart((b"", self.sent.to_bytes(8, "big"), self.payloads[self.sent]))
            self.sent += 1
        while self.router.poll(0):
            ident, _, start = self.router.recv_multipart()
            s = int.from_bytes(start, "big")
            for seq in range(s, self.sent):
                self.router.send_multipart((ident, b"", b"", seq.to_bytes(8, "big"), self.payloads[seq]))
            self.router.send_multipart((ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pub.close(linger=0)
        self.router.close(linger=0)


class KvscopeStub:
    """Serves recorded (snapshot, events) pairs: /v1/kvscope/snapshot gives the last snapshot,
    /v1/kvscope/stream sends every pair with events newer than ?since= and closes."""

    def __init__(self, frames):
        self.frames = frames  # [(Snapshot, [Event])]
        self.stream_calls = 0
        stub = self

        class H(_Quiet):
            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == "/v1/kvscope/snapshot":
                    body = json.dumps(stub.frames[-1][0].to_dict()).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif path == "/v1/kvscope/stream":
                    stub.stream_calls += 1
                    since = int(dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("since", 0))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    # the first stream replays the recording; a reconnect starts at the current state
                    for snap, evs in stub.frames if stub.stream_calls == 1 else stub.frames[-1:]:
                        msg = {"snapshot": snap.to_dict(), "events": [e.to_dict() for e in evs if e.seq > since]}
                        self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                    self.wfile.flush()
                else:
                    self.send_response(404)
                    self.end_headers()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def record_frames(engine, prompts, params, every: int = 2):
    """Run prompts on an LLMEngine and keep (snapshot, new events) every `every` steps."""
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    frames, seq, step = [], 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step % every == 0 or not engine.has_unfinished_requests():
            evs = engine.events.since(seq)
            seq = engine.events.last_seq
            frames.append((engine.snapshot(), evs))
    return frames


def stub_engine():
    """The tiny-model engine whose run the kvscope stub serves (a small pool of 8-token blocks)."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=24, block_size=8, max_model_len=128))


def record_stub_run(engine):
    """record_frames of four prompts sharing a 20-token prefix, 5 greedy tokens each."""
    from engine import SamplingParams

    prompts = [[1] * 20 + [i] * 5 for i in range(2, 6)]
    return record_frames(engine, prompts, SamplingParams(max_tokens=5, temperature=0))
