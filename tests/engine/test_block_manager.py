"""Block manager and scheduler properties (hypothesis): random add/step/abort/evict sequences
keep every invariant, and when idle every block is free or cached-free."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, NoFreeBlocks


def test_allocate_commit_free_basics():
    bm = BlockManager(8, 4)
    new = bm.allocate("a", 6)
    assert len(new) == 2 and bm.num_free_blocks == 6
    bm.commit("a", 6)
    bm.check_invariants()
    bm.allocate("a", 9)  # grows on demand
    bm.commit("a", 9)
    assert len(bm.table("a")) == 3
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_no_free_blocks_changes_nothing():
    bm = BlockManager(2, 4)
    bm.allocate("a", 8)
    bm.commit("a", 8)
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", 1)
    assert not bm.has_table("b") or bm.table("b") == []
    bm.check_invariants()


def test_prefix_hit_shares_full_blocks_and_lru_eviction():
    bm = BlockManager(6, 4)
    toks = list(range(10))
    bm.allocate("a", 10)
    bm.commit("a", 10)
    bm.cache_full_blocks("a", toks, None)
    assert bm.num_cached_hashes == 2
    hit, n = bm.get_computed_blocks("b", toks + [99], None)
    assert n == 8 and hit == bm.table("a")[:2]
    bm.allocate("b", 11, hit)
    assert [bm.ref_count(x) for x in hit] == [2, 2]
    bm.commit("b", 11)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    # cached-free: still indexed; salt isolates
    assert bm.get_computed_blocks("c", toks + [5], None)[1] == 8
    assert bm.get_computed_blocks("d", toks + [5], "other")[1] == 0
    # allocating everything evicts the cached blocks (their hashes dropped)
    bm.free("c")  # the lookups memoised their hashes; dropping them leaves the pool as it was
    bm.free("d")
    bm.allocate("e", 24)
    assert bm.num_cached_hashes == 0
    assert any(e[0] == "prefix_evict" for e in bm.drain_events())


def test_hit_capped_to_leave_last_token():
    bm = BlockManager(4, 4)
    toks = list(range(8))
    bm.allocate("a", 8)
    bm.commit("a", 8)
    bm.cache_full_blocks("a", toks, None)
    _, n = bm.get_computed_blocks("b", toks, None)
    assert n == 4  # the second block would hold the last token: recomputed, not shared


def test_copy_on_write_never_writes_shared_block():
    bm = BlockManager(6, 4)
    bm.allocate("a", 8)
    bm.commit("a", 8)
    bm.cache_full_blocks("a", list(range(8)), None)
    hit, _ = bm.get_computed_blocks("b", list(range(9)), None)
    bm.allocate("b", 9, hit)
    shared = bm.table("b")[0]
    copies = bm.ensure_writable("b", 2, 3)  # a write into the shared first block
    assert copies and copies[0][0] == shared and bm.table("b")[0] != shared
    assert bm.ref_count(shared) == 1
    bm.commit("b", 9)
    bm.check_invariants()


def test_contiguous_needs_a_run():
    bm = BlockManager(8, 4, allocator="contiguous", slab_tokens=12)  # 3-block slabs
    bm.allocate("a", 1)
    bm.allocate("b", 1)
    assert bm.table("a") == [0, 1, 2] and bm.table("b") == [3, 4, 5]
    assert not bm.can_allocate("c", 1)  # 2 free blocks, no run of 3
    bm.free("a")
    assert bm.can_allocate("c", 1)


def test_swap_roundtrip_and_budget_shrink():
    bm = BlockManager(8, 4, num_swap_blocks=4)
    bm.allocate("a", 10)
    bm.commit("a", 10)
    pairs = bm.swap_out("a")
    assert len(pairs) == 3 and bm.num_swap_used == 3 and bm.num_free_blocks == 8
    bm.check_invariants()
    back = bm.swap_in("a")
    assert len(back) == 3 and bm.num_swap_used == 0 and bm.num_tokens("a") == 10
    bm.check_invariants()
    bm.set_num_blocks(4)
    assert bm.num_blocks == 4 and bm.num_free_blocks == 1
    bm.check_invariants()
    bm.set_num_blocks(8)
    assert bm.num_blocks == 8
    bm.check_invariants()


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "free", "hit", "commit_back"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([1, 2, 4, 16]), st.integers(1, 24))
def test_block_manager_random_ops_keep_invariants(seq, block_size, num_blocks):
    bm = BlockManager(num_blocks, block_size)
    toks = {}
    for op, r, n in seq:
        rid = f"r{r}"
        try:
            if op == "alloc" and not bm.has_table(rid):
                t = [r % 3] * n
                hit, hn = bm.get_computed_blocks(rid, t, None)
                bm.allocate(rid, n, hit)
                bm.commit(rid, n)
                bm.cache_full_blocks(rid, t, None)
                toks[rid] = t
            elif op == "grow" and bm.has_table(rid):
                t = toks[rid] + [7] * n
                bm.allocate(rid, len(t))
                bm.commit(rid, len(t))
                toks[rid] = t
                bm.cache_full_blocks(rid, t, None)
            elif op == "commit_back" and bm.has_table(rid):
                keep = max(0, bm.num_tokens(rid) - n)
                bm.commit(rid, keep)
                toks[rid] = toks[rid][:keep]
            elif op == "free":
                bm.free(rid)
                toks.pop(rid, None)
        except NoFreeBlocks:
            pass
        bm.check_invariants()
    for rid in bm.request_ids():
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


# ---------------------------------------------------------------- scheduler + engine (tiny model)


@pytest.fixture(scope="module")
def tiny_engine_factory():
    from tests.engine.engines import tiny_engine

    return tiny_engine


engine_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort", "evict"]), st.integers(0, 7), st.integers(1, 60)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    engine_ops,
    st.sampled_from([4, 16]),
    st.integers(6, 20),
    st.sampled_from(["recompute", "swap"]),
    st.sampled_from(["last_admitted", "lru"]),
    st.booleans(),
    st.sampled_from(["auto", "int8"]),
)
def test_engine_random_workloads_keep_invariants(
    tiny_engine_factory, seq, block_size, num_blocks, mode, policy, prefix, kv_cache_dtype
):
    from engine import SamplingParams

    eng = tiny_engine_factory(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        preemption_mode=mode,
        kv_cache_dtype=kv_cache_dtype,
        victim_policy=policy,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        swap_space_bytes=4 * block_size * eng_bytes_per_token(),
        max_model_len=512,
    )
    added = []
    for op, r, n in seq:
        rid = f"r{r}"
        if op == "add":
            try:
                eng.add_request(
                    None,
                    [(r * 7 + j) % 100 + 3 for j in range(n)],
                    SamplingParams(max_tokens=1 + n % 9, ignore_eos=True),
                )
                added.append(rid)
            except ValueError:
                pass
        elif op == "step":
            eng.step()
        elif op == "abort" and eng.requests:
            eng.abort_request(sorted(eng.requests)[r % len(eng.requests)])
        elif op == "evict":
            running = [q.request_id for q in eng.scheduler.running]
            if running:
                eng.evict(running[r % len(running)])
        eng.check_invariants()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        steps += 1
        assert steps < 5000, "engine made no progress"
    assert all(b.state in ("free", "cached") for b in eng.snapshot().blocks)
    assert eng.bm.num_swap_used == 0


def eng_bytes_per_token():
    # tiny model: 2 layers x 2 kv heads x 16 head_dim x 2 (K,V) x 4 bytes
    return 2 * 2 * 2 * 16 * 4
