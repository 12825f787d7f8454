"""Screenshots and browser checks of the memory pages: Concurrent load, Prefix cache, Paged vs
contiguous, Cache vs no-cache, Replay.

They run against their own server (an extra env entry gives a separate, session-scoped
server), so the shared engine's state comes only from these tests. Shots are taken only of
states whose every pixel is deterministic: before a measurement, after step-counted runs
(greedy, EOS ignored, seeded workloads: the same steps and counts every time), and recorded
traces. Pages whose charts carry wall-clock times are checked for content, not pixels."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tests.browser.shot import (
    APP_SCRIPT,
    assert_no_exception,
    assert_screenshot,
    click_and_wait,
    main_text,
    open_page,
    wait_drawn,
)
from tests.factories import make_engine_info

pytestmark = pytest.mark.browser
MEMORY_ENV = {"KVSCOPE_TEST_SERVER": "memory-pages"}


@pytest.fixture(scope="module")
def mem_server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=MEMORY_ENV)


def test_direct_urls_and_initial_states(mem_server, page):
    # the first URL this server ever answers is a memory page (docs/DESIGN.md, "Pages and direct URLs")
    for path, shot, heading in (
        ("load", "mem_load_initial", "Concurrent load"),
        ("prefix_cache", "mem_prefix_cache_initial", "Prefix cache"),
        ("paged_vs_contiguous", "mem_paged_vs_contiguous_initial", "Paged vs contiguous"),
        ("cache_vs_nocache", "mem_cache_vs_nocache_initial", "Cache vs no-cache"),
    ):
        open_page(page, mem_server.url, path)
        assert page.locator("h1").first.inner_text().strip() == heading
        assert_screenshot(page, shot)


def test_replay_demo_trace(mem_server, page):
    open_page(page, mem_server.url, "replay")
    text = main_text(page)
    assert "model default" in text and "Engine step" in text
    assert page.locator(".js-plotly-plot").count() >= 5  # 4 over-time charts + pool map
    assert_screenshot(
        page, "mem_replay_demo", extra_css=".kvs-ev-wrap{visibility:hidden!important}"
    )  # see replay_batching


def test_paged_vs_contiguous_run(mem_server, page):
    open_page(page, mem_server.url, "paged_vs_contiguous")
    click_and_wait(page, page.get_by_role("button", name="Run both allocators"))
    assert_no_exception(page)
    text = main_text(page)
    assert "What the run shows" in text and "produced identical tokens" in text
    assert_screenshot(page, "mem_paged_vs_contiguous_run")


def test_cache_vs_nocache_exercise(mem_server, page):
    open_page(page, mem_server.url, "cache_vs_nocache")
    click_and_wait(page, page.get_by_role("button", name="Run the three engines"))
    assert_no_exception(page)
    text = main_text(page)
    assert "MemoryBudgetExceeded there" in text and "50 / 50" in text
    assert_screenshot(page, "mem_cache_vs_nocache_exercise")


def test_load_run_draws_engine_numbers(mem_server, page):
    open_page(page, mem_server.url, "load")
    click_and_wait(page, page.locator('[data-testid="stButtonGroup"]').get_by_text("mixed", exact=True))
    n = page.get_by_role("spinbutton", name="Requests", exact=True)
    n.fill("6")
    n.press("Tab")
    click_and_wait(page, page.get_by_role("button", name="Launch load"))
    assert_no_exception(page)
    text = main_text(page)
    assert "6 / 6" in text and "done" in text
    assert page.locator(".js-plotly-plot").count() >= 4
    assert "admit" in page.inner_text("table.kvs-ev")


def _hostile_trace() -> bytes:
    bad = '<img src=x onerror="window.__pwned=1">'
    svg = '"><svg onload="window.__pwned=2">'
    info = asdict(
        make_engine_info(
            model=bad, block_size=4, num_blocks=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64
        )
    )
    req = dict(
        request_id=svg,
        state="running",
        tier=None,
        prompt_len=3,
        output_len=1,
        num_computed_tokens=4,
        num_cached_tokens=0,
        block_table=[0],
        slots_allocated=4,
        kv_bytes=6144,
        waiting_reason="<script>window.__pwned=3</script>",
        prompt_preview=bad,
    )
    blocks = [
        dict(block_id=0, state="used", ref_count=1, owners=[svg], fill=4),
        *[dict(block_id=i, state="free", ref_count=0, owners=[], fill=0) for i in (1, 2, 3)],
    ]
    snap = dict(step=1, time=0.5, info=info, blocks=blocks, requests=[req], metrics={})
    ev = dict(
        seq=1,
        step=1,
        time=0.5,
        kind="preempt",
        request_id=svg,
        data={"reason": "<script>window.__pwned=4</script>\u202eevil\u200b", "mode": bad},
    )
    lines = [
        {"kind": "kvscope-trace", "version": 1},
        {"kind": "snapshot", "snapshot": snap},
        {"kind": "event", "event": ev},
    ]
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def test_replay_upload_hostile_and_bad_files(mem_server, page, tmp_path):
    open_page(page, mem_server.url, "replay")
    click_and_wait(page, page.get_by_text("Upload a file"))
    assert "Engine step" not in main_text(page)  # the demo is no longer shown
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_bytes(_hostile_trace())
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(hostile))
    page.wait_for_function("() => document.body.innerText.includes('model <img src=x')", timeout=120_000)
    wait_drawn(page)
    assert_no_exception(page)
    assert page.evaluate("() => window.__pwned === undefined")
    assert page.locator('img[src="x"]').count() == 0
    assert page.locator("svg[onload]").count() == 0
    assert "<script>window.__pwned=4</script>" in page.inner_text("table.kvs-ev")
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"kind": "kvscope-trace", "version": 1}\n{"kind": "snapshot", "snapshot": {"step": 1')
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(bad))
    page.wait_for_function("() => document.body.innerText.includes('Not a usable trace')", timeout=120_000)
    assert "trace line 2" in main_text(page)
