"""One request's numbers agree wherever they are shown: the page's figures (the Load page's
latency percentiles, the request's phase stats, the Speculative page's summary and costs), the
API (RequestOutput.metrics, token counts) and /metrics' histograms and counters. Each is computed
by engine/observe/rates.py; the request is speculative, so a step that accepts drafts emits
several tokens at one time (no zero inter-token gap anywhere, as vLLM observes ITL per step)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams


def samples_of(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "position" not in s.labels and "le" not in s.labels:
                out.setdefault((s.name, s.labels.get("finished_reason")), s.value)
    return out


def test_page_api_and_metrics_agree_for_one_speculative_request(spec_thread):
    from engine.serve.metrics import MetricsExporter
    from ui.figures import growth, load, spec

    th = spec_thread
    x = MetricsExporter(th, "tiny")
    prompt = "one two three four one two three four one two three four one two three"
    out = th.submit(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).result(300)
    api = out.metrics
    m = samples_of(x.render().decode())
    snap = th.snapshot_now()
    info = snap.request(out.request_id)
    assert info is not None and api.spec_num_draft_tokens > 0

    def hist(name):
        return m[(f"vllm:{name}_sum", None)], m[(f"vllm:{name}_count", None)]

    # TTFT: the API, /metrics, the Load page's percentile (one request: p50 is it), phase stats
    assert hist("time_to_first_token_seconds") == (api.ttft, 1)
    assert load.latency_percentiles(snap)["ttft"][50] == pytest.approx(api.ttft)
    assert growth.phase_stats(info).ttft_s == api.ttft
    # e2e
    assert hist("e2e_request_latency_seconds") == (api.e2e_latency, 1)
    assert load.latency_percentiles(snap)["e2e"][50] == pytest.approx(api.e2e_latency)
    assert growth.phase_stats(info).e2e_s == api.e2e_latency
    # TPOT ends at the last token (vLLM's decode time), on every surface
    assert hist("request_time_per_output_token_seconds") == (api.tpot, 1)
    assert load.latency_percentiles(snap)["tpot"][50] == pytest.approx(api.tpot)
    costs = spec.measured_costs(info, None, [])
    assert costs.spec_per_token == api.tpot and costs.spec_e2e == api.e2e_latency
    # ITL: one gap per step that emitted tokens
    itl_sum, itl_count = hist("inter_token_latency_seconds")
    assert itl_count == len(api.itl) and itl_sum == pytest.approx(sum(api.itl))
    assert all(g > 0 for g in api.itl)
    n_out = len(out.outputs[0].token_ids)
    assert api.spec_num_accepted_tokens > 0  # some step emitted more than one token at one time
    assert len(api.itl) < n_out - 1
    # token counts: the API's and /metrics' counters
    assert m[("vllm:prompt_tokens_total", None)] == len(out.prompt_token_ids)
    assert m[("vllm:generation_tokens_total", None)] == n_out == info.output_len
    # acceptance: the request's (API, Speculative page) and the engine's (snapshot, /metrics)
    summary = spec.request_summary(info)
    assert summary.num_draft_tokens == api.spec_num_draft_tokens
    assert summary.num_accepted == api.spec_num_accepted_tokens
    assert summary.acceptance_rate == api.spec_num_accepted_tokens / api.spec_num_draft_tokens
    e = snap.metrics.spec
    assert m[("vllm:spec_decode_num_draft_tokens_total", None)] == e.num_draft_tokens == api.spec_num_draft_tokens
    assert m[("vllm:spec_decode_num_accepted_tokens_total", None)] == e.num_accepted_tokens
    assert e.acceptance_rate == summary.acceptance_rate
    # prefix hit rate: the snapshot's and /metrics' counters
    hits, queries = m[("vllm:prefix_cache_hits_total", None)], m[("vllm:prefix_cache_queries_total", None)]
    assert (hits, queries) == (snap.metrics.prefix_cache_hits, snap.metrics.prefix_cache_queries)
    assert snap.metrics.prefix_cache_hit_rate == (hits / queries if queries else 0.0)
