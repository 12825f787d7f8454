"""The app on its default engine, the core in a process of its own (one core for the module):
Home says where the core and the front end run, read from the OS; a crash of the core shows its
reason and a button that starts a new core; the pages draw the client's snapshots."""

from __future__ import annotations

import os

import pytest

from engine.core import placement
from tests.app import helpers as H
from tests.app.helpers import TIMEOUT
from tests.waiting import wait_until

# KVSCOPE_CORE_CPUS = every CPU this process may use: the plan leaves the front end (this test
# process) unpinned, so the rest of the session keeps its CPUs.
ALL = ",".join(map(str, placement.allowed_cpus() or [0]))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.parametrize(
        "tiny_test_mode", [{"KVSCOPE_ENGINE_PROCESS": "1", "KVSCOPE_CORE_CPUS": ALL}], indirect=True, ids=["process"]
    ),
]


def test_home_says_where_the_core_and_the_front_end_run(app_test):
    at = H.run_ok(app_test())
    th = H.engine()
    assert hasattr(th, "placement_now") and th.core_pid != os.getpid()
    text = "\n".join(c.value for c in at.caption)
    assert f"Engine core: a process of its own, pid {th.core_pid}" in text
    assert f"Front end (pages, charts, the API): pid {os.getpid()}" in text
    assert "1 torch thread(s)" in text  # test mode's num_threads, read back from the core
    nice = os.getpriority(os.PRIO_PROCESS, th.core_pid)  # the core's priority as the OS has it
    assert f"nice {nice}" in text
    if os.geteuid() == 0:  # allowed here: the core asked for its own group at nice -10
        assert nice == -10 and "ahead of the front end and a browser" in text


def test_playground_generates_through_the_core(app_test):
    at = H.run_ok(app_test(page="pages/playground.py"))
    at.session_state["_st_keyup_pg_prompt"] = {"value": "Name three colours."}
    at.slider(key="pg_max_tokens").set_value(8)
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    th = H.engine()
    req = th.snapshot_now().request(at.session_state["pg_rid"])
    assert req is not None and req.state == "finished" and req.output_len == 8
    assert at.session_state["pg_answer"] == req.output_text  # streamed across the boundary
    assert H.metric(at, "Prompt · output") == f"{req.prompt_len} · {req.output_len}"
    th.check_invariants()


def test_crash_of_the_core_then_start_a_new_one(app_test):
    th = H.engine()
    old = th.core_pid
    H.crash_next_step(th, "injected core failure")
    th.submit("hello", chat=True)
    wait_until(lambda: not th.healthy, "the injected failure to stop the core", TIMEOUT)
    at = H.run_ok(app_test())
    assert any("injected core failure" in e.value for e in at.error)
    H.button(at, "Start a new engine core").click().run()
    H.no_exception(at)
    assert th.healthy and th.core_pid != old
    assert any("Engine healthy" in s.value for s in at.success)
