"""Screenshots of the pages in meaningful states, not only their empty ones (issue 15 item 8):
Memory calculator with a real model's numbers, the release-freeze load mid-run and finished,
the prefix cache with a result, and a tour that opens every page of the app once.

Pixel baselines are taken only of states whose every pixel is deterministic. The live Load and
Prefix cache pages plot wall-clock times (arrival times, TTFT), so their "mid-run", "finished"
and "result" baselines are shot on the Replay page from the traces recorded on the default model
(assets/traces/): the same charts, pool map and event log those pages draw, read as a user of the
real model sees them, at a chosen tick. The live pages are still driven to their finished state
here and checked for content (engine counts, no exception).

Own server (an extra env entry gives a separate session-scoped server), so these shots do not
depend on what other browser test files did to the shared engine."""

from __future__ import annotations

import pytest

from tests.browser.shot import (
    APP_SCRIPT,
    OUT_DIR,
    assert_no_exception,
    assert_screenshot,
    choose_option,
    click_and_wait,
    main_text,
    open_page,
    rerun_after,
    take_screenshot,
)

pytestmark = pytest.mark.browser
STATES_ENV = {"KVSCOPE_TEST_SERVER": "page-states"}

# (url path, expected h1) of every page, Home first: the order of app.PAGES
ALL_PAGES = (
    ("", "kvscope"),
    ("playground", None),
    ("load", "Concurrent load"),
    ("speculative", None),
    ("prefix_cache", "Prefix cache"),
    ("memory_calculator", "Memory calculator"),
    ("paged_vs_contiguous", "Paged vs contiguous"),
    ("cache_vs_nocache", "Cache vs no-cache"),
    ("replay", "Replay"),
)


@pytest.fixture(scope="module")
def states_server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=STATES_ENV)


def _metric(page, label: str) -> str:
    box = page.locator('[data-testid="stMetric"]', has_text=label).first
    return box.locator('[data-testid="stMetricValue"]').inner_text().strip()


def _set_number(page, label: str, value: int) -> None:
    box = page.get_by_role("spinbutton", name=label, exact=True)

    def act():
        box.fill(str(value))
        box.press("Enter")

    rerun_after(page, act, what=f"setting {label!r} to {value}")
    page.evaluate("() => document.activeElement && document.activeElement.blur()")  # no focus ring in shots


def _open_demo_trace(page, url: str, name: str) -> None:
    open_page(page, url, "replay")
    if name != "release-freeze":  # the first demo (sorted by name) is shown by default
        choose_option(page, "Demo trace", name)


# ------------------------------------------------------------------------- memory calculator


def test_memory_calculator_mistral_7b_long_context(states_server, page):
    """A real published config (Mistral-7B v0.2: 32 layers, GQA with 8 KV heads of 128), bf16 KV,
    16 sequences of 32,768 tokens on an 80 GiB GPU with bf16 weights: the byte counts are exact
    integer arithmetic, checked here by hand."""
    open_page(page, states_server.url, "memory_calculator")
    choose_option(page, "Preset", "Mistral-7B")
    _set_number(page, "Context length (tokens per sequence)", 32768)
    _set_number(page, "Concurrent sequences", 16)
    assert_no_exception(page)
    # 2 (K,V) x 32 layers x 8 KV heads x 128 head dim (4096 / 32 heads) x 2 bytes (bf16)
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_token == 131_072
    assert _metric(page, "KV bytes per token") == f"{per_token:,} B"
    assert _metric(page, "KV per sequence") == "4 GiB"  # 131,072 x 32,768 = 4 x 2^30
    text = main_text(page)
    assert "Mistral-7B (v0.2): GQA" in text
    assert "they fit" in text
    assert page.locator(".js-plotly-plot").count() == 3
    assert_screenshot(page, "states_memory_calculator_mistral_7b")


# ------------------------------------------------------------------------- load (replayed)


def test_load_mid_run_replayed(states_server, page):
    """Release-freeze on the default model, at the busiest recorded tick (the Replay page's
    default): requests running and waiting, blocks in use, per-request rows."""
    _open_demo_trace(page, states_server.url, "release-freeze")
    text = main_text(page)
    assert "model default" in text
    running, waiting = (int(x) for x in _metric(page, "Running/waiting").split(" / "))
    assert running + waiting > 0
    assert page.locator(".js-plotly-plot").count() == 6  # 5 load charts + the continuous-batching chart
    assert_screenshot(page, "states_load_mid_run_replayed", extra_css=".kvs-ev-wrap{visibility:hidden!important}")


def test_load_live_finished(states_server, page):
    """The live Load page driven to the end in test mode (the page waits for the run to drain
    before drawing). Wall-clock charts vary run to run, so this checks content; the shot is
    written to tests/screenshots/_out/ to be looked at, not compared."""
    open_page(page, states_server.url, "load")
    click_and_wait(page, page.locator('[data-testid="stButtonGroup"]').get_by_text("release-freeze", exact=True))
    _set_number(page, "Requests", 4)
    click_and_wait(page, page.get_by_role("button", name="Launch load"))
    assert_no_exception(page)
    text = main_text(page)
    assert "done" in text
    assert _metric(page, "Running/waiting") == "0 / 0"
    submitted = _metric(page, "Submitted")
    assert submitted.endswith(" / " + submitted.split(" / ")[0])  # every turn submitted
    assert page.locator(".js-plotly-plot").count() == 5  # 4 load charts + the continuous-batching chart
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "states_load_live_finished.png").write_bytes(take_screenshot(page))


# ------------------------------------------------------------------------- prefix cache


def test_prefix_cache_result_replayed(states_server, page):
    """One long system prompt shared by many user turns, recorded on the default model, at the
    busiest tick: the pool map shows blocks held by several requests (×n)."""
    _open_demo_trace(page, states_server.url, "shared-system-prompt")
    text = main_text(page)
    assert "model default" in text
    assert "prefix_hit" in page.inner_text("table.kvs-ev") or "from prefix cache" in text
    assert_screenshot(
        page, "states_prefix_cache_result_replayed", extra_css=".kvs-ev-wrap{visibility:hidden!important}"
    )


def test_prefix_cache_live_result(states_server, page):
    """The live Prefix cache page after a measurement: hit rates and shared blocks are engine
    counts; TTFT is wall time, so the shot is written to _out/ to be looked at, not compared."""
    open_page(page, states_server.url, "prefix_cache")
    click_and_wait(page, page.get_by_role("button", name="Measure with and without sharing"))
    assert_no_exception(page)
    assert _metric(page, "Hit rate with forced misses") == "0%"
    assert _metric(page, "Prefix hit rate (this run)") != "0%"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "states_prefix_cache_live_result.png").write_bytes(take_screenshot(page))


# ------------------------------------------------------------------------- every page once


def test_every_page_opens(fresh_app_server, page):
    """Home and every page, each opened by direct URL on a fresh server (Home first), with no
    exception; each page's shot goes to tests/screenshots/_out/tour_<page>.png to be looked at."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for path, heading in ALL_PAGES:
        open_page(page, fresh_app_server.url, path)
        assert_no_exception(page)
        if heading:
            assert page.locator("h1").first.inner_text().strip() == heading
        (OUT_DIR / f"tour_{path or 'home'}.png").write_bytes(take_screenshot(page))
