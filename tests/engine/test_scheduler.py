"""The Scheduler's own logic, without a model: admission order, the token budget, max_num_seqs,
chunked prefill, the wait reasons (typed and shown), preemption's victim choice and modes.

A step here is `Scheduler.schedule` followed by what the output processor does to a row's
bookkeeping (tests/engine/test_output_processor.py covers the real one): the fed tokens become
computed (drafts rejected), and a row that reaches the end of its tokens gets one new token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Status, WaitReason
from engine.observe.trace_events import EventKind

BS = 4


class Rig:
    """A Scheduler on a real BlockManager, the swap copies and the clock stubbed, events kept."""

    def __init__(self, num_blocks=16, num_swap_blocks=0, **cfg):
        cfg.setdefault("max_model_len", 2048)  # no engine here to resolve None to the model's limit
        self.config = EngineConfig(block_size=BS, **cfg)
        c = self.config
        self.bm = BlockManager(
            num_blocks,
            BS,
            enable_prefix_caching=c.enable_prefix_caching,
            allocator=c.allocator,
            slab_tokens=c.max_model_len,
            num_swap_blocks=num_swap_blocks,
        )
        self.events: list[tuple[EventKind, str | None, dict]] = []
        self.swaps: list[tuple[str, list]] = []
        self.s = Scheduler(
            self.config,
            self.bm,
            lambda kind, rid, **data: self.events.append((kind, rid, data)),
            lambda pairs: self.swaps.append(("out", pairs)),
            lambda pairs: self.swaps.append(("in", pairs)),
            clock=lambda: 0.0,
            bytes_per_token=100,
        )
        self.step_num = 0

    def add(self, rid: str, prompt_len: int, priority: int = 0, first_token: int = 0) -> Request:
        ids = [first_token + i for i in range(prompt_len)]
        req = Request(rid, ids, SamplingParams(max_tokens=64), arrival_time=0.0, priority=priority)
        self.s.add(req)
        return req

    def step(self):
        self.step_num += 1
        out = self.s.schedule(self.step_num)
        for it in out.items:
            r = it.req
            r.num_computed_tokens += it.num_new_tokens - it.num_spec_tokens  # every draft rejected
            self.bm.commit(r.request_id, r.num_computed_tokens)
            r.spec_token_ids = []
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(1000 + len(r.output_token_ids))
                self.bm.cache_full_blocks(r.request_id, r.all_token_ids, None)
        self.bm.check_invariants()
        return out

    def kinds(self, kind):
        return [(rid, d) for k, rid, d in self.events if k == kind]


def rows(out):
    return [(it.req.request_id, it.num_new_tokens, it.num_spec_tokens) for it in out.items]


def test_admission_is_first_come_first_served_with_counters_and_events():
    g = Rig()
    a, b, c = g.add("a", 5), g.add("b", 3, first_token=100), g.add("c", 6, first_token=200)
    out = g.step()
    assert rows(out) == [("a", 5, 0), ("b", 3, 0), ("c", 6, 0)]
    assert out.num_batched_tokens == 14 and out.preempted == []
    assert [r.admit_order for r in (a, b, c)] == [0, 1, 2]
    assert all(r.status == Status.RUNNING and r.wait_reason is None and r.wait_reason_text is None for r in (a, b, c))
    admits = g.kinds(EventKind.ADMIT)
    assert [rid for rid, _ in admits] == ["a", "b", "c"]
    assert admits[0][1] == {
        "resumed": False,
        "prompt_tokens": 5,
        "tokens_to_compute": 5,
        "cached_tokens": 0,
        "num_blocks": 2,
        "reason": "blocks and budget available",
    }
    assert [len(g.bm.table(r)) for r in "abc"] == [2, 1, 2]
    # next step: each is one decode row
    assert rows(g.step()) == [("a", 1, 0), ("b", 1, 0), ("c", 1, 0)]


def test_token_budget_chunks_a_long_prompt_and_holds_the_queue():
    g = Rig(max_num_batched_tokens=8)
    a, b = g.add("a", 20), g.add("b", 3, first_token=100)
    assert rows(g.step()) == [("a", 8, 0)]
    assert b.wait_reason == WaitReason.TOKEN_BUDGET
    assert b.wait_reason_text == "token budget (max_num_batched_tokens) used up this step"
    assert a.num_computed_tokens == 8 and not a.output_token_ids  # a chunk emits nothing
    assert rows(g.step()) == [("a", 8, 0)]
    assert rows(g.step()) == [("a", 4, 0), ("b", 3, 0)]  # the last chunk leaves room for b
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    # the budget counts the running rows first: no WAIT event for a token-budget wait
    assert g.kinds(EventKind.WAIT) == []


def test_seq_limit_and_queued_behind_it():
    g = Rig(max_num_seqs=2)
    g.add("a", 4)
    g.add("b", 4, first_token=50)
    c, d = g.add("c", 4, first_token=100), g.add("d", 4, first_token=150)
    assert rows(g.step()) == [("a", 4, 0), ("b", 4, 0)]
    assert c.wait_reason == WaitReason.SEQ_LIMIT and c.wait_reason_text == "seq limit: max_num_seqs=2 running"
    assert d.wait_reason == WaitReason.QUEUED and d.wait_reason_text == "queued behind earlier requests (FCFS)"
    assert [r.request_id for r in g.s.waiting] == ["c", "d"]


def test_no_free_blocks_waits_with_one_wait_event_and_counts_for_memory():
    g = Rig(num_blocks=4)
    g.add("a", 12)  # 3 of the 4 blocks
    b = g.add("b", 8, first_token=100)  # needs 2
    assert rows(g.step()) == [("a", 12, 0)]
    assert b.wait_reason == WaitReason.NO_FREE_BLOCKS
    first = "no free KV blocks: needs 2, 1 free"
    assert b.wait_reason_text == first
    assert g.s.waiting_for_memory()
    g.step()  # a's next token takes the last block: the sentence changes, the typed reason does not
    g.step()
    assert b.wait_reason_text == "no free KV blocks: needs 2, 0 free"
    assert g.kinds(EventKind.WAIT) == [("b", {"wait_reason": WaitReason.NO_FREE_BLOCKS, "reason": first})]


def test_prefix_hit_is_taken_at_admission_leaving_the_last_token_to_compute():
    g = Rig()
    g.add("a", 9)
    g.step()
    g.s.remove(g.s.running[0])  # a finishes: its full blocks stay cached-free
    b = g.add("b", 9)  # the same 9 tokens: 2 full blocks cached, the 9th recomputed
    assert rows(g.step()) == [("b", 1, 0)]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 9
    (rid, hit), *_ = g.kinds(EventKind.PREFIX_HIT)
    assert rid == "b" and hit["tokens"] == 8 and len(hit["blocks"]) == 2
    assert (g.bm.prefix_queries, g.bm.prefix_hits) == (18, 8)


def _two_decoding(policy: str, preemption_mode: str = "recompute", num_swap_blocks: int = 0) -> Rig:
    """a then b admitted, each exactly filling its blocks, so the next decode of each needs a
    new block; the pool has none left."""
    g = Rig(num_blocks=4, num_swap_blocks=num_swap_blocks, victim_policy=policy, preemption_mode=preemption_mode)
    g.add("a", 7)
    g.step()  # a: 7 tokens computed + 1 emitted = 8 (2 blocks, full at the next decode)
    g.add("b", 7, first_token=100)
    g.step()  # b admitted; a decodes its 8th token into block 2
    return g


def test_last_admitted_victim_and_recompute_preemption():
    g = _two_decoding("last_admitted")
    a, b = g.s.running
    out = g.step()  # a needs a 3rd block: b, admitted last, is preempted
    assert rows(out) == [("a", 1, 0)]
    assert out.preempted == [b]
    assert b.status == Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert g.s.waiting[0] is b and not g.bm.has_table("b")
    # preempted, then (same step, front of the queue) held back: someone was preempted
    assert b.wait_reason == WaitReason.MEMORY_PRESSURE
    assert b.wait_reason_text == "not admitted: memory pressure (a request was preempted this step)"
    (rid, pre), *_ = g.kinds(EventKind.PREEMPT)
    assert rid == "b" and pre["mode"] == "recompute" and pre["blocks_freed"] == 2
    assert pre["tokens_to_recompute"] == b.num_tokens == 8
    assert pre["reason"] == "no free KV blocks: a needs 1 more, 0 free; policy last_admitted"
    (_, w), *_ = g.kinds(EventKind.WAIT)
    assert w["wait_reason"] == WaitReason.MEMORY_PRESSURE


def _three_small_one_large(policy: str) -> Rig:
    """a, b, c (1 block each) then d (3 blocks) fill a 6-block pool; the next step a's and b's
    5th tokens each need a 2nd block."""
    g = Rig(num_blocks=6, victim_policy=policy)
    g.add("a", 3)
    g.add("b", 3, first_token=100)
    g.add("c", 3, first_token=200)
    g.step()
    g.add("d", 12, first_token=300)
    g.step()
    assert g.bm.num_free_blocks == 0
    return g


@pytest.mark.parametrize(
    "policy,preempted,ran",
    [
        ("lru", ["c", "d"], ["a", "b"]),  # for a: c, scheduled longest ago; for b: d, the only one left
        ("last_admitted", ["d"], ["a", "b", "c"]),  # for a: d, admitted last; its 3 blocks serve b and c too
    ],
)
def test_victim_policies(policy, preempted, ran):
    g = _three_small_one_large(policy)
    a, b, c, d = g.s.running
    b.last_scheduled_step, c.last_scheduled_step, d.last_scheduled_step = 2, 1, 2
    out = g.step()
    assert [r.request_id for r in out.preempted] == preempted
    assert [r for r, *_ in rows(out)] == ran


def test_lru_ties_go_to_the_earlier_admitted():
    g = _three_small_one_large("lru")
    for r in g.s.running:
        r.last_scheduled_step = 2
    # a's victim: b (admitted before c and d); then c's: d, the only one neither run nor gone
    assert [r.request_id for r in g.step().preempted] == ["b", "d"]


def test_priority_before_admission_order_under_last_admitted():
    g = Rig(num_blocks=6, victim_policy="last_admitted")
    g.add("a", 3, priority=0)
    g.add("b", 3, priority=5, first_token=100)  # lowest priority (highest number)
    g.add("c", 3, priority=0, first_token=200)
    g.step()
    g.add("d", 12, first_token=300)  # takes the last 3 free blocks once a, b, c hold one each
    g.step()
    a = g.s.running[0]
    assert a.request_id == "a" and g.bm.num_free_blocks == 0
    out = g.step()  # a's and c's 5th tokens each need a 2nd block
    # for a: b, the lowest priority; for c: d, the last admitted (b is gone, a already ran)
    assert [r.request_id for r in out.preempted] == ["b", "d"]
    assert rows(out) == [("a", 1, 0), ("c", 1, 0)]


def test_drafts_are_given_up_before_anyones_cache():
    g = Rig(num_blocks=3)
    g.add("a", 6)
    g.step()  # 6 computed + 1 emitted: 7 tokens, 2 blocks, one free slot left in block 2
    a = g.s.running[0]
    g.add("b", 2, first_token=100)
    g.step()  # b takes the last free block; a decodes position 6
    assert g.bm.num_free_blocks == 0
    a.spec_token_ids = [5, 6, 7]  # positions 7..10 would need a third block; position 7 fits
    out = g.step()
    assert rows(out) == [("a", 1, 0), ("b", 1, 0)] and out.preempted == []


def test_drafts_are_fed_after_the_last_token_when_blocks_allow():
    g = Rig(num_blocks=8)
    g.add("a", 6)
    g.step()
    a = g.s.running[0]
    a.spec_token_ids = [5, 6, 7]
    assert rows(g.step()) == [("a", 4, 3)]
    a.spec_token_ids = [5, 6]
    g.s.running[0].output_token_ids.append(9)  # a prefill-like tail of 2 tokens: no drafts then
    assert rows(g.step()) == [("a", 2, 0)]


def test_a_request_alone_without_blocks_preempts_itself():
    g = Rig(num_blocks=2)
    g.add("a", 8)
    g.step()  # 8 computed + 1 emitted: the 9th token needs a 3rd block, there is none
    out = g.step()
    assert out.items == [] and [r.request_id for r in out.preempted] == ["a"]
    assert g.s.waiting[0].request_id == "a" and g.bm.num_free_blocks == 2


def test_swap_preemption_and_swap_back_in():
    g = _two_decoding("last_admitted", preemption_mode="swap", num_swap_blocks=4)
    a, b = g.s.running
    out = g.step()
    assert out.preempted == [b] and b.status == Status.SWAPPED and list(g.s.swapped) == [b]
    assert b.num_computed_tokens == 7  # kept, in swap space
    assert g.swaps[0][0] == "out" and len(g.swaps[0][1]) == 2
    assert [d["mode"] for _, d in g.kinds(EventKind.PREEMPT)] == ["swap"]
    g.s.remove(a)  # a finishes: its blocks let b swap back in
    out = g.step()
    assert b.status == Status.RUNNING and g.swaps[-1][0] == "in"
    assert rows(out) == [("b", 1, 0)]
    assert b.wait_reason is None


def test_swap_space_full_falls_back_to_recompute():
    g = _two_decoding("last_admitted", preemption_mode="swap", num_swap_blocks=1)
    _, b = g.s.running
    g.step()
    (_, pre), *_ = g.kinds(EventKind.PREEMPT)
    assert pre["mode"] == "recompute" and pre["reason"].endswith("; swap space full, fell back to recompute")
    assert b.status == Status.PREEMPTED and g.swaps == []


def test_blocks_for_whole_request_paged_and_contiguous():
    assert Rig().s.blocks_for_whole_request(9) == 3
    g = Rig(num_blocks=32, allocator="contiguous", max_model_len=64)
    assert g.s.blocks_for_whole_request(9) == 16  # a whole max_model_len slab


def test_contiguous_waits_for_a_run_of_free_blocks():
    g = Rig(num_blocks=24, allocator="contiguous", max_model_len=48)  # 12-block slabs
    g.add("a", 3)
    b = g.add("b", 3, first_token=100)
    c = g.add("c", 3, first_token=200)
    assert rows(g.step()) == [("a", 3, 0), ("b", 3, 0)]
    assert c.wait_reason == WaitReason.NO_CONTIGUOUS_RUN
    assert c.wait_reason_text == "no contiguous run of 12 free blocks (0 free in total)"
    assert g.bm.table("b") == list(range(12, 24)) and b.status == Status.RUNNING


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 4),
)
def test_every_step_keeps_the_budget_and_admits_in_order(prompts, budget, max_seqs):
    """Ample blocks: no preemption, so admission is FCFS, every step stays within the token
    budget and max_num_seqs, and each prompt is fed exactly once, in chunks, before any output."""
    g = Rig(num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    reqs = [g.add(f"r{i}", n, first_token=100 * i) for i, n in enumerate(prompts)]
    fed = {r.request_id: 0 for r in reqs}
    for _ in range(500):
        out = g.step()
        assert out.preempted == []
        assert out.num_batched_tokens == sum(it.num_new_tokens for it in out.items) <= budget
        assert len(g.s.running) <= max_seqs
        for it in out.items:
            start = it.req.num_computed_tokens - it.num_new_tokens  # where this row began
            if start < it.req.num_prompt_tokens:  # a prompt chunk: right after the previous one
                assert start == fed[it.req.request_id]
                fed[it.req.request_id] += it.num_new_tokens
        for r in list(g.s.running):
            if r.num_output_tokens >= 2:  # finished: out of the queues, its blocks freed
                g.s.remove(r)
                r.status = Status.FINISHED
        if not g.s.has_unfinished():
            break
    assert not g.s.has_unfinished()
    assert fed == {r.request_id: r.num_prompt_tokens for r in reqs}
    admitted = sorted(reqs, key=lambda r: r.admit_order)
    assert admitted == reqs and [r.admit_order for r in reqs] == list(range(len(reqs)))


def test_remove_takes_a_request_out_of_any_queue_and_returns_its_blocks():
    g = Rig()
    a = g.add("a", 5)
    b = g.add("b", 2, first_token=100)
    g.step()
    held = g.bm.table("a")
    assert g.s.remove(a) == held and len(held) == 2
    assert not g.bm.has_table("a") and g.s.running == [b]
    c = g.add("c", 3, first_token=200)
    assert g.s.remove(c) == [] and not g.s.waiting
    assert g.s.has_unfinished()
