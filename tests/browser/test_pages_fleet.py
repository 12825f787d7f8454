"""The Fleet page in Chromium (issue 31 item 6): the recorded fleet trace (assets/traces/
fleet_demo.json, three tiny-model kvscope servers behind vllm-router, round_robin then kv_aware)
drawn as a user opens it, checked against the trace's own numbers and shot pixel-exactly; the
live sources' first screens, which must start nothing and wait on no network.

Own server (an extra env entry gives a separate session-scoped server)."""

from __future__ import annotations

import pytest

from engine.fleet.state import FleetTrace
from tests.browser.shot import (
    APP_SCRIPT,
    REPO_ROOT,
    assert_no_exception,
    assert_screenshot,
    choose_option,
    click_and_wait,
    main_text,
    open_page,
    rerun_after,
)
from ui.figures import fleet as F

pytestmark = pytest.mark.browser
FLEET_ENV = {"KVSCOPE_TEST_SERVER": "fleet"}
DEMO = REPO_ROOT / "assets" / "traces" / "fleet_demo.json"
FAULT = REPO_ROOT / "assets" / "traces" / "fleet_fault_demo.json"


@pytest.fixture(scope="module")
def fleet_server(streamlit_server):
    return streamlit_server(APP_SCRIPT, env=FLEET_ENV)


def _metric(page, label: str) -> str:
    box = page.locator('[data-testid="stMetric"]', has_text=label).first
    return box.locator('[data-testid="stMetricValue"]').inner_text().strip()


def test_recorded_fleet_trace(fleet_server, page):
    trace = FleetTrace.load(DEMO)
    last = trace.snapshots[-1]
    open_page(page, fleet_server.url, "fleet")
    assert page.locator("h1").first.inner_text().strip() == "Fleet"
    click_and_wait(page, page.get_by_text("Recorded trace", exact=True))
    assert_no_exception(page)
    # the page shows the trace's last snapshot, its own numbers
    up = sum(1 for i in last.instances if i.up)
    assert _metric(page, "Instances up") == f"{up} / {len(last.instances)}"
    assert _metric(page, "Distinct cached blocks") == f"{len(last.tree.nodes):,}"
    assert _metric(page, "Duplicated blocks") == f"{last.tree.duplicated_blocks:,}"
    text = main_text(page)
    assert F.duplication_text(last.tree) in text
    assert "What-if: " + F.REPLAY_LABEL in text
    assert page.locator("span.kv-replay").count() == len(trace.whatif) + 1  # every row, and the table's caption
    c = F.ledger_counts(trace.requests)
    assert f"{c['requests']} requests · {c['hits']} with a prefix hit" in text
    for i in last.instances:
        assert i.engine_id in text and i.url in text
    # tree, holdings, timeline, hit rate (measured + replayed), policy panels
    assert page.locator(".js-plotly-plot").count() == 5
    assert_screenshot(page, "fleet_recorded_trace")


def test_recorded_fault_trace_marks_the_killed_instance_down(fleet_server, page):
    """A run with an instance SIGKILLed mid-load: the last snapshot marks it down with the reason,
    and the ledger's only errors are the requests it was serving when it died."""
    trace = FleetTrace.load(FAULT)
    last = trace.snapshots[-1]
    down = [i for i in last.instances if not i.up]
    assert down
    open_page(page, fleet_server.url, "fleet")
    click_and_wait(page, page.get_by_text("Recorded trace", exact=True))
    choose_option(page, "Recorded fleet trace", "fault_demo")
    page.evaluate("() => document.activeElement && document.activeElement.blur()")  # no focus ring in the shot
    assert_no_exception(page)
    assert _metric(page, "Instances up") == f"{len(last.instances) - len(down)} / {len(last.instances)}"
    text = main_text(page)
    for i in down:
        assert i.reason in text.replace("\n", " ")
    c = F.ledger_counts(trace.requests)
    assert c["errors"] == sum(1 for r in trace.requests if r.error) and f"· {c['errors']} failed" in text
    assert trace.meta["fault"] in text
    assert_screenshot(page, "fleet_fault_trace")


def test_ledger_filter_by_policy(fleet_server, page):
    trace = FleetTrace.load(DEMO)
    policies = list(dict.fromkeys(r.policy for r in trace.requests))
    assert len(policies) >= 2
    open_page(page, fleet_server.url, "fleet")
    click_and_wait(page, page.get_by_text("Recorded trace", exact=True))
    group = page.locator('[data-testid="stButtonGroup"]').last
    rerun_after(page, group.get_by_text(policies[-1], exact=True).click, what=f"the {policies[-1]} ledger")
    assert_no_exception(page)
    mine = [r for r in trace.requests if r.policy == policies[-1]]
    c = F.ledger_counts(mine)
    assert f"{c['requests']} requests · {c['hits']} with a prefix hit" in main_text(page)


def test_live_sources_start_nothing_until_asked(fleet_server, page):
    """The default source (the local fleet) shows its controls and starts no process on its own;
    attaching to a malformed list names the line at fault."""
    open_page(page, fleet_server.url, "fleet")
    text = main_text(page)
    assert "Start fleet" in text and "No local fleet running" in text
    click_and_wait(page, page.get_by_text("Attach to servers", exact=True))
    page.locator("textarea").first.fill("http://127.0.0.1:1\nnot a url")
    click_and_wait(page, page.get_by_role("button", name="Attach"))
    assert_no_exception(page)
    assert "servers, line 2: base URL" in main_text(page)
