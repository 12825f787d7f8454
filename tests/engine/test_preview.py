"""The as-you-type preview (engine/core/preview.py via EngineThread.preview): typing a prompt, one
keystroke at a time, leaves the engine exactly as it was; the numbers it shows are the ones the
engine then uses when the prompt is submitted."""

from __future__ import annotations

import copy

import pytest

from engine import EngineConfig, EngineThread, LLMEngine
from engine.config import SamplingParams, TierConfig
from engine.core.preview import template_ids

SYSTEM = "You are the release-freeze assistant of a small team. Answer briefly and precisely."


def engine_state(eng: LLMEngine) -> tuple:
    bm = eng.bm
    snap = eng.snapshot()
    return (
        bm.fingerprint(),
        tuple(bm.free_queue),
        copy.deepcopy(bm.hash_to_block),
        tuple((b.ref_cnt, b.block_hash) for b in bm.blocks),
        copy.deepcopy(bm.req_hashes),
        bm.prefix_queries,
        bm.prefix_hits,
        bm.evicted_hashes,
        tuple(copy.deepcopy(bm).drain_events()),  # its queued decision events (read on a copy)
        tuple(r.request_id for r in eng.scheduler.waiting),
        tuple(r.request_id for r in eng.scheduler.running),
        eng.metrics.num_rejected,
        len(eng.events),
        snap.blocks,
        snap.requests,
        snap.step,
    )


@pytest.fixture(scope="module")
def th():
    t = EngineThread(
        LLMEngine(
            EngineConfig(
                model="tiny",
                block_size=4,
                num_kv_blocks=48,
                max_model_len=256,
                tiers={"free": TierConfig("free", max_context=64)},
            )
        )
    )
    yield t
    t.shutdown()


def test_typing_changes_nothing_and_the_hit_is_what_admission_takes(th):
    first = th.submit(
        template_ids(th.tokenizer, "What is frozen on Friday?", SYSTEM)[0],
        SamplingParams(max_tokens=4, temperature=0.0),
    )
    first.result(timeout=120)
    user = "Which services may still deploy during the freeze?"
    with th.lock:  # the loop cannot step between the two state reads
        before = engine_state(th.engine)
        previews = [th.preview(user[:i], SamplingParams(max_tokens=16), system=SYSTEM) for i in range(len(user) + 1)]
        assert engine_state(th.engine) == before
    last = previews[-1]
    ids, content = template_ids(th.tokenizer, user, SYSTEM)
    assert list(last.token_ids) == ids and last.content_tokens == content
    assert last.template_tokens == len(ids) - content > 0
    assert last.hit_blocks >= 1  # the system prompt's full blocks
    assert last.kv_bytes_prompt == len(ids) * th.engine.bytes_per_token
    assert last.worst_tokens == len(ids) + 16 and last.verdict == "fits"
    assert previews[0].verdict == "rejected" and previews[0].num_tokens == 0
    # submitting it: admission takes exactly the previewed hit
    h = th.submit(ids, SamplingParams(max_tokens=2, temperature=0.0))
    out = h.result(timeout=120)
    assert out.metrics.num_cached_tokens == last.hit_tokens


def test_a_system_prompt_edit_stops_the_match_at_its_block(th):
    ids, _ = template_ids(th.tokenizer, "hello", SYSTEM)
    th.submit(ids, SamplingParams(max_tokens=2)).result(timeout=120)
    full = th.preview("hello", system=SYSTEM).hit_blocks
    edited = SYSTEM.replace("precisely", "politely")
    eids, _ = template_ids(th.tokenizer, "hello", edited)
    first_diff = next(i for i, (a, b) in enumerate(zip(ids, eids)) if a != b)
    p = th.preview("hello", system=edited)
    assert p.hit_blocks == first_diff // 4 < full


def test_verdicts_name_the_limit(th):
    long = "word " * 300
    p = th.preview(long, SamplingParams(max_tokens=8))
    assert p.verdict == "rejected" and "max_model_len" in p.reason
    p = th.preview("short question", SamplingParams(max_tokens=100, tier="free"))
    assert p.verdict == "rejected" and "context cap of tier" in p.reason and ": 64 tokens" in p.reason
    p = th.preview("short question", SamplingParams(max_tokens=200))
    assert p.verdict == "rejected" and "KV blocks" in p.reason  # 48 blocks x 4 < prompt + 200
    p = th.preview("short question", SamplingParams(max_tokens=100))
    assert p.verdict == "fits" and p.blocks_worst <= 48
    with pytest.raises(ValueError, match="prompt must be a string"):
        th.preview(None)
