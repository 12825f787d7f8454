"""Browser checks of Home, Playground and Speculative decoding in headless Chromium.

Screenshots are taken in fixed states on a server only this module uses (test mode: tiny model,
greedy, seeded, static charts), in file order: Home on the untouched engine, then one Playground
answer, then a self-draft speculative run. Wall-clock numbers (TTFT, tokens/s, e2e, speedup,
the measured-cost chart) are hidden while the shot is taken; everything else must match exactly.
"""

from __future__ import annotations

import re

import pytest

from tests.browser.shot import (
    APP_SCRIPT,
    assert_no_exception,
    assert_screenshot,
    choose_option,
    click_and_wait,
    open_page,
    rerun_after,
)

pytestmark = pytest.mark.browser

# Wall-clock values vary run to run: hidden (space kept) for the shot only.
HIDE_TIMING_CSS = """
[class*="st-key-pg_timing"] [data-testid="stMetricValue"],
.st-key-spec_timing [data-testid="stMetricValue"],
.st-key-spec_conditions, .st-key-spec_conditions *,
.st-key-spec_costs { visibility: hidden !important; }
"""

HOSTILE = (
    '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
    '"><svg onload="window.__pwned=3"> RTL:\u202eevil zero:\u200bwidth'
)


@pytest.fixture(scope="module")
def server(streamlit_server):
    # its own server (servers are cached by env): state from other modules' tests cannot leak in
    return streamlit_server(APP_SCRIPT, env={"KVSCOPE_BROWSER_MODULE": "pages_playground_spec"})


def _hide_timing(page):
    page.add_style_tag(content=HIDE_TIMING_CSS)


def test_direct_page_urls_on_a_fresh_server(fresh_app_server, page):
    # the very first request to this server is a page URL (docs/DESIGN.md, "Pages and direct URLs")
    open_page(page, fresh_app_server.url, "playground")
    assert page.locator("h1", has_text="Playground").count() == 1
    assert page.get_by_role("button", name="Generate").count() == 1
    # drawn through app.py: its navigation (Home first) and the shared engine settings, not
    # Streamlit's automatic list of the pages/ folder (which names app.py "app")
    nav = [t.split("\n")[-1] for t in page.locator('[data-testid="stSidebarNav"] a').all_inner_texts()]
    assert nav[0] == "Home" and "app" not in nav, nav
    assert page.get_by_text("Engine settings").count() == 1
    open_page(page, fresh_app_server.url, "speculative")
    assert page.locator("h1", has_text="Speculative decoding").count() == 1


def test_home(server, page):
    open_page(page, server.url, "/")
    main = page.locator('[data-testid="stMain"]').inner_text()
    assert "Engine healthy" in main and "KV bytes per token" in main
    # the app's default: the engine core in a process of its own, placement read from the OS
    where = page.locator(".st-key-home_placement").inner_text()
    assert "Engine core: a process of its own, pid " in where and "Front end (pages, charts, the API): pid " in where
    # pids and thread counts vary run to run: hidden for the shot (their space kept)
    hide = ".st-key-home_placement, .st-key-home_placement *{visibility:hidden!important}"
    assert_screenshot(page, "home", extra_css=hide)


def test_playground_answer(server, page):
    open_page(page, server.url, "playground")
    click_and_wait(page, page.get_by_role("button", name="Generate"))
    assert_no_exception(page)
    main = page.locator('[data-testid="stMain"]')
    assert "cache growth of r1" in main.inner_text()
    assert page.locator(".kvscope-tokens .tok-plain").count() == 48
    assert page.locator(".js-plotly-plot").count() == 3  # pool map, growth, phases
    _hide_timing(page)
    assert_screenshot(page, "playground_answer")


def test_playground_hostile_prompt_is_text(server, page):
    open_page(page, server.url, "playground")
    field = (
        page.locator(".stkeyup")
        .filter(has=page.locator("label.stkeyup__label", has_text=re.compile("^Prompt$")))
        .locator("input")
    )
    field.fill(HOSTILE)
    page.wait_for_function(
        "() => document.querySelector('.kvscope-preview') && document.querySelector("
        "'.kvscope-preview').textContent.includes('__pwned')",
        timeout=120_000,
        polling=50,
    )
    click_and_wait(page, page.get_by_role("button", name="Generate"))
    assert_no_exception(page)
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator('img[src="x"]').count() == 0
    assert page.locator("svg[onload]").count() == 0
    assert page.locator("script", has_text="__pwned").count() == 0
    text = page.locator('[data-testid="stMain"]').inner_text()
    assert "<script>window.__pwned=1</script>" in text  # shown, as text


def test_speculative_self_draft(server, page):
    open_page(page, server.url, "speculative")
    # choose_option waits for the rerun the choice starts: with a bare wait_drawn, the next
    # click's wait could be satisfied by this rerun finishing late (seen once in a CI run: the
    # page was read in its no-result state while the Run click's rerun had not started yet)
    choose_option(page, "Drafter", "self-draft: int8 copy")
    click_and_wait(page, page.get_by_role("button", name="Run speculative and plain decoding"))
    assert_no_exception(page)
    main = page.locator('[data-testid="stMain"]').inner_text()
    assert "Result — self_draft k=4" in main
    assert "Same output as plain decoding" in main
    assert page.locator(".kvscope-tokens .tok-accepted").count() > 0
    _hide_timing(page)
    assert_screenshot(page, "speculative_self_draft")


def test_speculative_watch_evicts_mid_run(server, page):
    """Watch mode in the browser: evicted after 6 tokens (test mode waits for the run in the page),
    the recomputed positions are marked and the greedy output still matches plain decoding."""
    open_page(page, server.url, "speculative")
    choose_option(page, "Drafter", "self-draft: int8 copy")
    click_and_wait(page, page.get_by_text("Watch live (evict during the run)"))
    box = page.get_by_label("Evict automatically after N tokens (0: only the button)")
    rerun_after(page, lambda: (box.fill("6"), box.press("Enter")), what="setting the eviction point")
    click_and_wait(page, page.get_by_role("button", name="Watch the speculative run"))
    assert_no_exception(page)
    main = page.locator('[data-testid="stMain"]').inner_text()
    assert "Watched run — self_draft k=4" in main
    assert re.search(r"Evicted after engine step \d+ \(after 6 tokens\)", main), main[-2000:]
    assert "token-for-token the plain" in main
    assert page.locator(".kvscope-tokens .tok-evicted-prompt").count() >= 1
    assert page.locator(".kvscope-tokens .tok-evicted").count() >= 6
    assert_screenshot(page, "speculative_watch_evicted")
    click_and_wait(page, page.get_by_text("Measure vs plain"))
