"""Concurrency (issue 7, item 5) and resource bounds (item 6).

Several threads share one EngineThread (tiny model, a pool far below demand): submitters that
stream, an aborter, an evicter, a KV-budget changer, a reconfigurer and a snapshot/event reader,
all at once. Only the documented exceptions may occur (ValueError for bad or stale input,
EngineCrashed for requests aborted by a reconfiguration; a submit during a reconfiguration waits
for the new engine); every handle ends; every request that finished normally has exactly the tokens of a clean run;
the invariants hold afterwards and the pool ends free or cached-free.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.thread import EngineCrashed, EngineThread
from engine.observe.recording import drive
from tests.waiting import wait_until

TINY = dict(
    model="tiny",
    device="cpu",
    num_kv_blocks=24,
    block_size=8,
    max_model_len=256,
    max_num_seqs=6,
    preemption_mode="swap",
    swap_space_bytes=4 * 8 * 512,
)
PROMPTS = [
    f"Request {i}: review {w} before the freeze"
    for i, w in enumerate(
        [
            "the allocator",
            "block tables",
            "the scheduler",
            "prefix hashes",
            "swap space",
            "the sampler",
            "copy-on-write",
            "the event ring",
        ]
    )
]
SYSTEM = "You are the release reviewer. Answer in one line. " * 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference(prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    eng = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=256, block_size=8, max_model_len=256))
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[prompts[int(o.request_id[1:])]] = o.outputs[0].token_ids
    return out


def wait_idle(th: EngineThread, what: str = "the engine to go idle", limit: float = 300.0) -> None:
    """Hang guard while another thread finishes work (not a speed assertion)."""

    def idle() -> bool:
        with th.lock:
            return not th.engine.has_unfinished_requests()

    wait_until(idle, what, limit)


def test_many_threads_submit_stream_abort_evict_and_reconfigure():
    prompts = [SYSTEM + p for p in PROMPTS] + PROMPTS
    max_tokens = 10
    ref = reference(prompts, max_tokens)
    th = EngineThread(LLMEngine(EngineConfig(**TINY)))
    stop = threading.Event()
    lock = threading.Lock()
    handles: list = []
    results: dict[str, tuple] = {}  # rid -> ("ok", tokens, prompt) / ("crashed", msg)
    unexpected: list[str] = []
    counts = {"aborts": 0, "evictions": 0, "budget": 0, "reconfigure": 0, "rejected": 0, "snapshots": 0}

    def guard(fn):
        def run(*a):
            try:
                fn(*a)
            except Exception as e:  # noqa: BLE001 - anything reaching here is a finding
                unexpected.append(f"{fn.__name__}: {type(e).__name__}: {e}")

        return run

    protected: set[str] = set()  # submitter 3's requests: never aborted on purpose

    @guard
    def submitter(k: int):
        rng = random.Random(k)
        for _j in range(8 if k == 3 else 6):
            p = rng.choice(prompts)
            try:
                if rng.random() < 0.15:  # some bad input mixed in: rejected, nothing else affected
                    th.submit("", SamplingParams(max_tokens=3))
                    unexpected.append("empty prompt accepted")
                    continue
                h = th.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            except ValueError:
                with lock:
                    counts["rejected"] += 1
                continue
            with lock:
                handles.append(h)
                if k == 3:
                    protected.add(h.request_id)
            try:
                text = "".join(h.stream(timeout=300))
                out = h.result(timeout=300)
                results[h.request_id] = ("ok", out.outputs[0].token_ids, p, out.outputs[0].finish_reason, text)
            except EngineCrashed as e:
                results[h.request_id] = ("crashed", str(e))

    @guard
    def aborter():
        rng = random.Random(100)
        while not stop.is_set():
            with lock:
                live = [h for h in handles if not h.finished and h.request_id not in protected]
            if live and rng.random() < 0.3:
                if th.abort(rng.choice(live).request_id):
                    with lock:
                        counts["aborts"] += 1
            th.abort("never-submitted")  # harmless
            time.sleep(0.03)  # the stress worker's pace (its behaviour), not a wait for a state

    @guard
    def evicter():
        rng = random.Random(200)
        while not stop.is_set():
            running = th.snapshot_now().running_ids
            if running:
                try:
                    th.evict(rng.choice(running))
                    with lock:
                        counts["evictions"] += 1
                except ValueError as e:  # finished/preempted between the snapshot and the call
                    assert "not running" in str(e) or "nothing to evict" in str(e), e
            time.sleep(0.02)  # the stress worker's pace, not a wait for a state

    @guard
    def budgeter():
        rng = random.Random(300)
        while not stop.is_set():
            try:
                th.set_kv_budget(rng.randint(10, 24))
                with lock:
                    counts["budget"] += 1
            except ValueError as e:  # the engine was swapped for one with another pool
                assert "allocated pool" in str(e), e
            time.sleep(0.05)  # the stress worker's pace, not a wait for a state

    @guard
    def reconfigurer():
        for i, blocks in enumerate((20, 24)):

            def submitted(n=4 * (i + 1)) -> bool:
                with lock:
                    return len(handles) >= n

            wait_until(submitted, "requests in flight before the rebuild", 300)
            msg = th.reconfigure(th.config.replace(num_kv_blocks=blocks))
            assert msg.startswith("engine rebuilt"), msg
            with lock:
                counts["reconfigure"] += 1

    @guard
    def reader():
        seq = 0
        while not stop.is_set():
            snap = th.snapshot()
            assert snap.info.num_blocks >= 1
            th.recent_snapshots()
            evs = th.events.since(seq)
            if evs:
                seq = evs[-1].seq
            with lock:
                counts["snapshots"] += 1
            time.sleep(0.01)  # the stress worker's pace, not a wait for a state

    workers = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    helpers = [threading.Thread(target=f) for f in (aborter, evicter, budgeter, reader)]
    reconf = threading.Thread(target=reconfigurer)
    try:
        for t in workers + helpers + [reconf]:
            t.start()
        for t in workers + [reconf]:
            t.join(600)
        stop.set()
        for t in helpers:
            t.join(60)
        assert not any(t.is_alive() for t in workers + helpers + [reconf]), "a thread hung"
        assert unexpected == []
        assert th.healthy
        assert all(h.finished for h in handles), "a handle never ended"
        wait_idle(th)
        with th.lock:
            th.engine.check_invariants()
            bm = th.engine.bm
            assert bm.is_empty and bm.num_swap_used == 0 and bm.num_free_blocks == bm.num_blocks
        outcome = [r[3] if r[0] == "ok" else "crashed" for r in results.values()]
        print({**counts, **{k: outcome.count(k) for k in set(outcome)}})
        assert counts["reconfigure"] == 2 and counts["budget"] > 0 and counts["snapshots"] > 0
        done = [r for r in results.values() if r[0] == "ok" and r[3] == "length"]
        assert sum(1 for rid in protected if results[rid][0] == "ok") >= 6  # two reconfigurations abort <= 2
        assert len(results) == len(handles) >= 20
        for _, toks, p, _, _text in done:
            assert toks == ref[p]  # unchanged by everyone else's chaos
        for r in results.values():
            if r[0] == "ok":
                assert r[3] in ("length", "abort")
            else:
                assert "reconfigured" in r[1] or "abort" in r[1], r
        # the engine keeps serving afterwards
        h = th.submit(prompts[0], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert h.result(timeout=300).outputs[0].token_ids == ref[prompts[0]]
    finally:
        stop.set()
        th.shutdown()


def test_submit_during_a_reconfiguration_waits_for_the_new_engine():
    """Between the old loop's shutdown and the new loop's start, submit() used to raise
    EngineCrashed('engine is not running') although nothing had crashed; it now waits for the
    new engine and is served by it."""
    th = EngineThread(LLMEngine(EngineConfig(**TINY)))
    in_window, go = threading.Event(), threading.Event()
    orig_shutdown = th.shutdown

    def slow_shutdown(*args, **kwargs):  # reconfigure: the old loop stopped, the new not started
        n = orig_shutdown(*args, **kwargs)
        if not in_window.is_set():
            in_window.set()
            go.wait(60)
        return n

    box = {}
    try:
        th.shutdown = slow_shutdown
        t = threading.Thread(target=lambda: box.setdefault("msg", th.reconfigure(th.config.replace(num_kv_blocks=16))))
        t.start()
        assert in_window.wait(120)

        def late():
            try:
                box["h"] = th.submit(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
            except Exception as e:  # noqa: BLE001
                box["err"] = e

        s = threading.Thread(target=late)
        s.start()
        s.join(0.5)  # let it reach the window (a shorter wait only weakens the test)
        go.set()
        t.join(120)
        s.join(120)
        assert "err" not in box, box.get("err")
        assert box["h"].result(timeout=120).outputs[0].finish_reason == "length"
        assert th.engine.bm.num_blocks == 16
    finally:
        go.set()
        th.shutdown()


def test_concurrent_submits_get_unique_ids_and_exact_outputs():
    """16 threads submitting at the same instant (auto ids): no id is handed out twice, every
    output equals the clean run."""
    ref = reference(PROMPTS, 6)
    th = EngineThread(LLMEngine(EngineConfig(**dict(TINY, num_kv_blocks=64, max_num_seqs=16))))
    barrier = threading.Barrier(16)
    got, errors = {}, []

    def one(i):
        try:
            barrier.wait(60)
            p = PROMPTS[i % len(PROMPTS)]
            h = th.submit(p, SamplingParams(max_tokens=6, ignore_eos=True))
            got[h.request_id] = (p, h.result(timeout=300).outputs[0].token_ids)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        assert errors == [] and len(got) == 16
        for p, toks in got.values():
            assert toks == ref[p]
        wait_idle(th)
        with th.lock:
            th.engine.check_invariants()
    finally:
        th.shutdown()


# ---------------------------------------------------------------- resource bounds


def test_event_ring_snapshots_and_request_histories_are_bounded():
    cfg = EngineConfig(**dict(TINY, event_ring_size=64, history_len=8, num_kv_blocks=64))
    eng = LLMEngine(cfg)
    assert eng.events.maxlen == 64
    assert eng.finished.maxlen is not None and eng.finished.maxlen <= 64
    eng.add_request("long", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    req = eng.requests["long"]
    assert req.history.maxlen == 8  # EngineConfig.history_len
    assert req.token_marks.maxlen is not None
    for _ in range(90):
        eng.step()
    assert len(eng.events) == 64 and eng.events.last_seq > 64
    seqs = [e.seq for e in eng.events]
    assert seqs == list(range(eng.events.last_seq - 63, eng.events.last_seq + 1))  # the newest kept
    assert len(req.history) == 8
    snap = eng.snapshot()
    assert all(len(r.history) <= 8 for r in snap.requests)
    m = eng.metrics
    assert all(d.maxlen is not None for d in (m.ttft, m.tpot, m.e2e))
    th = EngineThread(eng, keep_snapshots=5, snapshot_interval=0.0)
    try:
        for i in range(4):
            th.submit(PROMPTS[i], SamplingParams(max_tokens=12, ignore_eos=True)).result(timeout=300)
        assert th.recent.maxlen == 5 and len(th.recent) <= 5
        assert len(th.recent_snapshots()) <= 5
        assert not th.handles  # finished handles are dropped
    finally:
        th.shutdown()
    assert not eng.requests and len(eng.finished) <= eng.finished.maxlen


def test_many_requests_leave_no_per_request_state_behind():
    """300 short requests through one engine: finished requests are forgotten except the last
    few (eng.finished), and no block table, hash memo or swap slot is left over."""
    eng = LLMEngine(EngineConfig(**dict(TINY, num_kv_blocks=16)))
    for i in range(300):
        eng.add_request(f"q{i}", [1 + i % 50, 2, 3, 4 + i % 7], SamplingParams(max_tokens=2, ignore_eos=True))
        if i % 3 == 2:
            eng.abort_request(f"q{i}")
        if i % 10 == 0:
            drive(eng)
    drive(eng)
    bm = eng.bm
    assert not eng.requests and len(eng.finished) == eng.finished.maxlen
    assert bm.is_empty
    assert bm.num_cached_hashes <= bm.num_blocks
    assert len(eng.events) <= eng.events.maxlen


def test_recent_snapshots_are_bounded_by_size_not_only_count():
    """EngineThread.recent kept 600 whole snapshots whatever the pool size: ~350 MiB at the
    default 4096-block pool, tens of GiB for a pool of a million blocks. Its total number of
    block and token entries is now capped (RECENT_MAX_ITEMS)."""
    from engine.core import thread as T

    eng = LLMEngine(EngineConfig(**dict(TINY, num_kv_blocks=20_000)))
    th = EngineThread(eng, snapshot_interval=0.0)
    try:
        hs = [th.submit(p, SamplingParams(max_tokens=80, ignore_eos=True)) for p in PROMPTS[:4]]
        for h in hs:
            h.result(timeout=600)
        with th.lock:
            snaps = list(th.recent)
        assert len(snaps) >= 2
        items = sum(T.snapshot_items(s) for s in snaps)
        assert items <= T.RECENT_MAX_ITEMS
        assert len(snaps) <= T.RECENT_MAX_ITEMS // 20_000 < 80 <= eng.step_num  # fewer kept than published
        assert snaps[-1].step == max(s.step for s in snaps)  # the newest are the ones kept
    finally:
        th.shutdown()
