"""One engine shared by a room (issue 17), in a real browser with two contexts (two people).

- The issue's scenario: the release-freeze load runs on the Concurrent load page while another
  person runs the Speculative page's comparison. Nothing is aborted, the load finishes, and the
  comparison shows its conditions (rounds, order, contention) beside the number.
- Reloading a tab keeps showing its run (the run id is in the URL, the run is kept server-side);
  another person's settings change (a rebuild) does not break that page.

Content checks only (wall-clock numbers differ run to run); own server so the engine's state comes
from these tests alone."""

from __future__ import annotations

import re

import pytest

from tests.browser.shot import (
    APP_SCRIPT,
    assert_no_exception,
    click_and_wait,
    main_text,
    new_context,
    open_page,
    wait_drawn,
)

pytestmark = pytest.mark.browser
ROOM_ENV = {"KVSCOPE_TEST_SERVER": "shared-room"}
LONG_S = 600  # a hang guard on busy cores, not a speed assertion


@pytest.fixture(scope="module")
def room_server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=ROOM_ENV)


def test_load_keeps_running_through_a_speculative_comparison(room_server, browser):
    a_ctx, b_ctx = new_context(browser), new_context(browser)
    try:
        a, b = a_ctx.new_page(), b_ctx.new_page()
        open_page(a, room_server.url, "load")
        open_page(b, room_server.url, "speculative")
        # A launches the release-freeze load (the default scenario); in test mode A's page draws
        # once the load has finished, so do not wait for A here: B runs the comparison meanwhile
        a.get_by_role("button", name="Launch load").click()
        click_and_wait(b, b.get_by_role("button", name="Run speculative and plain decoding"), timeout_s=LONG_S)
        assert_no_exception(b)
        text = main_text(b)
        assert "Conditions: median of 3 rounds" in text, text[-2000:]
        assert "plain and spec alternated" in text
        assert "the shared engine was not rebuilt and no request was aborted" in text
        assert "aborted" not in text.replace("no request was aborted", "")
        assert re.search(r"(un)?contended|CONTENDED", text)
        # A's load finished on its own: every request finished, none aborted, feeding not stopped
        a.wait_for_function(
            '() => document.body.innerText.includes("This run\'s requests:")', timeout=LONG_S * 1000, polling=200
        )
        wait_drawn(a, LONG_S)
        assert_no_exception(a)
        ta = main_text(a)
        m = re.search(
            r"This run's requests: (\d+) finished, (\d+) aborted, (\d+) rejected or failed, "
            r"(\d+) in flight",
            ta,
        )
        assert m, ta[:2000]
        finished, aborted, rejected, inflight = map(int, m.groups())
        sub, total = map(int, re.search(r"Submitted\s+(\d+) / (\d+)", ta).groups())
        refused = int(re.search(r"Rejected at submit\s+(\d+)", ta).group(1))  # too long for the test pool
        assert sub + refused == total > 0  # the feeder went through the whole workload
        assert aborted == 0 and inflight == 0 and finished == sub > 0 and rejected == refused
        assert "engine was rebuilt" not in ta and "Feeding stopped" not in ta
    finally:
        a_ctx.close()
        b_ctx.close()


def test_reload_keeps_the_run_and_another_persons_rebuild_does_not_break_it(room_server, browser):
    a_ctx, b_ctx = new_context(browser), new_context(browser)
    try:
        a, b = a_ctx.new_page(), b_ctx.new_page()
        open_page(a, room_server.url, "speculative")
        click_and_wait(a, a.get_by_role("button", name="Run speculative and plain decoding"), timeout_s=LONG_S)
        assert "run=" in a.url
        first = main_text(a)
        head = re.search(r"Result — [^\n]+", first).group(0)
        cond = re.search(r"Conditions: [^\n]+", first).group(0)
        # reload mid-session: the same run is drawn again from the server-side record
        a.reload(wait_until="domcontentloaded")
        wait_drawn(a, LONG_S)
        assert_no_exception(a)
        again = main_text(a)
        assert head in again and cond in again
        # B changes the engine for everyone (block size; confirmed), A's page keeps working
        open_page(b, room_server.url, "")
        side = b.locator('[data-testid="stSidebar"]')
        assert "nothing would be aborted" in side.inner_text() or "in-flight request(s)" in side.inner_text()
        side.get_by_text("Rebuild the shared engine, aborting the requests above").click()
        click_and_wait(b, side.get_by_role("button", name="Apply"), timeout_s=LONG_S)
        assert_no_exception(b)
        assert "Shared engine rebuilt" in side.inner_text()
        a.reload(wait_until="domcontentloaded")
        wait_drawn(a, LONG_S)
        assert_no_exception(a)
        assert head in main_text(a) and cond in main_text(a)
    finally:
        a_ctx.close()
        b_ctx.close()
