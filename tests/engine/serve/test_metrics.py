"""/metrics: parses with prometheus_client's parser, carries vLLM's names, types and labels, no
*_created series, and agrees with the engine's Snapshot; histograms count every finished request."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams

VLLM = {  # name (as the parser reports it) -> type, as vLLM's Prometheus logger declares them
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}
SPEC = {
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
}


def parse(text):
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {}
    for f in fams.values():
        for s in f.samples:
            samples.setdefault(s.name, []).append(s)
    return fams, samples


def value(samples, name, **labels):
    got = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, samples.get(name))
    return got[0]


def test_metrics_names_types_labels_and_snapshot_agree(server):
    h = server.headers
    for i in range(3):  # some traffic, one repeated prompt for prefix-cache hits
        r = httpx.post(
            server.base + "/v1/completions",
            headers=h,
            timeout=120,
            json={"prompt": "a long shared prefix of several blocks, repeated " * 2, "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200
    text = httpx.get(server.base + "/metrics", headers=h).text
    snap = httpx.get(server.base + "/v1/kvscope/snapshot", headers=h).json()
    fams, samples = parse(text)
    for name, typ in VLLM.items():
        assert fams[name].type == typ, name
    assert not [n for n in samples if n.endswith("_created")]
    for s in samples["vllm:num_requests_running"] + samples["vllm:e2e_request_latency_seconds_count"]:
        assert s.labels["model_name"] == "kvscope-tiny" and s.labels["engine"] == "0"
    assert {s.labels["finished_reason"] for s in samples["vllm:request_success_total"]} == {
        "stop",
        "length",
        "abort",
        "error",
    }
    # idle server: the metrics are the snapshot's
    m = snap["metrics"]
    lab = {"model_name": "kvscope-tiny"}
    assert value(samples, "vllm:num_requests_running", **lab) == m["num_running"] == 0
    assert value(samples, "vllm:num_requests_waiting", **lab) == m["num_waiting"] == 0
    assert value(samples, "vllm:kv_cache_usage_perc", **lab) == pytest.approx(m["kv_cache_usage_perc"])
    assert value(samples, "vllm:prefix_cache_queries_total", **lab) == m["prefix_cache_queries"] > 0
    assert value(samples, "vllm:prefix_cache_hits_total", **lab) == m["prefix_cache_hits"] > 0
    assert value(samples, "vllm:num_preemptions_total", **lab) == m["num_preemptions_total"]
    assert value(samples, "vllm:prompt_tokens_total", **lab) == m["prompt_tokens_total"] > 0
    assert value(samples, "vllm:generation_tokens_total", **lab) == m["generation_tokens_total"] > 0
    blocks = {st: value(samples, "kvscope:kv_blocks", state=st) for st in ("used", "cached", "free")}
    assert blocks == {"used": m["num_blocks_used"], "cached": m["num_blocks_cached"], "free": m["num_blocks_free"]}
    # histograms: one observation per request that ended (finished or aborted) since the server started
    ended = sum(s.value for s in samples["vllm:request_success_total"])
    exporter = server.app.state.kvscope.metrics
    assert ended == exporter.num_observed >= 3
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **lab) == ended
    assert value(samples, "vllm:request_queue_time_seconds_count", **lab) <= ended
    assert value(samples, "vllm:e2e_request_latency_seconds_bucket", le="+Inf", **lab) == ended
    assert value(samples, "vllm:time_to_first_token_seconds_count", **lab) <= ended
    # ITL: one gap per step after the first token; generation tokens bound it from above
    assert 0 < value(samples, "vllm:inter_token_latency_seconds_count", **lab) <= m["generation_tokens_total"]
    # the dashboard's phase panels: prefill + decode per request with a first token, and the
    # max-generation histogram summing to the generation-tokens histogram (n = 1 requests)
    ttft_n = value(samples, "vllm:time_to_first_token_seconds_count", **lab)
    assert value(samples, "vllm:request_prefill_time_seconds_count", **lab) == ttft_n > 0
    assert value(samples, "vllm:request_decode_time_seconds_count", **lab) == ttft_n
    assert value(samples, "vllm:request_max_num_generation_tokens_count", **lab) == ended
    assert value(samples, "vllm:request_max_num_generation_tokens_sum", **lab) == value(
        samples, "vllm:request_generation_tokens_sum", **lab
    )
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
        assert fams[name].type == "histogram"


def test_spec_decode_metrics_agree_with_the_engine(spec_thread):
    from engine.serve.metrics import MetricsExporter

    th = spec_thread
    x = MetricsExporter(th, "tiny")
    prompt = "one two three four one two three four one two three four one two three"
    th.submit(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).result(300)
    fams, samples = parse(x.render().decode())
    spec = th.snapshot_now().metrics.spec
    for name, typ in SPEC.items():
        assert fams[name].type == typ, name
    assert spec.num_drafts > 0
    assert value(samples, "vllm:spec_decode_num_drafts_total") == spec.num_drafts
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == spec.num_accepted_tokens
    per_pos = [value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert per_pos == list(spec.accepted_per_position) and sum(per_pos) == spec.num_accepted_tokens
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert not [n for n in samples if n.endswith("_created")]
