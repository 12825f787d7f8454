"""The as-you-type preview in a real browser: typing into the prompt, without submitting, makes
the preview follow the keystrokes (tokens by block, counts), and nothing runs in the engine.
Also the Prefix cache page's side-channel section after a measurement.

Own server (its engine state comes only from this module): the shots are of a fresh engine."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.browser.shot import (
    APP_SCRIPT,
    assert_no_exception,
    assert_screenshot,
    click_and_wait,
    open_page,
    take_screenshot,
    wait_drawn,
)

pytestmark = pytest.mark.browser
ENV = {"KVSCOPE_TEST_SERVER": "preview-live"}
WAIT_MS = 120_000  # a hang guard on busy cores, not a speed check

CHIPS_JS = (
    "() => Array.from(document.querySelectorAll('.kvscope-preview-block > span')).map(e => e.textContent).join('')"
)
# wall-clock values of the side-channel section (TTFT figure and table, accuracy metrics)
HIDE_SC_TIMING = """
.st-key-sc_numbers div[data-testid="stColumn"]:nth-child(-n+2) [data-testid="stMetricValue"] {
  visibility: hidden !important; }
[data-testid="stElementContainer"]:has([data-testid="stDataFrame"]),
[data-testid="stElementContainer"]:has([data-testid="stPlotlyChart"]) { display: none !important; }
"""


@pytest.fixture(scope="module")
def server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=ENV)


def _field(page, label: str):
    lab = page.locator("label.stkeyup__label", has_text=re.compile(f"^{re.escape(label)}"))
    return page.locator(".stkeyup").filter(has=lab).locator("input")


def _wait_chips(page, text: str) -> str:
    page.wait_for_function(f"() => ({CHIPS_JS})().includes({text!r})", timeout=WAIT_MS, polling=50)
    wait_drawn(page)
    return page.evaluate(CHIPS_JS)


def _token_count(page) -> int:
    m = re.search(r"(\d[\d,]*) tokens with the chat template", page.locator(".st-key-kvscope_preview").inner_text())
    assert m, page.locator(".st-key-kvscope_preview").inner_text()
    return int(m.group(1).replace(",", ""))


def test_preview_follows_keystrokes_without_submitting(server, page):
    open_page(page, server.url, "playground")
    prompt = _field(page, "Prompt")
    assert prompt.count() == 1
    prompt.fill("")
    page.wait_for_function("() => !document.querySelector('.kvscope-preview-block')", timeout=WAIT_MS)
    counts = []
    for part in ("Why", " is the", " KV cache <b>fast</b>"):
        prompt.press_sequentially(part, delay=25)
        typed = prompt.input_value()
        chips = _wait_chips(page, typed.replace(" ", " "))
        assert typed in chips
        counts.append(_token_count(page))
        n_chips = page.locator(".kvscope-preview-block > span").count()
        assert n_chips == counts[-1]  # one chip per token of the templated prompt
    assert counts[0] < counts[1] < counts[2]
    assert page.locator(".kvscope-preview b").count() == 0  # token text is escaped, not markup
    assert page.locator('[data-testid="stChatMessage"]').count() == 0  # nothing was submitted
    assert_no_exception(page)
    assert_screenshot(page, "playground_preview_partial")
    # Generate still submits what was typed
    click_and_wait(page, page.get_by_role("button", name="Generate"))
    assert page.locator('[data-testid="stChatMessage"]').count() == 2
    assert "Why is the KV cache <b>fast</b>" in page.locator('[data-testid="stChatMessage"]').first.inner_text()


def test_prefix_page_side_channel_result(server, page):
    open_page(page, server.url, "prefix_cache")
    page.locator('[data-testid="stNumberInput"]', has_text="Rounds").locator("input").fill("2")
    click_and_wait(page, page.get_by_role("button", name="Measure the side channel"))
    assert_no_exception(page)
    text = page.locator('[data-testid="stMain"]').inner_text()
    assert re.search(r"Cross-tenant sharing, shared\s+100%", text), text
    assert re.search(r"Cross-tenant sharing, salted\s+0%", text), text
    assert "8 probes of a 32-token prefix" in text
    page.add_style_tag(content=HIDE_SC_TIMING)  # before the shot measures the page height
    assert_screenshot(page, "prefix_side_channel")


def test_prefix_page_packet_sizes_result(server, page):
    """The packet-size section after a measurement: a metric per defence, both figures and the
    cost table drawn (their values depend on random padding and timing: no pixel baseline)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    open_page(page, server.url, "prefix_cache")
    page.locator('[data-testid="stNumberInput"]', has_text="Trials (each").locator("input").fill("2")
    click_and_wait(page, page.get_by_role("button", name="Measure the packet sizes"))
    assert_no_exception(page)
    text = page.locator('[data-testid="stMain"]').inner_text()
    for label in ("no defence", "obfuscation", "coalesced", "fixed size"):
        assert re.search(rf"Answer guessed: {label}\s+\d+%", text), text[-3000:]
    assert "streamed answers of 12 tokens" in text and "TLS_" in text
    assert page.locator('[data-testid="stPlotlyChart"]').count() == 2  # the timing section is not measured here
    if os.environ.get("KVSCOPE_SHOT_TO"):  # a look at the section, not a baseline
        Path(os.environ["KVSCOPE_SHOT_TO"]).write_bytes(take_screenshot(page, ""))
