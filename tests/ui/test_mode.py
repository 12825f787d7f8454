"""ui/widgets/mode.py: what test mode changes, and how a page follows a run in either mode."""

from __future__ import annotations

import threading

import pytest

from engine.config import EngineConfig
from ui.widgets import mode


@pytest.fixture
def live(monkeypatch):
    monkeypatch.delenv("KVSCOPE_TEST_MODE", raising=False)


@pytest.fixture
def test_mode(monkeypatch):
    monkeypatch.setenv("KVSCOPE_TEST_MODE", "1")


def test_the_flag_is_read_at_every_call(monkeypatch):
    for value, expected in (("", mode.LIVE), ("0", mode.LIVE), ("no", mode.LIVE), ("1", mode.TEST)):
        monkeypatch.setenv("KVSCOPE_TEST_MODE", value)
        assert mode.current() is expected


def test_test_mode_engine_is_a_valid_small_config():
    cfg = EngineConfig(model="tiny", **mode.TEST.engine)
    assert (cfg.device, cfg.num_kv_blocks, cfg.seed, cfg.num_threads) == ("cpu", 96, 0, 1)
    assert mode.LIVE.engine == {}


def test_run_every_live_and_in_test_mode(live, monkeypatch):
    assert mode.run_every() == mode.LIVE_INTERVAL_S
    assert mode.run_every(1.0) == 1.0 and mode.run_every(1.0, active=False) is None
    monkeypatch.setenv("KVSCOPE_TEST_MODE", "1")
    assert mode.run_every(1.0) is None


def test_wait_or_poll_live_returns_the_interval_while_running(live):
    ticks = []
    assert mode.wait_or_poll(lambda: True, tick=lambda: ticks.append(1), interval_s=0.5) == 0.5
    assert mode.wait_or_poll(lambda: False, tick=lambda: ticks.append(1)) is None
    assert ticks == []  # live, the fragment itself polls


def test_wait_or_poll_in_test_mode_waits_for_the_end_then_draws_once(test_mode):
    left = [3]

    def running():
        return left[0] > 0

    def tick():
        left[0] -= 1

    assert mode.wait_or_poll(running, tick=tick) is None
    assert left[0] == -1  # ticked until done, then once more


def test_wait_or_poll_in_test_mode_uses_the_runs_own_event(test_mode):
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    assert mode.wait_or_poll(lambda: not done.is_set(), wait=done.wait) is None
    assert done.is_set()


def test_paced(live, monkeypatch):
    assert mode.paced(0.0) is True
    monkeypatch.setenv("KVSCOPE_TEST_MODE", "1")
    assert mode.paced(10.0) is False
