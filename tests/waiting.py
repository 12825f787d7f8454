"""The one way a test waits for another thread or process to reach a state: poll the condition,
bounded. The bound is a hang guard on a busy machine, never a speed assertion; the poll interval
only sets how soon the test notices."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], what: str, timeout: float = 60.0, every: float = 0.02) -> T:
    """Call cond() until it returns something truthy and return that; after `timeout` seconds an
    AssertionError naming `what` (the state waited for)."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
