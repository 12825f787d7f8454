"""ui/figures/vllm_metrics.py: vLLM-named /metrics text -> numbers -> figures (no browser)."""

import pytest

from tests.attach_stubs import vllm_metrics_text
from ui.figures import vllm_metrics as vm


def _hist(n_scrapes, **kw):
    return [vm.parse_metrics(vllm_metrics_text(n, **kw), t=float(n)) for n in range(1, n_scrapes + 1)]


def test_parse_sums_label_sets_and_reads_histograms():
    s = vm.parse_metrics(vllm_metrics_text(3) + 'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n')
    assert vm.value(s, vm.RUNNING) == 4 + 2  # 3 + 3 % 2 from the stub, plus the second engine
    assert vm.value(s, vm.KV_USAGE) == 0.25 and vm.value(s, vm.PREEMPTIONS) == 1
    bounds, counts = vm.histogram(s, vm.TTFT)
    assert bounds == [0.01, 0.05, 0.1, 0.5, 1.0, float("inf")] and counts == [0, 3, 3, 6, 6, 6]
    assert vm.value(s, "vllm:no_such_metric") is None and vm.histogram(s, ("vllm:nope",)) is None


def test_quantile_interpolates_like_histogram_quantile():
    b, c = [0.01, 0.05, 0.1, 0.5, 1.0, float("inf")], [0, 3, 3, 6, 6, 6]
    assert vm.quantile(b, c, 0.5) == pytest.approx(0.05)
    assert vm.quantile(b, c, 0.9) == pytest.approx(0.1 + 0.4 * 0.8)
    assert vm.quantile(b, c, 0.99) == pytest.approx(0.1 + 0.4 * 0.98)
    assert vm.quantile(b, [0, 0, 0, 0, 0, 0], 0.5) is None
    assert vm.quantile([1.0, float("inf")], [0, 5], 0.5) == 1.0  # in +Inf: the highest finite bound


def test_rows_window_rates_and_percentiles():
    rs = vm.rows(_hist(30), window_s=10.0)
    last = rs[-1]
    assert (last.running, last.waiting, last.kv_usage, last.preemptions) == (3, 1, 0.25, 15)
    assert last.hit_rate == pytest.approx(0.4)  # 4 hits per 10 queried tokens
    assert last.ttft[0.5] == pytest.approx(0.05) and last.ttft[0.9] == pytest.approx(0.42)
    assert last.itl[0.5] == pytest.approx(0.0075)
    assert rs[0].hit_rate == pytest.approx(0.4)  # first scrape: everything since start


def test_acceptance_missing_and_figures():
    full = _hist(2)
    assert vm.acceptance_per_position(full[-1]) == [(0, 0.8), (1, 0.5), (2, 0.25)]
    assert vm.missing(full[-1]) == []
    bare = vm.parse_metrics(vllm_metrics_text(2, spec=False, itl=False))
    assert vm.acceptance_per_position(bare) == []
    assert vm.missing(bare) == ["inter-token latency", "speculative acceptance per position"]
    rs = vm.rows(full)
    assert [t.name for t in vm.queue_figure(rs).data] == ["running", "waiting"]
    assert list(vm.latency_figure(rs, "ttft").data[0].y) == [pytest.approx(50.0)] * 2  # p50 in ms
    assert list(vm.acceptance_figure(vm.acceptance_per_position(full[-1])).data[0].y) == [0.8, 0.5, 0.25]
    assert list(vm.kv_figure(vm.rows(_hist(1, spec=False))).data[0].y) == [25.0]


def test_bad_metrics_text_is_a_value_error():
    with pytest.raises(ValueError, match="Prometheus"):
        vm.parse_metrics("vllm:x{le= 1\n")
    with pytest.raises(ValueError):
        vm.parse_metrics(b"bytes")
