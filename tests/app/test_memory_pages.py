"""AppTest for the memory pages (pages/load.py, prefix_cache.py, paged_vs_contiguous.py,
cache_vs_nocache.py, replay.py): they render without exceptions, their controls drive the
engine, and what they show is the engine's numbers.

Test mode (KVSCOPE_TEST_MODE=1, tiny model): no live polling, so a launched load is run to
completion before the page draws; private-engine measurements use small sizes."""

from __future__ import annotations

import pytest

from tests.app import helpers as H

pytestmark = pytest.mark.usefixtures("tiny_test_mode")


@pytest.fixture
def run_page(app_test):
    """factory: run_page(name) runs pages/<name> once (checked for exceptions)."""
    return lambda name: H.run_ok(app_test(f"pages/{name}"))


# ------------------------------------------------------------------ concurrent load


def test_load_page_runs_a_workload_on_the_shared_engine(run_page):
    at = run_page("load.py")
    assert "No load launched" in at.info[0].value
    at.button_group(key="load_scenario").set_value("mixed").run()
    at.number_input(key="load_n").set_value(6)
    H.submit_form(at, "load_form", "Launch load")
    m = H.metrics(at)
    assert m["Submitted"] == ["6 / 6"]
    assert m["Rejected at submit"] == ["0"]
    assert len(at.get("plotly_chart")) == 5  # 4 over-time charts + the continuous-batching chart
    assert any("done" in c.value for c in at.caption)
    th = H.engine()
    snap = th.snapshot()
    finished = [r for r in snap.requests if r.request_id.startswith("L") and "-mix-" in r.request_id]
    assert finished and all(r.state == "finished" for r in finished)
    html = H.html(at)
    assert "kvs-ev" in html and ">admit<" in html and "p50" in html


def test_load_page_budget_control_changes_the_engine(run_page):
    th = H.engine()
    at = run_page("load.py")
    before = th.snapshot().info.num_blocks
    at.slider(key="load_budget").set_value(before - 8)
    H.submit_form(at, "budget_form", "Apply budget")
    assert th.snapshot_now().info.num_blocks == before - 8
    assert any(e.kind == "config" and e.data.get("num_blocks") == before - 8 for e in th.events.since(0))
    at.slider(key="load_budget").set_value(before)
    H.submit_form(at, "budget_form", "Apply budget")
    assert th.snapshot_now().info.num_blocks == before


def test_load_page_shows_engine_rejections(run_page):
    at = run_page("load.py")
    at.button_group(key="load_scenario").set_value("mixed").run()
    at.number_input(key="load_n").set_value(3)
    at.multiselect(key="load_tiers").set_value(["free"])
    at.number_input(key="load_omax").set_value(4000)  # prompt + max_tokens over the free tier's cap
    at.number_input(key="load_omed").set_value(4000)
    H.submit_form(at, "load_form", "Launch load")
    m = H.metrics(at)
    assert m["Rejected at submit"] == ["3"]
    assert any("refused or skipped at submission" in e.label for e in at.expander)
    assert any("context cap" in c.value for c in at.code)


# ------------------------------------------------------------------ prefix cache


def test_prefix_cache_page_measures_hits_on_the_engine(run_page):
    at = run_page("prefix_cache.py")
    at.text_area(key="pc_users").set_value(
        "first <script>alert(1)</script>\nsecond <img src=x onerror=alert(2)>\nthird"
    )
    at.slider(key="pc_max_tokens").set_value(32)  # the later turns share blocks for 32+ steps
    H.submit_form(at, "pc_form", "Measure with and without sharing")
    assert not at.error, [e.value for e in at.error]
    m = H.metrics(at)
    assert m["Hit rate with forced misses"] == ["0%"]
    assert int(m["Prefix hit rate (this run)"][0].rstrip("%")) > 0
    assert m["Blocks shared at peak"][0] != "0 (×0)"
    res = at.session_state["pc_result"]
    assert res["hit"][0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in res["hit"][1:])
    assert all(r.cached_tokens == 0 for r in res["miss"])
    assert len(at.get("plotly_chart")) == 2  # TTFT figure + pool map
    assert "<script>alert" not in H.html(at) and "<img src=x" not in H.html(at)
    c = res["comparison"]  # cold vs warm, alternated, 3 rounds
    assert c.names == ("miss", "cache") and c.rounds == 3
    assert any("median of 3 rounds" in str(x.value) for x in list(at.caption) + list(at.warning))
    # measured on a private engine: nothing of it ever entered the shared engine
    from ui.widgets import engine_access as ea

    assert not any(r.request_id.startswith(res["tag"]) for r in ea.get_engine().snapshot().requests)
    from ui.figures import prefix_sharing as PS

    cold = [r.ttft_s for r in res["miss"][1:]]
    warm = [r.ttft_s for r in res["hit"][1:]]
    saved = 1000 * (sum(cold) / len(cold) - sum(warm) / len(warm))
    assert PS.ttft_saved_ms(res["hit"], res["miss"]) == pytest.approx(saved)
    assert m["TTFT saved, later turns"] == [f"{saved:,.0f} ms"]


def test_prefix_cache_page_side_channel_and_salts(run_page):
    """The side-channel section: every cell measured each round, the shared-cache probes of a cached
    prefix hit it fully, the salted ones never do; the numbers shown are the probes'."""
    from engine.lab import side_channel as sc

    at = run_page("prefix_cache.py")
    assert any("Measure the side channel" in i.value for i in at.info)
    at.number_input(key="sc_prefix").set_value(16)
    at.number_input(key="sc_rounds").set_value(2)
    H.submit_form(at, "sc_form", "Measure the side channel")
    assert not at.error, [e.value for e in at.error]
    res = at.session_state["sc_result"]
    probes = res["probes"]
    assert len(probes) == 8 and res["prefix"] == 16
    assert all(p.hit_tokens == (16 if p.mode == "shared" and p.cached else 0) for p in probes)
    m = H.metrics(at)
    assert m["Cross-tenant sharing, shared"] == ["100%"] and m["Cross-tenant sharing, salted"] == ["0%"]
    thr = sc.threshold(probes)
    assert m["Guess right, per-tenant salt"] == [f"{100 * sc.accuracy(probes, 'salted', thr):.0f}%"]
    assert len(at.get("plotly_chart")) == 1


def test_prefix_cache_page_packet_sizes(run_page):
    """The packet-size section: answers streamed over TLS through the observer once per defence;
    the metrics shown are the result's accuracies, and the figures and table are drawn."""
    import shutil

    from engine.lab import packet_channel as pc

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    at = run_page("prefix_cache.py")
    assert any("Measure the packet sizes" in i.value for i in at.info)
    at.number_input(key="pk_trials").set_value(2)
    at.number_input(key="pk_cands").set_value(3)
    at.number_input(key="pk_new").set_value(6)
    H.submit_form(at, "pk_form", "Measure the packet sizes")
    assert not at.error, [e.value for e in at.error]
    res = at.session_state["pk_result"]
    assert len(res.trials) == 2 * len(pc.DEFENCES) and res.candidates == 3 and res.new_tokens == 6
    m = H.metrics(at)
    from ui.figures.side_channel import SHORT

    for s in res.summaries():
        assert m[f"Answer guessed: {SHORT[s.defence]}"] == [f"{100 * s.accuracy:.0f}%"]
    assert len(at.get("plotly_chart")) == 2
    assert len(at.dataframe) == 1


# ------------------------------------------------------------------ paged vs contiguous


def test_paged_vs_contiguous_page_reads_waste_from_snapshots(run_page):
    at = run_page("paged_vs_contiguous.py")
    at.number_input(key="pvc_n").set_value(10)
    H.submit_form(at, "pvc_form", "Run both allocators")
    res = at.session_state["pvc_result"]
    from ui.figures import allocators as AL

    sa, sb = AL.allocator_summary(res["paged"]), AL.allocator_summary(res["contiguous"])
    assert sa["allocator"] == "paged" and sb["allocator"] == "contiguous"
    assert sb["mean_waste"] > sa["mean_waste"] and sa["peak_running"] > sb["peak_running"]
    m = H.metrics(at)
    assert m["Peak running"] == [str(sa["peak_running"]), str(sb["peak_running"])]
    assert "10 of 10 requests produced identical tokens" in at.markdown[-1].value
    assert len(at.get("plotly_chart")) >= 2


# ------------------------------------------------------------------ cache vs no-cache


def test_cache_vs_nocache_counts_tokens_fed(run_page):
    at = run_page("cache_vs_nocache.py")
    at.number_input(key="cvn_n").set_value(16)
    at.number_input(key="cvn_p").set_value(10)
    H.submit_form(at, "cvn_cost_form", "Measure with and without the cache")
    m = H.metrics(at)
    # with the cache: one token per decode step; without: the whole context every step
    assert m["Tokens through the model, with cache"] == ["15"]
    assert m["Tokens through the model, no cache"] == [f"{sum(10 + i for i in range(1, 16)):,}"]


def test_cache_vs_nocache_exercise_three_runs(run_page):
    at = run_page("cache_vs_nocache.py")
    at.number_input(key="cvn_seqs").set_value(10)
    at.number_input(key="cvn_plen").set_value(8)
    at.number_input(key="cvn_growth").set_value(16)
    at.number_input(key="cvn_budget").set_value(8)
    H.submit_form(at, "cvn_ex_form", "Run the three engines")
    m = H.metrics(at)
    assert m["Finished"] == ["10 / 10"] * 3
    pre = [int(x) for x in m["Preemptions"]]
    assert pre[0] == 0 and pre[1] == 0 and pre[2] > 0
    assert int(m["Peak KV slots"][0].replace(",", "")) > 8 * 16  # A: past the budget
    assert all(int(x.replace(",", "")) <= 8 * 16 for x in m["Peak KV slots"][1:])
    assert "MemoryBudgetExceeded" in at.error[0].value


# ------------------------------------------------------------------ replay


def test_replay_page_scrubs_a_recorded_trace(run_page):
    at = run_page("replay.py")
    steps = []
    for tick in (0, 10, 40):
        at.slider(key="rp_tick").set_value(tick).run()
        assert not at.exception
        steps.append(int(H.metrics(at)["Engine step"][0]))
    assert steps[0] < steps[1] < steps[2]
    assert len(at.get("plotly_chart")) >= 4
    at.selectbox(key="rp_demo").set_value("shared-system-prompt.jsonl").run()
    assert not at.exception
    assert "prefix_hit" in H.html(at) or "admit" in H.html(at)
