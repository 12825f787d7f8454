"""ui/widgets/room.py: whose request is whose, what a rebuild would abort, runs kept server-side, access."""

from __future__ import annotations

import threading

import pytest

from tests.factories import request, snapshot
from ui.widgets import room as R


@pytest.fixture
def sid(monkeypatch):
    """Pretend to be browser session "me"; a fresh Room per test."""
    rm = R.Room()
    monkeypatch.setattr(R, "room", lambda: rm)
    who = {"sid": "me"}
    monkeypatch.setattr(R, "session_id", lambda: who["sid"])
    return who


def test_inflight_counts_split_mine_and_others(sid):
    rm = R.room()
    rm.own("a", "me")
    rm.own("b", "me")
    rm.own("c", "you")
    snap = snapshot(
        16,
        [request("a"), request("b", state="finished"), request("c", state="waiting"), request("d", state="preempted")],
    )
    assert R.inflight_counts(snap) == (1, 2)  # a mine; c (other session) and d (nobody's tab) others
    assert R.mine(snap) == {"a", "b"}
    assert "3 in-flight request(s): 1 from this tab and 2 from other sessions" in R.rebuild_warning(snap)
    sid["sid"] = "you"
    assert R.inflight_counts(snap) == (1, 2) and R.mine(snap) == {"c"}
    assert R.rebuild_warning(snapshot(16, [request("b", state="finished")])).startswith("No request is in flight")


def test_submitter_records_the_owner_from_the_submitting_session(sid):
    class H:
        def __init__(self, rid):
            self.request_id = rid

    class TH:
        def submit(self, prompt, params=None, request_id=None, **kw):
            return H(request_id or "auto-1")

    sub = R.submitter(TH())
    sid["sid"] = "later"  # the feeder thread runs outside any session: the owner was fixed at creation
    sub("p", None, request_id="L-000")
    assert R.room().owner("L-000") == "me"
    R.submit(TH(), "p")
    assert R.room().owner("auto-1") == "later"


def test_outcomes_from_the_kept_handles(sid):
    from types import SimpleNamespace as NS

    def handle(rid, finished=True, reason="length", error=None):
        out = NS(outputs=[NS(finish_reason=reason)]) if finished else None
        return NS(request_id=rid, finished=finished, output=out, error=error)

    rm = R.room()
    for h in (
        handle("r1"),
        handle("r2", reason="abort"),
        handle("r3", reason=None, error="aborted: the engine was reconfigured"),
        handle("r4", finished=False),
        handle("r5", reason="error", error="step failed"),
    ):
        rm.keep(h)
    assert R.outcomes(["r1", "r2", "r3", "r4", "r5", "gone"]) == {
        "finished": 1,
        "aborted": 2,
        "failed": 1,
        "in_flight": 1,
        "unknown": 1,
    }


def test_runs_are_kept_server_side_and_serialised_by_the_lock():
    rm = R.Room()
    lock = threading.Lock()
    gate = threading.Event()
    order = []

    def first(progress):
        progress("working")
        gate.wait(30)
        order.append("first")
        return 41

    def second(progress):
        order.append("second")
        return 42

    r1 = rm.start("speculative", "me", first, lock=lock)
    r2 = rm.start("speculative", "you", second, lock=lock)
    assert rm.get(r1.run_id) is r1 and rm.get(r2.run_id) is r2
    assert not r2.wait(0.2) and r2.status == "queued"  # waits for the first one's slot
    gate.set()
    assert r1.wait(30) and r2.wait(30)
    assert (r1.result, r2.result, order) == (41, 42, ["first", "second"])
    assert r1.status == r2.status == "done" and r1.finished


def test_a_failing_run_reports_its_error():
    rm = R.Room()

    def boom(progress):
        raise ValueError("speculative.num_speculative_tokens must be in [1, 16]")

    r = rm.start("speculative", "me", boom)
    assert r.wait(30) and r.status == "error" and "num_speculative_tokens" in r.error


def test_operator_token(monkeypatch):
    import streamlit as st

    monkeypatch.delenv("KVSCOPE_OPERATOR_TOKEN", raising=False)
    assert R.is_operator()  # no token set: everyone may
    monkeypatch.setenv("KVSCOPE_OPERATOR_TOKEN", "s3cret")
    state = {}
    monkeypatch.setattr(st, "session_state", state)
    assert not R.is_operator()
    state["operator_token_input"] = "wrong"
    assert not R.is_operator()
    state["operator_token_input"] = "s3cret"
    assert R.is_operator()


@pytest.mark.parametrize("val,want", [("1", True), ("yes", True), ("0", False), ("", False), ("false", False)])
def test_shared_flag(monkeypatch, val, want):
    monkeypatch.setenv("KVSCOPE_SHARE", val)
    assert R.shared() is want
