"""Each event kind carries its documented keys (engine.trace_events.EVENT_PAYLOADS) and nothing else;
`blocks` is always a list of block ids. A tiny engine runs through admissions, prefix hits,
chunked prefill, preemption (recompute and swap), eviction, copy-on-write bookkeeping, aborts,
a budget change and speculation."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from engine.observe.trace_events import EVENT_PAYLOADS, EventKind, check_payload

SHARED = "a shared system prompt that every request starts with, long enough for full blocks: "


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def drive(eng: LLMEngine, prompts, params) -> None:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    steps = 0
    while eng.has_unfinished_requests() and steps < 400:
        eng.step()
        eng.check_invariants()
        steps += 1
        if steps == 3 and "r1" in eng.requests and eng.requests["r1"].status == "running":
            eng.evict("r1")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_event_has_its_kinds_keys(mode):
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            num_kv_blocks=14,
            block_size=4,
            max_model_len=96,
            max_num_batched_tokens=24,
            preemption_mode=mode,
            swap_space_bytes=2**20 if mode == "swap" else 0,
        )
    )
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    drive(eng, [SHARED + f"question {i}" for i in range(4)], params)
    eng.set_num_blocks(10)
    with pytest.raises(ValueError):
        eng.add_request("bad", "", params)
    seen = set()
    for e in eng.events:
        check_payload(e.kind, e.data)
        if "blocks" in e.data:
            assert isinstance(e.data["blocks"], list) and all(isinstance(b, int) for b in e.data["blocks"])
        if "num_blocks" in e.data:
            assert isinstance(e.data["num_blocks"], int)
        seen.add(e.kind)
    assert {
        EventKind.ADMIT,
        EventKind.WAIT,
        EventKind.BLOCK_ALLOC,
        EventKind.PREFILL,
        EventKind.DECODE,
        EventKind.PREFIX_HIT,
        EventKind.PREEMPT,
        EventKind.EVICT,
        EventKind.FINISH,
        EventKind.REJECT,
        EventKind.CONFIG,
        EventKind.BLOCK_FREE,
    } <= seen
    if mode == "swap":
        assert {EventKind.SWAP_OUT, EventKind.SWAP_IN} <= seen


def test_speculative_events_have_their_keys():
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            num_kv_blocks=64,
            block_size=4,
            max_model_len=128,
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        )
    )
    drive(eng, ["one two three one two three one two three one two"], SamplingParams(max_tokens=16, ignore_eos=True))
    verifies = [e for e in eng.events if e.kind == EventKind.SPEC_VERIFY]
    for e in eng.events:
        check_payload(e.kind, e.data)
    assert verifies


def test_every_kind_is_documented():
    assert set(EVENT_PAYLOADS) == set(EventKind)
    with pytest.raises(ValueError, match="unexpected"):
        check_payload(EventKind.DECODE, {"token": 1, "position": 2, "blocks": 3})
