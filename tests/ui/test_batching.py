"""Continuous batching chart (issue 15 item 4): the step x request grid is exactly what the engine
put in each forward pass — per request, prefill rows add up to its prompt (plus recomputes), one
decode row per generated token after the first, leaves where the engine says so."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.observe.trace_events import FINISH, PREEMPT, SCHEDULE, Event
from ui.figures import batching as B


@pytest.fixture(scope="module")
def run():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # a small token budget forces chunked prefill; a small pool forces preemption
        eng = LLMEngine(
            EngineConfig(
                model="tiny",
                device="cpu",
                num_kv_blocks=12,
                block_size=4,
                max_model_len=128,
                max_num_batched_tokens=16,
                seed=0,
            )
        )
        for i in range(5):
            eng.add_request(
                f"r{i}", list(range(10 + i, 10 + i + 6 + 5 * i)), SamplingParams(max_tokens=8 + i, ignore_eos=True)
            )
        while eng.has_unfinished_requests():
            eng.step()
        return eng, list(eng.events)
    finally:
        torch.set_num_threads(n)


def test_one_schedule_event_per_forward_pass(run):
    eng, events = run
    sched = [e for e in events if e.kind == SCHEDULE]
    assert len({e.step for e in sched}) == len(sched)
    assert all(e.data["forward_s"] >= 0 for e in sched)
    for e in sched:
        assert sum(r[2] for r in e.data["rows"]) <= eng.config.max_num_batched_tokens


def test_grid_accounts_for_every_token(run):
    eng, events = run
    g = B.batch_grid(events, max_steps=10_000)
    preempted = {e.request_id for e in events if e.kind == PREEMPT}
    assert set(g.request_ids) == {f"r{i}" for i in range(5)}
    for i in range(5):
        rid = f"r{i}"
        prompt_len, out_len = 6 + 5 * i, 8 + i
        mine = [c for c in g.cells if c.request_id == rid]
        decode = [c for c in mine if c.kind == "decode"]
        prefill = [c for c in mine if c.kind == "prefill"]
        assert all(c.num_tokens == 1 for c in decode)
        fed = sum(c.num_tokens for c in mine)
        if rid in preempted:  # recompute re-feeds prompt and output so far
            assert fed > prompt_len + out_len - 1
        else:
            assert fed == prompt_len + out_len - 1
            assert len(decode) == out_len - 1
            assert sum(c.num_tokens for c in prefill) == prompt_len
        # every position is fed in order: each row starts where the previous one ended, or at 0 again
        pos = 0
        for c in sorted(mine, key=lambda c: c.step):
            assert c.start in (pos, 0) or c.start < pos
            pos = c.start + c.num_tokens
    assert any(len({c.kind for c in g.cells if c.step == s}) > 1 for s in g.steps)  # mixed passes
    assert {r for _, r, w in g.leaves if w == "finished"} == set(g.request_ids)
    assert len([e for e in events if e.kind == FINISH]) == 5


def test_windows_and_figure(run):
    _, events = run
    g = B.batch_grid(events, max_steps=5, max_requests=2)
    assert len(g.steps) == 5 and len(g.request_ids) <= 2
    assert g.dropped_steps == len({e.step for e in events if e.kind == SCHEDULE}) - 5
    fig = B.batching_figure(g)
    names = {t.name for t in fig.data}
    assert names <= {"prefill", "decode", "verify"} | {f"leaves: {w}" for w in B.LEAVE_KINDS.values()}
    assert "forward passes" in B.batch_summary(g)


def test_empty_and_hostile():
    assert B.batch_grid([]).steps == ()
    fig = B.batching_figure(B.batch_grid([]))
    assert fig.layout.annotations
    ev = Event(
        1, 3, 0.0, SCHEDULE, None, {"rows": [["<script>x</script>", "decode", 1, 4], "junk", [1]], "forward_s": 0.01}
    )
    g = B.batch_grid([ev])
    assert g.request_ids == ("<script>x</script>",)
    assert "<script>" not in B.batch_summary(g)
