"""LLMEngine's own logic on the tiny random model: the pool sizing call, add_request's
bookkeeping around its checks (the messages themselves: tests/engine/test_bad_input.py), one
step's schedule -> forward -> output, abort, evict and the live budget. Token equality with
transformers is the exactness suite's; the Scheduler's decisions are test_scheduler.py's."""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.core import pool_sizing
from engine.core.engine import LLMEngine
from engine.core.sequence import Status, WaitReason
from engine.model.kv_layout import kv_bytes_per_token
from engine.observe.recording import drive
from engine.observe.trace_events import EventKind
from tests.engine.engines import tiny_engine

PROMPT = [5, 6, 7, 8, 9]


def tiny(**kw) -> LLMEngine:
    return tiny_engine(**{**dict(block_size=4, num_kv_blocks=32, max_model_len=128), **kw})


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def events(eng, kind):
    return [(e.request_id, e.data) for e in eng.events if e.kind == kind]


# ---------------------------------------------------------------- pool sizing


def test_the_pool_is_sized_by_pool_sizing_from_the_kv_formula(monkeypatch):
    seen = {}

    def pool_blocks(config, bytes_per_block, device_type, gpu_blocks, **kw):
        seen.update(config=config, bytes_per_block=bytes_per_block, device_type=device_type)
        return 7, "test"

    monkeypatch.setattr(pool_sizing, "pool_blocks", pool_blocks)
    eng = tiny(num_kv_blocks=None, kv_cache_bytes=1 << 20, preemption_mode="swap", swap_space_bytes=4096)
    r = eng.runner
    # the tiny model: 2 layers, 2 KV heads, head_dim 16, fp32 pool
    assert (r.num_layers, r.num_kv_heads, r.head_dim) == (2, 2, 16)
    assert eng.bytes_per_token == kv_bytes_per_token(2, 2, 16, 4) == 512
    assert seen == {"config": eng.config, "bytes_per_block": 512 * 4, "device_type": "cpu"}
    assert eng.bm.num_blocks == eng.bm.capacity == 7
    assert eng.bm.num_swap_blocks == pool_sizing.swap_blocks(eng.config, 2048) == 2
    info = eng.info()
    assert (info.num_blocks, info.bytes_per_block, info.kv_cache_bytes) == (7, 2048, 7 * 2048)
    (_, started), *_ = events(eng, EventKind.CONFIG)
    assert started == {
        "model": "tiny",
        "num_blocks": 7,
        "block_size": 4,
        "bytes_per_token": 512,
        "reason": "engine started",
    }


def test_an_int8_pool_counts_its_row_scales():
    eng = tiny(kv_cache_dtype="int8")
    assert eng.bytes_per_token == kv_bytes_per_token(2, 2, 16, 1, scale_bytes=4) == 2 * 2 * 2 * (16 + 4)


# ---------------------------------------------------------------- add_request


def test_add_request_queues_without_allocating():
    eng = tiny()
    a = eng.add_request(None, PROMPT, greedy(3))
    b = eng.add_request(None, "hello there", greedy(3, tier="pro"))
    assert (a, b) == ("req-0", "req-1")
    ra, rb = eng.requests[a], eng.requests[b]
    assert list(eng.scheduler.waiting) == [ra, rb]
    assert ra.status == Status.WAITING
    assert (ra.wait_reason, ra.wait_reason_text) == (WaitReason.QUEUED, "queued")
    assert [p.phase for p in ra.history] == ["waiting"]
    assert (ra.prompt_text, ra.tier, ra.priority, ra.request_class) == ("", None, 0, "default")
    assert (rb.prompt_text, rb.tier, rb.priority, rb.request_class) == ("hello there", "pro", 1, "pro")
    assert rb.prompt_token_ids == list(eng.tokenizer.encode("hello there", add_special_tokens=False))
    assert eng.bm.is_empty and eng.get_num_unfinished_requests() == 2
    assert events(eng, EventKind.ADMIT) == []  # admission is the scheduler's, at the next step


def test_a_rejected_prompt_is_recorded_and_queues_nothing():
    eng = tiny()
    with pytest.raises(ValueError) as e:
        eng.add_request("long", list(range(10, 140)), greedy(1))
    assert events(eng, EventKind.REJECT) == [("long", {"reason": str(e.value)})]
    assert eng.metrics.num_rejected == 1
    assert "long" not in eng.requests and not eng.scheduler.waiting and eng.bm.is_empty


def test_id_checks_come_before_the_rejection_record():
    eng = tiny()
    eng.add_request("x", PROMPT, greedy(1))
    for rid in ("x", "y#draft", ""):
        with pytest.raises(ValueError):
            eng.add_request(rid, PROMPT, greedy(1))
    assert events(eng, EventKind.REJECT) == [] and eng.metrics.num_rejected == 0
    assert list(eng.requests) == ["x"]


def test_admission_check_reads_only():
    eng = tiny(num_kv_blocks=4)  # 16 tokens of pool
    before = eng.bm.fingerprint()
    assert eng.admission_check(PROMPT, greedy(8)) is None  # no tier named, none by default
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        eng.admission_check(PROMPT, greedy(12))
    assert eng.bm.fingerprint() == before and not eng.requests and list(eng.events)[-1].kind == EventKind.CONFIG


# ---------------------------------------------------------------- step


def test_an_empty_step_counts_and_returns_nothing():
    eng = tiny()
    assert eng.step() == [] and eng.step() == []
    assert eng.step_num == 2 and events(eng, EventKind.SCHEDULE) == []


def test_a_request_from_prefill_to_finish():
    eng = tiny()
    rid = eng.add_request(None, PROMPT, greedy(3))
    outs = []
    while eng.has_unfinished_requests():
        outs.append(eng.step())
        eng.check_invariants()
    assert eng.step_num == 3
    rows = [d["rows"] for _, d in events(eng, EventKind.SCHEDULE)]
    assert rows == [[[rid, "prefill", 5, 0]], [[rid, "decode", 1, 5]], [[rid, "decode", 1, 6]]]
    assert [len(o[0].outputs[0].token_ids) for o in outs] == [1, 2, 3]
    last = outs[-1][0]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert not any(o[0].finished for o in outs[:-1])
    # finished: out of the queues and the live table, its blocks released, still found by id
    assert rid not in eng.requests and eng.get_request(rid).status == Status.FINISHED
    assert not eng.bm.has_table(rid) and eng.bm.num_free_blocks == eng.bm.num_blocks
    (_, fin), *_ = events(eng, EventKind.FINISH)
    assert fin["finish_reason"] == "length" and fin["output_tokens"] == 3
    assert eng.get_num_unfinished_requests() == 0


def test_a_failing_forward_fails_only_that_steps_requests():
    eng = tiny()
    a = eng.add_request("a", PROMPT, greedy(4))
    eng.step()

    def boom(items):
        raise RuntimeError("injected")

    eng.fault_injector = boom
    b = eng.add_request("b", [11, 12, 13], greedy(2))
    outs = eng.step()
    assert {o.request_id for o in outs} == {a, b} and all(o.finished for o in outs)
    assert eng.metrics.num_errors == 1 and eng.bm.num_free_blocks == eng.bm.num_blocks
    eng.fault_injector = None
    c = eng.add_request("c", PROMPT, greedy(1))
    assert [o.request_id for o in eng.step()] == [c]


# ---------------------------------------------------------------- abort / evict / budget


def test_abort_is_harmless_for_unknown_and_finished_ids():
    eng = tiny()
    w = eng.add_request("w", PROMPT, greedy(5))
    r = eng.add_request("r", [11, 12, 13], greedy(5))
    eng.step()  # both running now
    held = eng.bm.table(r)
    assert eng.abort_request("nobody") is False
    assert eng.abort_request([r, "nobody"]) is True
    assert eng.get_request(r).status == Status.ABORTED and eng.abort_request(r) is False
    assert (r, {"blocks": held, "reason": "abort"}) in events(eng, EventKind.BLOCK_FREE)
    (_, ab), *_ = events(eng, EventKind.ABORT)
    assert ab["finish_reason"] == "abort" and ab["output_tokens"] == 1
    assert [q.request_id for q in eng.scheduler.running] == [w]
    eng.check_invariants()


def test_evict_frees_a_running_request_and_it_recomputes():
    eng = tiny()
    rid = eng.add_request("e", PROMPT, greedy(4))
    with pytest.raises(ValueError, match="is waiting, not running"):
        eng.evict(rid)
    eng.step()
    eng.step()  # 5 prompt + 2 output tokens, 6 computed: 2 blocks
    assert eng.evict(rid) == {"blocks_freed": 2, "tokens_to_recompute": 7}
    req = eng.requests[rid]
    assert req.status == Status.PREEMPTED and req.num_computed_tokens == 0 and eng.metrics.num_evictions == 1
    (_, ev), *_ = events(eng, EventKind.EVICT)
    assert ev["blocks_freed"] == 2 and ev["cached_tokens_dropped"] == 6
    outs = eng.step()  # readmitted: the 7 tokens recomputed in one chunk, then decoding goes on
    assert events(eng, EventKind.SCHEDULE)[-1][1]["rows"] == [[rid, "prefill", 7, 0]]
    assert len(outs[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="unknown or finished"):
        eng.evict("nobody")


def test_set_num_blocks_records_the_change():
    eng = tiny()
    eng.set_num_blocks(10)
    assert eng.bm.num_blocks == 10 and eng.info().num_blocks == 10
    (_, d), *_ = events(eng, EventKind.CONFIG)[1:]
    assert d == {"num_blocks": 10, "previous": 32, "reason": "KV budget changed from 32 to 10 blocks"}


def test_speculative_calibration_borrows_blocks_from_the_block_manager_and_gives_them_back():
    eng = tiny(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert eng.spec.calibration is not None and eng.spec.calibration["context"] == 32
    assert eng.bm.is_empty and eng.bm.free_block_ids() == list(range(eng.bm.num_blocks))
    assert all(not k.any() and not v.any() for k, v in eng.runner.kv_caches)  # zeroed again
    assert [e.kind for e in eng.events] == [EventKind.CONFIG]  # lent, not allocated: no event
    eng.check_invariants()


def test_each_engine_steps_at_its_own_thread_count(monkeypatch):
    """torch's thread count is one per process: building a 2-thread engine after a 1-thread one
    set it to 2; the 1-thread engine's forward still runs at 1 (the bench builds both side by side)."""
    import torch

    old = torch.get_num_threads()
    try:
        one, two = tiny(num_threads=1), tiny(num_threads=2)
        seen = {}
        for name, eng in (("one", one), ("two", two), ("one again", one)):
            forward = eng.runner.forward

            def spy(*a, _forward=forward, _name=name, **kw):
                seen[_name] = torch.get_num_threads()
                return _forward(*a, **kw)

            monkeypatch.setattr(eng.runner, "forward", spy)
            eng.add_request(f"r-{name}", [1, 2, 3], greedy(1))
            drive(eng)
        assert seen == {"one": 1, "two": 2, "one again": 1}
    finally:
        torch.set_num_threads(old)
