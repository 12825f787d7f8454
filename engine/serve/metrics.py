"""/metrics: vLLM's metric names, types and labels (its Prometheus logger's and its
speculative-decoding metrics'), read from the engine's own counters, plus kvscope: figures.

Gauges and counters are read from the engine at scrape time (a custom collector); histograms are
observed by a finish listener on the engine (MetricsTracker.subscribe) when each request
finishes or is aborted, cumulative since the server started. Labels: model_name and engine
("0"), as vLLM. No *_created series. The full mapping is in docs/SERVING.md."""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.observe import rates

prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values (+ error)
# vLLM's buckets
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    out, e = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**e
            if v > max_value:
                return out
            out.append(v)
        e += 1


class _EngineCollector:
    """Gauges and counters straight from the engine at scrape time."""

    def __init__(self, exporter: MetricsExporter):
        self.x = exporter

    def describe(self):
        return []

    def collect(self):
        th = self.x.thread
        lv = [self.x.model_name, "0"]
        snap = th.snapshot_now()
        m, info = snap.metrics, snap.info

        def g(name, doc, value, extra=None):
            fam = GaugeMetricFamily(name, doc, labels=list(LABELS) + ([k for k, _ in extra] if extra else []))
            fam.add_metric(lv + ([v for _, v in extra] if extra else []), value)
            return fam

        def c(name, doc, value):
            fam = CounterMetricFamily(name, doc, labels=list(LABELS))
            fam.add_metric(lv, value)
            return fam

        yield g("vllm:num_requests_running", "Number of requests in model execution batches.", m.num_running)
        yield g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.num_waiting)
        yield g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_cache_usage_perc)
        yield c(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_cache_queries,
        )
        yield c(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", m.prefix_cache_hits
        )
        yield c("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m.num_preemptions_total)
        yield c("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total)
        yield c("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens_total)
        spec = m.spec
        if info.speculative is not None:
            yield c("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield c("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield c("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)
            fam = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=list(LABELS) + ["position"],
            )
            k = max(spec.num_speculative_tokens, len(spec.accepted_per_position))
            acc = list(spec.accepted_per_position) + [0] * (k - len(spec.accepted_per_position))
            for pos in range(k):
                fam.add_metric(lv + [str(pos)], acc[pos])
            yield fam
            fam = CounterMetricFamily(
                "kvscope:spec_decode_num_drafts_per_pos",
                "Drafts that proposed a token at this position (per-position acceptance = accepted_per_pos / this).",
                labels=list(LABELS) + ["position"],
            )
            drafted = list(spec.drafts_per_position) + [0] * (k - len(spec.drafts_per_position))
            for pos in range(k):
                fam.add_metric(lv + [str(pos)], drafted[pos])
            yield fam
        # kvscope-only figures
        fam = GaugeMetricFamily(
            "kvscope:kv_blocks",
            "KV pool blocks by state: used (ref count >= 1), cached (ref count 0, still in the prefix cache), free.",
            labels=list(LABELS) + ["state"],
        )
        for state, v in (("used", m.num_blocks_used), ("cached", m.num_blocks_cached), ("free", m.num_blocks_free)):
            fam.add_metric(lv + [state], v)
        yield fam
        yield g("kvscope:kv_cache_bytes", "Bytes of the KV pool (K and V, all layers).", info.kv_cache_bytes)
        yield g("kvscope:kv_block_size", "Tokens per KV block.", info.block_size)
        yield g(
            "kvscope:kv_slots_waste_fraction",
            "Internal fragmentation: 1 - filled / allocated slots of the blocks owned by live requests.",
            m.waste_fraction,
        )
        yield g("kvscope:num_requests_swapped", "Requests swapped out to CPU memory.", m.num_swapped)
        yield g("kvscope:swap_blocks_used", "Swap-space blocks holding a swapped request's K/V.", m.swap_blocks_used)
        yield g("kvscope:swap_blocks_total", "Swap-space blocks.", m.swap_blocks_total)
        yield c("kvscope:num_swaps", "Cumulative number of swap-out preemptions.", m.num_swaps_total)
        yield c("kvscope:num_evictions", "Cumulative number of manual KV evictions.", m.num_evictions_total)
        yield c(
            "kvscope:num_requests_rejected", "Requests refused at admission (over a cap, bad input).", m.num_rejected
        )
        yield g("kvscope:engine_healthy", "1 while the engine loop runs, 0 after it crashed.", 1 if th.healthy else 0)


def served_max_model_len(thread) -> int:
    """The engine's max_model_len as resolved at startup (EngineConfig.max_model_len None: the
    model's own limit, memory permitting). An in-process engine's config holds the number; a core
    process's client keeps the caller's config, so its core is asked."""
    n = thread.config.max_model_len
    return n if n is not None else thread.snapshot_now().info.max_model_len


class MetricsExporter:
    def __init__(self, thread, model_name: str):
        self.thread = thread
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        lv = (model_name, "0")
        max_len = served_max_model_len(thread)

        def h(name, doc, buckets):
            return Histogram(name, doc, labelnames=LABELS, buckets=buckets, registry=self.registry).labels(*lv)

        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = h(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = h(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = h(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = h(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = h(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.max_gen = h(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            build_1_2_5_buckets(max_len),
        )
        self.prompt_len = h(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", build_1_2_5_buckets(max_len)
        )
        self.gen_len = h(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", build_1_2_5_buckets(max_len)
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=LABELS + ("finished_reason",),
            registry=self.registry,
        )
        self.success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        self.registry.register(_EngineCollector(self))
        self.num_observed = 0
        thread.engine.metrics.subscribe(self.on_finish)

    def on_finish(self, req) -> None:
        """Called on the engine thread for every finished / aborted request."""
        with self._lock:
            self.num_observed += 1
            reason = req.finish_reason if req.finish_reason in self.success else "abort"
            self.success[reason].inc()
            # TTFT, TPOT, ITL, e2e, queue / prefill / decode time: engine/observe/rates.py (req may be
            # the engine core's record)
            e2e = rates.e2e_latency(req.arrival_time, req.finish_time)
            if e2e is not None:
                self.e2e.observe(e2e)
            queued = rates.queue_time(req.arrival_time, req.first_scheduled_time)
            if queued is not None:
                self.queue.observe(max(0.0, queued))
            ttft = rates.ttft(req.arrival_time, req.first_token_time)
            if ttft is not None:
                self.ttft.observe(ttft)
            for gap in rates.itl(req.token_times):
                self.itl.observe(gap)
            tpot = rates.tpot(req.first_token_time, req.token_times, req.num_output_tokens)
            if tpot is not None:
                self.tpot.observe(tpot)
            prefill = rates.prefill_time(req.first_scheduled_time, req.first_token_time)
            if prefill is not None:
                self.prefill.observe(max(0.0, prefill))
                self.decode.observe(max(0.0, rates.decode_time(req.first_token_time, req.token_times)))
            self.prompt_len.observe(req.num_prompt_tokens)
            self.gen_len.observe(req.num_output_tokens)
            # vLLM observes the most generation tokens among a request's n choices; each engine
            # request here is one choice, so this is its own count (exact for n = 1)
            self.max_gen.observe(req.num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        self.thread.engine.metrics.unsubscribe(self.on_finish)
