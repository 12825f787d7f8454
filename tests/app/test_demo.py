"""AppTest for the Demo page (issue 15 item 2): renders statically in test mode from the committed
traces, chapter buttons jump to the tick the trace's events give, step buttons move one tick, and
"run this story live" runs the requests on the (tiny) shared engine and finds its chapters in the
live run's own events."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.trace_events import read_trace
from ui.figures import demo as D

VIEWS = Path(__file__).resolve().parents[2] / "pages"
TRACES = Path(__file__).resolve().parents[2] / "assets" / "traces"


@pytest.fixture(autouse=True)
def _test_mode(monkeypatch):
    monkeypatch.setenv("KVSCOPE_TEST_MODE", "1")
    monkeypatch.setenv("KVSCOPE_MODEL", "tiny")


def _app() -> AppTest:
    at = AppTest.from_file(str(VIEWS / "demo.py"), default_timeout=900)
    at.run()
    assert not at.exception, at.exception
    return at


def test_chapters_jump_to_their_moments():
    at = _app()
    trace = read_trace((TRACES / "release-freeze.jsonl").read_text())
    chs = D.chapters(trace, "release-freeze")
    pre = next(c for c in chs if c.key == "preempt")
    at.button(key="demo_ch_release-freeze_preempt").click().run()
    assert not at.exception
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick
    text = " ".join(h.proto.body for h in at.get("html"))
    assert f"The victim is {pre.moment.request_id}" in text
    at.button(key="demo_fwd").click().run()
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick + 1
    at.button(key="demo_back").click().run()
    at.button(key="demo_back").click().run()
    assert at.session_state["demo_tick_release-freeze"] == pre.moment.tick - 1


def test_speculation_story_renders():
    at = _app()
    at.segmented_control(key="demo_set").set_value("speculation").run()
    assert not at.exception, at.exception
    labels = [b.label for b in at.button]
    assert "2. Break it" in labels and "3. Fallback" in labels


def test_run_live_on_the_shared_engine():
    at = _app()
    at.button(key="demo_live_btn_release-freeze").click().run()
    assert not at.exception, at.exception
    run = at.session_state["demo_live_release-freeze"]
    fs = run["feeder"].snapshot_status()
    assert fs.done and fs.submitted + fs.rejected == len(D.release_freeze_requests())
    text = " ".join(h.proto.body for h in at.get("html"))
    assert "Conversations grow" in text and "is admitted with" in text
