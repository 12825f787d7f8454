"""Browser fixtures: Streamlit servers, headless Chromium, pinned contexts and pages.

Helpers (wait_drawn, click_and_wait, open_page, main_text, assert_screenshot, assert_no_exception,
page_has_no_exception) live in tests/browser/shot.py; import them from there:

    from tests.browser.shot import assert_screenshot, click_and_wait, open_page

    @pytest.mark.browser
    def test_home(app_server, page):
        open_page(page, app_server.url, "/")
        assert_screenshot(page, "home")

Mark every browser test with @pytest.mark.browser.
"""

from __future__ import annotations

import pytest

from tests.browser.shot import APP_SCRIPT, StreamlitServer, launch_browser, new_context


# ---------------------------------------------------------------------------------------------
# streamlit_server (session): factory start(script=APP_SCRIPT, env=None) -> StreamlitServer.
# Servers are cached by (script, env) and shared by the whole session; all are stopped (process
# group killed) at the end. env entries are added to shot.TEST_APP_ENV (KVSCOPE_TEST_MODE=1,
# KVSCOPE_MODEL=tiny, offline). server.url is "http://127.0.0.1:<port>"; server.log_text() has
# its output; server.start_seconds how long it took to answer /_stcore/health.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def streamlit_server():
    servers: dict[tuple, StreamlitServer] = {}

    def start(script=APP_SCRIPT, env: dict[str, str] | None = None) -> StreamlitServer:
        key = (str(script), tuple(sorted((env or {}).items())))
        if key not in servers:
            servers[key] = StreamlitServer(script, env).start()
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()


# ---------------------------------------------------------------------------------------------
# fresh_server (function): factory start(script=APP_SCRIPT, env=None) -> StreamlitServer that
# starts a NEW server each call and stops it when the test ends. For "first request on a freshly
# started server" checks (direct page URLs: docs/DESIGN.md, "Pages and direct URLs") and restart-determinism.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_server():
    started: list[StreamlitServer] = []

    def start(script=APP_SCRIPT, env: dict[str, str] | None = None) -> StreamlitServer:
        server = StreamlitServer(script, env)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


# ---------------------------------------------------------------------------------------------
# fresh_app_server (function): app.py on a server started for this test only; nothing has
# requested any URL yet, so open_page(page, fresh_app_server.url, "some_page") is the very first.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_app_server(fresh_server) -> StreamlitServer:
    return fresh_server(APP_SCRIPT)


# ---------------------------------------------------------------------------------------------
# browser (session): headless Debian Chromium (/usr/bin/chromium or $KVSCOPE_CHROMIUM) driven by
# Playwright's sync API, launched with the quiet/offline flags of shot.CHROMIUM_ARGS.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        b = launch_browser(pw)
        try:
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


# ---------------------------------------------------------------------------------------------
# browser_context (function): a fresh context per test (no shared cookies/session): viewport
# 1280x900, scale 1, reduced motion, light, en-US, UTC, transitions/animations killed by an
# init script. Closed after the test.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def browser_context(browser):
    ctx = new_context(browser)
    yield ctx
    ctx.close()


# ---------------------------------------------------------------------------------------------
# page (function): a blank page in browser_context. Open the app with shot.open_page(...).
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def page(browser_context):
    return browser_context.new_page()
