"""Test mode vs live, in one place.

KVSCOPE_TEST_MODE=1 (read at every call, so tests can set it before running the app) makes the app
deterministic for AppTest and the screenshot baselines: a small CPU engine, static charts, no
polling and no timers. Everything it changes is a field of `Mode` (`current()`); pages follow a
run with `wait_or_poll` (live: the fragment's refresh interval; test mode: wait for the end here,
then draw once) and refresh with `run_every`, so no page branches on test mode itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

LIVE_INTERVAL_S = 0.25  # fragment refresh (4 Hz)
WAIT_POLL_S = 0.02  # test mode: how often wait_or_poll checks a run without an event to wait on
WAIT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Mode:
    test: bool
    engine: dict = field(default_factory=dict)  # EngineConfig fields of a fresh server's engine
    static_charts: bool = False  # Plotly without hover, mode bar or resize
    fresh_snapshots: bool = False  # draw th.snapshot_now() (between steps), not the last published one
    refresh: bool = True  # fragments refresh on a timer; False: draw once
    time_scale: float = 1.0  # LoadFeeder's arrival times (0: every arrival at once)
    spec_fallback: bool = True  # the acceptance monitor's fallback (it acts on measured wall-clock costs)
    spec_budget_s: float | None = 30.0  # compare_speculative's time budget (None: its fixed rounds)
    watch_pace_s: float = 0.4  # the watch mode's default pause per engine step
    small_workloads: bool = False  # Prefix cache page: the short defaults whatever the pool
    cost_tokens: int = 64  # Cache vs no-cache: tokens to generate (default)
    exercise_growth: int = 96  # Cache vs no-cache: tokens each sequence grows by (default)


LIVE = Mode(test=False)
TEST = Mode(
    test=True,
    engine=dict(
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        seed=0,
        num_threads=1,
        event_ring_size=5000,
        history_len=256,
    ),
    static_charts=True,
    fresh_snapshots=True,
    refresh=False,
    time_scale=0.0,
    spec_fallback=False,
    spec_budget_s=None,
    watch_pace_s=0.0,
    small_workloads=True,
    cost_tokens=48,
    exercise_growth=48,
)


def current() -> Mode:
    """TEST when KVSCOPE_TEST_MODE is set (not "", "0", "false", "no"), else LIVE."""
    return TEST if os.environ.get("KVSCOPE_TEST_MODE", "") not in ("", "0", "false", "no") else LIVE


def run_every(interval_s: float = LIVE_INTERVAL_S, *, active: bool = True) -> float | None:
    """A fragment's run_every: `interval_s` while `active`; None (draw once) when not, or in test mode."""
    return interval_s if active and current().refresh else None


def wait_or_poll(
    running: Callable[[], bool],
    *,
    tick: Callable[[], object] | None = None,
    wait: Callable[[float], object] | None = None,
    interval_s: float = LIVE_INTERVAL_S,
) -> float | None:
    """How a page follows a run in progress. Live: the run_every of the fragment that draws it,
    `interval_s` while `running()`, None once it is not. Test mode: wait here for the end instead,
    with `wait(timeout)` when the run has an event of its own, else checking `running()` every
    20 ms, `tick()` (e.g. recording the engine's snapshots) before each check and once after;
    returns None, so the page draws the finished run once."""
    if current().refresh:
        return interval_s if running() else None
    if wait is not None:
        wait(WAIT_TIMEOUT_S)
    else:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while time.monotonic() < deadline:
            if tick is not None:
                tick()
            if not running():
                break
            time.sleep(WAIT_POLL_S)
    if tick is not None:
        tick()
    return None


def paced(interval_s: float) -> bool:
    """Auto-play's pause before the next tick: sleeps `interval_s` and returns True live; returns
    False at once in test mode (no timers), so the page stays on its tick."""
    if not current().refresh:
        return False
    time.sleep(interval_s)
    return True
