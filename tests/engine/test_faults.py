"""Fault handling (issue 7, item 2).

- An exception inside a step (engine.fault_injector, called right before the forward; or a
  forward that fails after writing K/V) fails only the requests in that step, with a clear
  error, and frees their blocks; the engine keeps serving everyone else, token for token.
- EngineThread surfaces a crashed loop: waiting clients get EngineCrashed instead of hanging,
  healthy is False, restart() brings it back.
- Aborting unknown or finished requests is harmless; shutdown joins the thread and frees memory.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.core.thread import EngineCrashed, EngineThread
from tests.engine.engines import run_to_end, tiny_engine
from tests.waiting import wait_until

PROMPTS = [
    "The release freeze starts tonight",
    "def allocate(self, n):\n    return",
    "Explain paged attention in one line",
    "KV cache blocks are",
    "Why is the queue stuck?",
    "Review this diff: - x = 1 + x = 2",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model is faster on one intra-op thread, and the machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> LLMEngine:
    return tiny_engine(**{**dict(device="cpu", num_kv_blocks=64, block_size=8, max_model_len=512), **kw})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def run_alone(prompt, n: int) -> list[int]:
    eng = tiny()
    eng.add_request("ref", prompt, greedy(n))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    return tuple(out.outputs[0].token_ids)


def drain(eng: LLMEngine, check: bool = True) -> dict:
    return run_to_end(eng, check=check)


def assert_idle_and_clean(eng: LLMEngine) -> None:
    eng.check_invariants()
    bm = eng.bm
    assert not eng.has_unfinished_requests() and not eng.requests
    assert bm.is_empty and bm.num_swap_used == 0
    assert bm.num_free_blocks == bm.num_blocks  # every block free or cached-free
    assert all(bm.ref_count(b) == 0 for b in range(bm.capacity))


# ---------------------------------------------------------------- faults inside a step


def test_injected_fault_fails_only_that_steps_requests_and_frees_their_blocks():
    eng = tiny(max_num_seqs=2)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], greedy(12))
    eng.step()
    eng.step()
    assert {r.request_id for r in eng.scheduler.running} == {"r0", "r1"}
    assert [r.request_id for r in eng.scheduler.waiting] == ["r2"]
    held_before = len(eng.bm.table("r0")) + len(eng.bm.table("r1"))
    assert held_before > 0
    free_before = eng.bm.num_free_blocks
    seen = []

    def boom(items):
        seen.append([it.req.request_id for it in items])
        raise RuntimeError("injected forward failure")

    eng.fault_injector = boom
    outs = eng.step()
    eng.fault_injector = None
    failed_step = eng.step_num
    assert seen == [["r0", "r1"]]
    assert {o.request_id for o in outs} == {"r0", "r1"}
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "error"
        assert o.error == f"step {failed_step} failed: RuntimeError: injected forward failure"
    assert not eng.bm.has_table("r0") and not eng.bm.has_table("r1")
    assert eng.bm.num_free_blocks == free_before + held_before
    eng.check_invariants()
    errs = [e for e in eng.events.since(0) if e.kind == "error"]
    assert {e.request_id for e in errs} == {"r0", "r1"}
    assert all("injected forward failure" in e.data["reason"] for e in errs)
    assert eng.metrics.num_errors == 1
    # the engine keeps serving: the waiting request and a new one complete, token-exact
    eng.add_request("r3", PROMPTS[3], greedy(10))
    final = drain(eng)
    assert set(final) == {"r2", "r3"}
    assert final["r2"].outputs[0].token_ids == list(run_alone(PROMPTS[2], 12))
    assert final["r3"].outputs[0].token_ids == list(run_alone(PROMPTS[3], 10))
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in final.values())
    assert_idle_and_clean(eng)


def test_forward_failing_after_writing_kv_leaves_no_trace():
    """The forward writes K/V into the failed requests' blocks and then raises: those blocks are
    freed with nothing registered in the prefix cache from the failed step, and a later request
    with the same prompt computes the same tokens as a clean run."""
    eng = tiny()
    orig = eng.runner.forward
    calls = {"n": 0}

    def flaky(rows):
        calls["n"] += 1
        out = orig(rows)  # K/V written into the pool
        if calls["n"] == 2:
            raise MemoryError("simulated allocator failure after the attention writes")
        return out

    eng.runner.forward = flaky
    eng.add_request("a", PROMPTS[4] * 3, greedy(8))
    eng.step()  # prefill ok
    eng.add_request("b", PROMPTS[5], greedy(8))
    outs = eng.step()  # a's decode + b's prefill fail together
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all("MemoryError: simulated allocator failure" in o.error for o in outs)
    eng.check_invariants()
    assert_idle_and_clean(eng)
    # same prompts again (prefix cache on): identical to a clean run
    eng.add_request("a2", PROMPTS[4] * 3, greedy(8))
    eng.add_request("b2", PROMPTS[5], greedy(8))
    final = drain(eng)
    assert final["a2"].outputs[0].token_ids == list(run_alone(PROMPTS[4] * 3, 8))
    assert final["b2"].outputs[0].token_ids == list(run_alone(PROMPTS[5], 8))
    assert_idle_and_clean(eng)


def test_intermittent_faults_under_memory_pressure_keep_survivors_exact():
    """Faults on every 5th step while a small pool forces preemption and swapping: every request
    either fails with the step error or finishes with the unconstrained output; invariants hold
    after every step; the pool and swap space end empty."""
    prompts = [p + " " + str(i) for i, p in enumerate(PROMPTS * 2)]
    ref = {f"q{i}": list(run_alone(p, 10)) for i, p in enumerate(prompts)}
    eng = tiny(num_kv_blocks=10, max_num_seqs=4, preemption_mode="swap", swap_space_bytes=3 * 8 * 512)
    assert eng.bm.num_swap_blocks == 3

    def now_and_then(items):
        if eng.step_num in (6, 17, 29):
            raise ValueError("flaky accelerator")

    eng.fault_injector = now_and_then
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, greedy(10))
    final = drain(eng)
    assert set(final) == set(ref)
    failed = {k for k, o in final.items() if o.outputs[0].finish_reason == "error"}
    ok = set(final) - failed
    assert failed and ok
    assert eng.scheduler.num_preemptions > 0
    for k in ok:
        assert final[k].outputs[0].token_ids == ref[k]
    for k in failed:
        assert "ValueError: flaky accelerator" in final[k].error
        assert final[k].outputs[0].token_ids == ref[k][: len(final[k].outputs[0].token_ids)]
    assert_idle_and_clean(eng)


# ---------------------------------------------------------------- aborts


def test_abort_of_unknown_finished_or_odd_ids_is_harmless():
    eng = tiny()
    eng.add_request("done", PROMPTS[0], greedy(3))
    drain(eng)
    eng.add_request("live", PROMPTS[1], greedy(20))
    eng.step()
    before = eng.snapshot()
    for rid in ("nope", "done", "", None, 123, ["nope", "done"], ("x",), []):
        assert eng.abort_request(rid) is False
    eng.check_invariants()
    after = eng.snapshot()
    assert after.blocks == before.blocks and after.running_ids == before.running_ids == ("live",)
    assert eng.abort_request("live") is True
    assert eng.abort_request("live") is False  # twice: harmless
    assert_idle_and_clean(eng)
    assert eng.get_request("live").finish_reason == "abort"


def test_evict_of_unknown_or_waiting_request_is_a_clear_value_error():
    eng = tiny(max_num_seqs=1)
    eng.add_request("a", PROMPTS[0], greedy(5))
    eng.add_request("b", PROMPTS[1], greedy(5))
    eng.step()
    with pytest.raises(ValueError, match="'nope' is not running \\(unknown or finished\\)"):
        eng.evict("nope")
    with pytest.raises(ValueError, match="'b' is waiting, not running: nothing to evict"):
        eng.evict("b")
    eng.check_invariants()
    drain(eng)
    with pytest.raises(ValueError, match="not running"):
        eng.evict("a")


# ---------------------------------------------------------------- EngineThread


def test_thread_step_fault_fails_its_clients_and_keeps_serving():
    th = EngineThread(tiny())
    try:
        gate = threading.Event()

        def fail_once(items):
            if not gate.is_set():
                gate.set()
                raise RuntimeError("boom in step")

        th.engine.fault_injector = fail_once
        h = th.submit(PROMPTS[0], greedy(5))
        with pytest.raises(EngineCrashed, match="RuntimeError: boom in step"):
            list(h.stream(timeout=60))
        out = h.result(timeout=60)  # result() hands back the failed output
        assert out.outputs[0].finish_reason == "error" and "boom in step" in out.error
        assert th.healthy
        h2 = th.submit(PROMPTS[1], greedy(6))
        assert h2.result(timeout=60).outputs[0].token_ids == list(run_alone(PROMPTS[1], 6))
        with th.lock:
            th.engine.check_invariants()
    finally:
        th.shutdown()


def test_thread_crashed_loop_wakes_clients_and_restart_recovers():
    th = EngineThread(tiny())
    try:
        assert th.healthy
        gate = threading.Event()
        orig = th.engine.scheduler.schedule

        def exploding(step):
            gate.wait(60)
            raise RuntimeError("scheduler state corrupted")

        with th.lock:
            th.engine.scheduler.schedule = exploding  # outside step()'s per-step guard
        h1 = th.submit(PROMPTS[0], greedy(50))
        h2 = th.submit(PROMPTS[1], greedy(50))
        results = {}

        def client(name, h):
            try:
                results[name] = list(h.stream(timeout=120))
            except Exception as e:
                results[name] = e

        ts = [threading.Thread(target=client, args=(n, h)) for n, h in (("h1", h1), ("h2", h2))]
        for t in ts:
            t.start()
        gate.set()
        for t in ts:
            t.join(120)
        for name in ("h1", "h2"):
            assert isinstance(results[name], EngineCrashed), results[name]
            assert "engine loop crashed: RuntimeError: scheduler state corrupted" in str(results[name])
        with pytest.raises(EngineCrashed):
            h1.result(timeout=60)
        wait_until(lambda: not th.loop_running, "the crashed loop to exit")
        assert not th.healthy
        assert th.error.startswith("engine loop crashed: RuntimeError")
        with pytest.raises(EngineCrashed, match="scheduler state corrupted"):
            th.submit(PROMPTS[2], greedy(3))
        msg = th.restart()
        assert msg.startswith("engine rebuilt")
        assert th.healthy and th.error is None
        assert th.engine.scheduler.schedule != exploding and orig is not None
        h3 = th.submit(PROMPTS[2], greedy(7))
        assert h3.result(timeout=60).outputs[0].token_ids == list(run_alone(PROMPTS[2], 7))
    finally:
        th.shutdown()


def test_thread_submit_racing_a_crash_never_hangs():
    """A submit that passed the health check while the loop was dying must not be left with a
    handle nobody will ever finish: it either raises EngineCrashed or its handle does."""
    th = EngineThread(tiny())
    real_lock = th.lock
    try:
        inside, go = threading.Event(), threading.Event()

        def exploding(step):
            inside.set()
            go.wait(60)
            raise RuntimeError("loop died")

        th.engine.scheduler.schedule = exploding
        th.submit(PROMPTS[0], greedy(4))
        assert inside.wait(60)  # the loop holds the lock inside step()
        box = {}

        def late():
            try:
                box["h"] = th.submit(PROMPTS[1], greedy(4))
            except EngineCrashed as e:
                box["err"] = e

        class Watched:  # th.lock, telling when the late submitter has passed the health check
            def __init__(self, lock):
                self.lock, self.reached = lock, threading.Event()

            def __enter__(self):
                if threading.current_thread().name == "late":
                    self.reached.set()
                return self.lock.__enter__()

            def __exit__(self, *exc):
                return self.lock.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(self.lock, name)

        th.lock = watched = Watched(real_lock)
        t = threading.Thread(target=late, name="late")
        t.start()
        assert watched.reached.wait(60)  # it passed the health check and queues on the lock
        go.set()
        t.join(60)
        assert not t.is_alive()
        if "h" in box:
            with pytest.raises(EngineCrashed):
                box["h"].result(timeout=30)  # TimeoutError here = a client left hanging
        else:
            assert "loop died" in str(box["err"])
    finally:
        th.lock = real_lock
        th.shutdown()


def test_thread_abort_unknown_and_finished_is_harmless():
    th = EngineThread(tiny())
    try:
        h = th.submit(PROMPTS[0], greedy(3))
        h.result(timeout=60)
        assert th.abort("nope") is False
        assert th.abort(h.request_id) is False
        assert th.healthy
        h2 = th.submit(PROMPTS[1], greedy(400))
        assert th.abort(h2.request_id) is True
        out = h2.result(timeout=60)
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert list(h2.stream(timeout=60)) is not None  # ends, does not hang
        with th.lock:
            assert_idle_and_clean(th.engine)
    finally:
        th.shutdown()


def test_shutdown_joins_thread_fails_waiters_and_frees_memory():
    th = EngineThread(tiny(max_num_seqs=1))
    hs = [th.submit(p, greedy(300)) for p in PROMPTS[:3]]
    with th.lock:
        th.engine.add_request("direct", PROMPTS[3], greedy(300))  # no handle
    th.shutdown()
    assert not th.loop_running
    assert not th.healthy
    for h in hs:
        assert h.finished
        with pytest.raises(EngineCrashed, match="engine shut down"):
            h.result(timeout=10)
    assert_idle_and_clean(th.engine)
    with pytest.raises(EngineCrashed):
        th.submit(PROMPTS[0], greedy(2))
    th.shutdown()  # twice: harmless


def test_reconfigure_aborts_in_flight_requests_with_a_message():
    th = EngineThread(tiny(max_model_len=4096, num_kv_blocks=600))
    try:
        hs = [th.submit(p, greedy(3000)) for p in PROMPTS[:2]]
        msg = th.reconfigure(th.config.replace(num_kv_blocks=32, max_model_len=512))
        assert msg == "engine rebuilt; 2 in-flight request(s) aborted"
        for h in hs:
            with pytest.raises(EngineCrashed, match="aborted: the engine was reconfigured"):
                h.result(timeout=10)
        assert th.healthy and th.engine.bm.num_blocks == 32
        h = th.submit(PROMPTS[2], greedy(5))
        assert h.result(timeout=60).outputs[0].token_ids == list(run_alone(PROMPTS[2], 5))
        with pytest.raises(ValueError, match="config must be an EngineConfig"):
            th.reconfigure({"num_kv_blocks": 8})
        with pytest.raises(ValueError, match="model="):
            th.reconfigure(th.config.replace(model="/no/such/model"))
        assert th.healthy  # a bad config leaves the old engine serving
        assert th.submit(PROMPTS[3], greedy(2)).result(timeout=60).finished
    finally:
        th.shutdown()


def test_sampling_failure_fails_only_that_request():
    """An exception while sampling one request's token (here: a temperature that overflows the
    logits, forced past validation) used to escape LLMEngine.step() and kill the EngineThread
    loop for every client. It now fails that request only."""
    th = EngineThread(tiny())
    try:
        bad = greedy(5)
        h_ok = th.submit(PROMPTS[0], greedy(8))
        bad_params = SamplingParams(temperature=1.0, seed=1, max_tokens=5)
        bad_params.temperature = 1e-300  # hostile mutation after validation
        h_bad = th.submit(PROMPTS[1], bad_params)
        out = h_bad.result(timeout=120)
        assert out.outputs[0].finish_reason == "error"
        assert "while sampling" in out.error and "RuntimeError" in out.error
        assert h_ok.result(timeout=120).outputs[0].token_ids == list(run_alone(PROMPTS[0], 8))
        assert th.healthy
        assert th.submit(PROMPTS[2], bad).result(timeout=120).finished
        with th.lock:
            assert_idle_and_clean(th.engine)
    finally:
        th.shutdown()
