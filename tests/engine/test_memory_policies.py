"""Memory policies change speed and memory, never output: preemption (recompute, swap, both
victim policies), manual eviction, prefix-cache hits, the contiguous baseline and no-cache mode
all give transformers' greedy tokens. Each memory decision is an event with a reason."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.observe.recording import drive
from tests.engine.exact_ref import MAX_TOKENS, reference
from tests.engine.test_exactness import assert_same, run

pytestmark = pytest.mark.slow
SHORT = [0, 1, 2, 3, 6, 7, 8, 9]


def kinds(eng, kind):
    return [e for e in eng.events if e.kind == kind]


@pytest.mark.parametrize(
    "mode,policy", [("recompute", "last_admitted"), ("recompute", "lru"), ("swap", "last_admitted")]
)
def test_preemption_keeps_output(mode, policy):
    ids, refs = reference()
    got, eng, *_ = run(
        [ids[i] for i in SHORT], num_kv_blocks=9, preemption_mode=mode, victim_policy=policy, swap_space_bytes=64 << 20
    )
    pre = kinds(eng, "preempt")
    assert pre, "a 9-block pool must force preemptions"
    assert all(e.data["mode"] == mode and e.data["reason"] and "blocks_freed" in e.data for e in pre)
    if mode == "swap":
        assert kinds(eng, "swap_out") and kinds(eng, "swap_in")
        assert eng.bm.num_swap_used == 0
    assert_same(got, refs, SHORT)


def test_swap_space_full_falls_back_to_recompute():
    ids, refs = reference()
    # one block of swap space: most victims cannot be swapped out
    got, eng, *_ = run([ids[i] for i in SHORT], num_kv_blocks=9, preemption_mode="swap", swap_space_bytes=1)
    pre = kinds(eng, "preempt")
    assert any("fell back to recompute" in e.data["reason"] for e in pre)
    assert_same(got, refs, SHORT)


def test_manual_eviction_recomputes_same_output():
    ids, refs = reference()
    llm = LLM(model="default", num_kv_blocks=64)
    eng = llm.engine
    eng.add_request("a", ids[2], SamplingParams(max_tokens=MAX_TOKENS))
    eng.add_request("b", ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    outs, evicted = {}, False
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        r = eng.requests.get("a")
        if not evicted and r is not None and r.num_output_tokens == 10:
            info = eng.evict("a")
            assert info["blocks_freed"] > 0 and info["tokens_to_recompute"] == r.num_tokens
            assert eng.bm.table("a") == []
            evicted = True
        eng.check_invariants()
    assert evicted
    ev = kinds(eng, "evict")
    assert len(ev) == 1 and ev[0].request_id == "a" and ev[0].data["reason"]
    # the recompute really ran: a prefill of prompt + 10 generated tokens after the eviction
    again = [e for e in kinds(eng, "prefill") if e.request_id == "a" and e.seq > ev[0].seq]
    assert sum(e.data["tokens"] for e in again) == len(ids[2]) + 10
    assert outs["a"].outputs[0].token_ids == refs[2]
    assert outs["b"].outputs[0].token_ids == refs[0]
    with pytest.raises(ValueError, match="not running"):
        eng.evict("a")


def test_prefix_cache_hits_share_blocks_and_keep_output():
    from engine.model.models import load_model

    model, tok = load_model("default")
    system = (
        "You are a careful code reviewer. Point out resource leaks, missing error handling, "
        "race conditions and unclear names. Answer in one short paragraph. "
    ) * 4
    questions = [
        "Is a bare except clause bad?",
        "What does a context manager guarantee?",
        "Why pin dependency versions?",
    ]
    prompts = []
    for q in questions:
        x = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(list(x["input_ids"] if hasattr(x, "keys") else x))
    refs = []
    for x in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([x]),
                max_new_tokens=16,
                do_sample=False,
                attention_mask=torch.ones(1, len(x), dtype=torch.long),
            )
        refs.append(out[0, len(x) :].tolist())
    llm = LLM(model="default", num_kv_blocks=128)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=16))[0]
    eng = llm.engine
    # the first request's full blocks stay cached-free after it finished
    assert eng.snapshot().metrics.num_blocks_cached > 0
    outs = llm.generate(prompts[1:], SamplingParams(max_tokens=16))
    hits = kinds(eng, "prefix_hit")
    assert len(hits) == 2
    shared_prefix = len(tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False))
    assert shared_prefix > 0
    m = eng.snapshot().metrics
    assert m.prefix_cache_hits > 0 and 0 < m.prefix_cache_hit_rate < 1
    for o in outs:
        assert o.metrics.num_cached_tokens >= 16 * 4
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in outs] == refs
    # a different cache_salt isolates tenants: no hit
    salted = llm.generate(prompts[1:2], SamplingParams(max_tokens=16, cache_salt="tenant-b"))[0]
    assert salted.metrics.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == refs[1]


def test_shared_blocks_while_running_have_ref_counts():
    ids, _ = reference()
    llm = LLM(model="default", num_kv_blocks=128)
    eng = llm.engine
    long = ids[5]  # ~330 tokens: 20 full blocks
    eng.add_request("x", long, SamplingParams(max_tokens=4))
    drive(eng)
    eng.add_request("y", long, SamplingParams(max_tokens=8))
    eng.add_request("z", long, SamplingParams(max_tokens=8))
    eng.step()
    snap = eng.snapshot()
    shared = [b for b in snap.blocks if b.ref_count == 2]
    assert len(shared) >= (len(long) - 1) // 16
    assert all(set(b.owners) == {"y", "z"} for b in shared)
    eng.check_invariants()


def test_contiguous_baseline_same_output_more_waste():
    ids, refs = reference()
    got_c, eng_c, *_ = run([ids[i] for i in SHORT[:4]], allocator="contiguous", max_model_len=512, num_kv_blocks=160)
    assert_same(got_c, refs, SHORT[:4])
    got_p, eng_p, *_ = run([ids[i] for i in SHORT[:4]], num_kv_blocks=160, max_model_len=512)
    assert_same(got_p, refs, SHORT[:4])


def test_waste_measured_from_snapshot():
    ids, _ = reference()
    res = {}
    for alloc in ("paged", "contiguous"):
        llm = LLM(model="default", allocator=alloc, max_model_len=512, num_kv_blocks=160)
        eng = llm.engine
        for i in SHORT[:4]:
            eng.add_request(f"q{i}", ids[i], SamplingParams(max_tokens=8))
        eng.step()
        eng.step()
        m = eng.snapshot().metrics
        res[alloc] = m
        assert m.slots_allocated > 0 and 0 <= m.slots_filled <= m.slots_allocated
    assert res["paged"].waste_fraction < 0.35
    assert res["contiguous"].waste_fraction > 0.8
    assert res["contiguous"].slots_allocated == 4 * 512


def test_no_cache_mode_same_output_and_recomputes():
    ids, refs = reference()
    got, eng, *_ = run([ids[i] for i in (0, 3)], kv_cache=False, num_kv_blocks=64)
    assert_same(got, refs, [0, 3])
    # every decode step re-prefilled the whole prefix
    pre = [e for e in kinds(eng, "prefill") if e.request_id == "q0"]
    assert len(pre) == MAX_TOKENS or len(pre) == len(refs[0])
    assert pre[-1].data["tokens"] == len(ids[0]) + len(refs[0]) - 1


def test_tier_cap_rejects_with_event():
    ids, _ = reference()
    from engine import TierConfig

    llm = LLM(model="default", num_kv_blocks=64, tiers={"free": TierConfig("free", 64, 1)})
    with pytest.raises(ValueError, match="context cap of tier 'free': 64 tokens"):
        llm.engine.add_request("t", ids[2], SamplingParams(max_tokens=40, tier="free"))
    rej = kinds(llm.engine, "reject")
    assert rej and rej[-1].request_id == "t" and "context cap" in rej[-1].data["reason"]
    assert llm.engine.bm.num_used_blocks == 0
