"""Screenshots and browser checks of the Demo and Claims pages and the batching chart on Replay
(issue 15 items 2-4, 8). The Demo plays committed traces recorded on the default model, so its
text reads as a user would see it; the Claims page reads a committed bench-result fixture
(tests/fixtures/bench: a real `python -m engine bench ... --quick --model tiny` run, labelled with
its file name, model and date as the page labels any result) — the live Measure button times
things, so its result is checked for content, not pixels."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.shot import APP_SCRIPT, assert_no_exception, assert_screenshot, click_and_wait, main_text, open_page

pytestmark = pytest.mark.browser
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bench"
ENV = {"KVSCOPE_TEST_SERVER": "demo-claims", "KVSCOPE_RESULTS_DIR": str(FIXTURE)}


@pytest.fixture(scope="module")
def server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=ENV)


def test_demo_at_a_captioned_step(server, page):
    open_page(page, server.url, "demo")
    assert_no_exception(page)
    click_and_wait(page, page.get_by_role("button", name="4. Preemption"))
    assert_no_exception(page)
    text = main_text(page)
    assert "Chapter 4 · LRU preemption recomputes" in text and "The victim is" in text
    assert page.locator(".js-plotly-plot").count() >= 3
    assert_screenshot(page, "demo_preemption_chapter")


def test_demo_speculation_fallback(server, page):
    open_page(page, server.url, "demo")
    click_and_wait(page, page.locator('[data-testid="stButtonGroup"]').get_by_text("Speculative decoding", exact=True))
    click_and_wait(page, page.get_by_role("button", name="3. Fallback"))
    assert_no_exception(page)
    assert "stops speculating" in main_text(page)
    assert_screenshot(page, "demo_speculation_fallback")


def test_claims_with_bench_results(server, page):
    open_page(page, server.url, "claims")
    assert_no_exception(page)
    text = main_text(page)
    assert "model tiny" in text and "holds here" in text
    assert "kvquant.json" in text  # quantized-KV recall: the committed bench kvquant measurement
    assert_screenshot(page, "claims_bench_fixture")
    click_and_wait(page, page.get_by_role("button", name="Measure"), timeout_s=600)
    assert_no_exception(page)
    text = main_text(page)
    assert "measured on this page" in text and "B=1:" in text


def test_replay_shows_batching(server, page):
    open_page(page, server.url, "replay")
    assert_no_exception(page)
    assert "forward passes shown" in main_text(page)
    # this shot is about the batching chart; the event table's sticky header drew one pixel row
    # differently in 1 of 3 clean-clone runs, so it is hidden here (space kept; other shots show it)
    assert_screenshot(page, "replay_batching", extra_css=".kvs-ev-wrap{visibility:hidden!important}")


def test_load_run_shows_batching(server, page):
    open_page(page, server.url, "load")
    click_and_wait(page, page.locator('[data-testid="stButtonGroup"]').get_by_text("mixed", exact=True))
    n = page.get_by_role("spinbutton", name="Requests", exact=True)
    n.fill("4")
    n.press("Tab")
    click_and_wait(page, page.get_by_role("button", name="Launch load"))
    assert_no_exception(page)
    text = main_text(page)
    assert "4 / 4" in text and "forward passes shown" in text and "Continuous batching" in text
