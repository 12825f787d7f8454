"""The lab process (engine/lab/lab_proc.py): the comparison pages' private engines and the Claims
page's live measurement run in a process of their own. Results equal the in-process ones,
callbacks run in the caller, errors keep their type, a killed lab process is replaced, and the
Claims measurement holds the shared core and leaves it serving. One lab process and one engine
core for the module."""

from __future__ import annotations

import os

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.client import EngineClient
from engine.lab import experiments, lab_proc
from tests.engine.engines import TINY_CORE

pytestmark = pytest.mark.slow

CFG = TINY_CORE
WAIT_S = 300


@pytest.fixture(scope="module")
def lab():
    yield lab_proc.LAB
    lab_proc.LAB.stop()


def _requests():
    """Four requests as run_allocator reads them (request_id, prompt ids, max_tokens)."""
    from types import SimpleNamespace

    return [
        SimpleNamespace(request_id=f"w{i}", prompt=list(range(1000 + i, 1008 + 3 * i)), max_tokens=4 + 2 * i)
        for i in range(4)
    ]


def test_run_allocator_same_record_as_in_process_and_callbacks_here(lab):
    base = EngineConfig(**CFG)
    kw = dict(model="tiny", block_size=4, budget_blocks=64, max_model_len=64)
    here = experiments.run_allocator(base, "paged", _requests(), **kw)
    seen = []

    def on_step(i, snap):
        import threading

        seen.append((i, snap.step))
        return threading.Lock()  # as a page's progress bar returns its element: not sent back

    there = lab.run(experiments.run_allocator, base, "paged", _requests(), **kw, on_step=on_step)
    assert lab.pid not in (None, os.getpid())
    assert there.steps == here.steps and there.label == here.label
    assert {k: v.outputs[0].token_ids for k, v in there.outputs.items()} == {
        k: v.outputs[0].token_ids for k, v in here.outputs.items()
    }
    assert [s.metrics.num_blocks_used for s in there.series] == [s.metrics.num_blocks_used for s in here.series]
    assert len(seen) == there.steps  # every step's callback ran in this process


def test_compare_prefix_busy_probe_and_errors_keep_their_type(lab):
    calls = []

    def busy():
        calls.append(1)
        return 0

    prompts = ["System: be brief.\n\nUser: hi", "System: be brief.\n\nUser: colours?"]
    out = lab.run(experiments.compare_prefix, EngineConfig(**CFG), prompts, 3, prompt_lens=[12, 14], busy=busy)
    assert out["comparison"].ratio is not None and calls  # the probe ran here
    assert len(out["hit"]) == len(out["miss"]) == 2
    with pytest.raises(ValueError, match="prompts"):
        lab.run(experiments.compare_prefix, EngineConfig(**CFG), [], 3, prompt_lens=[])


def test_killed_lab_process_fails_the_run_and_the_next_starts_a_new_one(lab):
    import threading

    base = EngineConfig(**CFG)
    kw = dict(model="tiny", block_size=4, budget_blocks=64, max_model_len=64)
    lab.run(experiments.run_allocator, base, "paged", _requests()[:1], **kw)  # running
    pid = lab.pid
    killed = threading.Event()

    def on_step(i, snap):
        if not killed.is_set():
            killed.set()
            os.kill(pid, 9)

    with pytest.raises(RuntimeError, match="measurement process exited"):
        lab.run(experiments.run_allocator, base, "paged", _requests(), **kw, on_step=on_step)
    rec = lab.run(experiments.run_allocator, base, "paged", _requests()[:1], **kw)
    assert rec.steps > 0 and lab.pid != pid


def test_claims_measurement_in_the_lab_holds_the_core_and_leaves_it_serving(lab):
    from engine.lab.claims_live import measure_live

    c = EngineClient(EngineConfig(**CFG))
    try:
        said = []
        res = measure_live(c, progress=lambda f, s: said.append(s))
        assert said and said[-1] == "done"  # progress reached this process
        assert set(res["decode_step_s"]) and res["bandwidth_gb_s"] > 0
        assert all("process of its own" in r.source for r in res["rows"] if getattr(r, "source", None))
        h = c.submit("Hello", SamplingParams(max_tokens=4))  # the hold was released
        assert h.result(timeout=WAIT_S).finished
        c.check_invariants()
    finally:
        c.close()


def test_watch_mode_steps_in_the_lab_and_the_page_controls_it_from_here(lab):
    """The Speculative page's watch mode (engine/lab/watch.watch_in_lab): the private engine steps
    in the lab process; every step's snapshot reaches this process's WatchControl, and the Evict
    button pressed here (from another thread, as the page's) is served there; greedy output stays
    plain decoding's. Then Stop, pressed here, aborts the next run there."""
    import threading

    from engine import SpeculativeConfig
    from engine.lab.watch import WatchControl, watch_in_lab, watch_speculative

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    base, prompt = EngineConfig(**CFG), "the cat sat on the mat and the cat sat on the"
    ctl, steps, fired = WatchControl(), [], threading.Event()

    def on_step(snap, _note):
        if snap is None:
            return
        steps.append(snap.step)
        assert ctl.snapshot is snap  # the step's snapshot landed on the page's control first
        r = snap.request("watch")
        if r is not None and r.output_len >= 5 and not fired.is_set():
            fired.set()
            threading.Thread(target=ctl.request_evict).start()

    res = watch_in_lab(base, prompt, spec, 24, ctl, chat=False, on_step=on_step)
    assert lab.pid not in (None, os.getpid())
    assert [e.trigger for e in res.evictions] == ["button"] and list(ctl.evictions) == res.evictions
    assert res.request.num_preemptions == 1 and res.matches_plain is True
    assert steps == sorted(steps) and len(steps) >= res.request.output_len // 5
    here = watch_speculative(base, prompt, spec, 24, WatchControl(), chat=False)
    assert res.plain_token_ids == here.plain_token_ids  # the same output as in this process

    stop = WatchControl()
    stopped = watch_in_lab(
        base, prompt, spec, 64, stop, chat=False, on_step=lambda snap, _n: snap is not None and stop.stop.set()
    )
    assert stopped.stopped and stopped.request.state == "aborted"
