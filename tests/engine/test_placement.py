"""Where the core and the front end run (engine/core/placement.py): the default plan, the two
environment variables that override it, and their messages."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from engine.core import placement as P


def test_default_plan_core_after_the_first_cpu_front_end_on_it(monkeypatch):
    monkeypatch.delenv("KVSCOPE_CORE_CPUS", raising=False)
    monkeypatch.delenv("KVSCOPE_FRONT_CPUS", raising=False)
    assert P.plan([0, 1]) == P.Plan(core=[1], front=[0])
    assert P.plan([0, 1, 2, 3]) == P.Plan(core=[1, 2, 3], front=[0])
    assert P.plan([3]) == P.Plan(core=None, front=None)  # one CPU: nothing pinned


def test_environment_names_the_cpus(monkeypatch):
    monkeypatch.setenv("KVSCOPE_CORE_CPUS", "0,1")
    monkeypatch.delenv("KVSCOPE_FRONT_CPUS", raising=False)
    assert P.plan([0, 1]) == P.Plan(core=[0, 1], front=None)  # the core took them all: front anywhere
    monkeypatch.setenv("KVSCOPE_FRONT_CPUS", "0")
    assert P.plan([0, 1]) == P.Plan(core=[0, 1], front=[0])  # the core may move, the front end may not
    monkeypatch.delenv("KVSCOPE_CORE_CPUS")
    monkeypatch.setenv("KVSCOPE_FRONT_CPUS", "1")
    assert P.plan([0, 1]) == P.Plan(core=[1], front=[1])


@pytest.mark.parametrize("name", ["KVSCOPE_CORE_CPUS", "KVSCOPE_FRONT_CPUS"])
@pytest.mark.parametrize("raw", ["a,b", "-1", ","])
def test_malformed_cpu_lists_name_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"^{name} must"):
        P.cpus_from_env(name)


def _prioritized(nice, q):
    ok = P.prioritize(nice)
    q.put((ok, os.getsid(0), os.getpriority(os.PRIO_PROCESS, 0), P.autogroup(os.getpid())))


def test_prioritize_gives_the_child_its_own_session_and_a_lower_nice_where_allowed():
    """What the core and the lab process do first: a session of their own (so raising its
    autogroup raises nothing else), then nice -5 here where CAP_SYS_NICE allows it."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_prioritized, args=(-5, q))
    p.start()
    ok, sid, nice, group = q.get(timeout=60)
    p.join(60)
    assert sid != os.getsid(0)  # left the parent's session
    if os.geteuid() == 0:  # root: allowed (unless capabilities were dropped: then say so)
        assert ok and nice == -5, (ok, nice, group)
        if group is not None:
            assert group.endswith("nice -5") and group != P.autogroup(os.getpid())
    else:
        assert nice >= os.getpriority(os.PRIO_PROCESS, 0)  # never above the parent without the right
    assert P.prioritize(0) is False  # 0: the priority is left alone


@pytest.mark.parametrize("raw", ["x", "-21", "20"])
def test_malformed_core_nice_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("KVSCOPE_CORE_NICE", raw)
    with pytest.raises(ValueError, match="^KVSCOPE_CORE_NICE must"):
        P.core_nice_from_env()


def test_describe_reads_nice_and_group():
    d = P.describe()
    assert d["nice"] == os.getpriority(os.PRIO_PROCESS, 0)
    assert d["autogroup"] == P.autogroup(os.getpid())
