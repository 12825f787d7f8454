"""Where the core and the front end run (engine/core/placement.py): the default plan, the two
environment variables that override it, and their messages."""

from __future__ import annotations

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
