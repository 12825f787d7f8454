"""AppTest of the Fleet page (pages/fleet.py): a recorded fleet trace drawn with its own numbers,
and servers attached by URL (a vLLM stand-in on 127.0.0.1 whose KV-event endpoints are found
through its /kv_event_sources) rebuilt into the merged tree. Waits are bounded loops (hang
guards, not timing assertions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.fleet.state import FleetTrace
from tests.app import helpers as H
from tests.attach_stubs import VllmStub, demo_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("tiny_test_mode")
DEMO = Path(__file__).resolve().parents[2] / "assets" / "traces" / "fleet_demo.json"


@pytest.fixture
def fleet_page(app_test):
    return lambda: app_test(page="pages/fleet.py").run()


def test_recorded_trace_shows_its_last_snapshot(fleet_page):
    trace = FleetTrace.load(DEMO)
    last = trace.snapshots[-1]
    at = fleet_page()
    assert not at.exception, [e.value for e in at.exception]
    at.radio(key="fl_source").set_value("Recorded trace").run()
    assert not at.exception, [e.value for e in at.exception]
    assert H.metric(at, "Distinct cached blocks") == f"{len(last.tree.nodes):,}"
    assert H.metric(at, "Duplicated blocks") == f"{last.tree.duplicated_blocks:,}"
    at.slider(key="fl_tick").set_value(0).run()  # the first snapshot: another moment, its own numbers
    first = trace.snapshots[0]
    assert H.metric(at, "Distinct cached blocks") == f"{len(first.tree.nodes):,}"


def test_attach_discovers_events_and_rebuilds_the_tree(fleet_page):
    at = fleet_page()
    at.radio(key="fl_source").set_value("Attach to servers").run()
    stub = VllmStub(
        demo_batches("current", list(range(100, 108)), list(range(100, 104)) + [7] * 4, 4), publisher="bind"
    )
    try:
        at.text_area[0].input(stub.base_url)
        next(b for b in at.button if b.label == "Attach").click()
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        af = at.session_state["fl_attached"]

        def rebuilt():
            stub.pump()
            snap = af.snapshot()
            return snap is not None and snap.instances[0].stream.last_seq == 2 and snap.instances[0].up

        wait_until(rebuilt, "the stub's events applied and the instance up")
        snap = af.snapshot()
        assert snap.instances[0].kind == "vllm"  # its /metrics has vLLM's names
        assert {n.block_hash for n in snap.tree.nodes} == {f"{1:016x}", f"{3:016x}"}  # 2 was removed
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert H.metric(at, "Instances up") == "1 / 1"
        assert H.metric(at, "Distinct cached blocks") == "2"
        assert any("from its /kv_event_sources" in c.value for c in at.caption)
    finally:
        at.session_state["fl_attached"].stop()
        stub.close()
