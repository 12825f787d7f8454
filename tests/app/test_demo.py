"""AppTest for the Demo page (issue 15 item 2): renders statically in test mode from the committed
traces, chapter buttons jump to the tick the trace's events give, step buttons move one tick, and
"run this story live" runs the requests on the (tiny) shared engine and finds its chapters in the
live run's own events."""

from __future__ import annotations

import pytest

from engine.observe.trace_events import read_trace
from tests.app import helpers as H
from tests.conftest import REPO_ROOT
from ui.figures import demo as D

TRACES = REPO_ROOT / "assets" / "traces"


@pytest.fixture
def demo_page(app_test):
    """factory: the Demo page, run once (and checked for exceptions)."""
    return lambda: H.run_ok(app_test("pages/demo.py"))


def test_chapters_jump_to_their_moments(demo_page):
    at = demo_page()
    trace = read_trace((TRACES / "release-freeze.jsonl").read_text())
    chs = D.chapters(trace, "release-freeze")
    pre = next(c for c in chs if c.key == "preempt")
    at.button(key="demo_ch_release-freeze_preempt").click().run()
    assert not at.exception
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick
    text = H.html(at)
    assert f"The victim is {pre.moment.request_id}" in text
    at.button(key="demo_fwd").click().run()
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick + 1
    at.button(key="demo_back").click().run()
    at.button(key="demo_back").click().run()
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick - 1


def test_speculation_story_renders(demo_page):
    at = demo_page()
    at.segmented_control(key="demo_set").set_value("speculation").run()
    assert not at.exception, at.exception
    labels = [b.label for b in at.button]
    assert "2. Break it" in labels and "3. Fallback" in labels


def test_run_live_on_the_shared_engine(demo_page):
    at = demo_page()
    at.button(key="demo_live_btn_release-freeze").click().run()
    assert not at.exception, at.exception
    run = at.session_state["demo_live_release-freeze"]
    fs = run["feeder"].snapshot_status()
    assert fs.done and fs.submitted + fs.rejected == len(D.release_freeze_requests())
    from ui.widgets import room

    owners = {room.room().owner(rid) for rid in fs.request_ids}  # this tab's, as the Load page's are
    assert len(owners) == 1 and None not in owners and "" not in owners, owners
    text = H.html(at)
    assert "Conversations grow" in text and "is admitted with" in text
