"""AppTest runs share one fixture: test mode on the tiny model for a module, and the shared
engine shut down and forgotten afterwards, so the next module builds its own."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def tiny_test_mode():
    old = {k: os.environ.get(k) for k in ("KVSCOPE_TEST_MODE", "KVSCOPE_MODEL")}
    os.environ["KVSCOPE_TEST_MODE"] = "1"
    os.environ["KVSCOPE_MODEL"] = "tiny"
    yield
    from ui.widgets import engine_access as ea

    holder = ea.shared_engine()
    if holder.thread is not None:
        holder.thread.shutdown()
    ea.shared_engine.clear()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
