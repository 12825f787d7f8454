"""recording.LoadFeeder bound to an EngineThread stops when that thread's engine is rebuilt."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine import recording


@dataclass
class WR:
    arrival_s: float
    prompt: str
    max_tokens: int


class FakeThread:
    """Stands in for an EngineThread: `.engine` is swapped on rebuild; submit records ids."""

    def __init__(self):
        self.engine = object()
        self.ids = []
        self.first = threading.Event()
        self.go_on = threading.Event()

    def submit(self, prompt, params, request_id=None):
        self.ids.append(request_id)
        if len(self.ids) == 1:
            self.first.set()
            self.go_on.wait(30)


def test_feeder_stops_when_its_engine_is_rebuilt():
    th = FakeThread()
    reqs = [WR(0.0, f"p{i}", 4) for i in range(10)]
    f = recording.LoadFeeder(
        th.submit, reqs, make_params=lambda r: None, run_id="r", time_scale=0.0, bound_to=th
    ).start()
    assert th.first.wait(30)
    th.engine = object()  # the shared engine was rebuilt while the feeder was submitting
    th.go_on.set()
    f.join(30)
    s = f.snapshot_status()
    assert th.ids == ["r-000"]  # nothing more went into the rebuilt engine
    assert s.done and s.stopped and s.rebuilt and s.submitted == 1
    assert recording.LoadFeeder.REBUILT in s.errors


def test_unrebuilt_feeder_submits_everything():
    th = FakeThread()
    th.go_on.set()
    f = recording.LoadFeeder(
        th.submit,
        [WR(0.0, "a", 1), WR(0.0, "b", 1)],
        make_params=lambda r: None,
        run_id="q",
        time_scale=0.0,
        bound_to=th,
    ).start()
    f.join(30)
    s = f.snapshot_status()
    assert th.ids == ["q-000", "q-001"] and s.done and not s.stopped and not s.rebuilt
