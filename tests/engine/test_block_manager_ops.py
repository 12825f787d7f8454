"""Every operation that changes the block pool, in random order, followed by check_invariants();
and the read methods other modules use (block_infos, slot_usage, cached-free count, num_tokens)
agree with each other and with the pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager, NoFreeBlocks
from engine.observe.snapshot import BlockState
from engine.observe.trace_events import EventKind

BS = 4
OPS = (
    "alloc",
    "alloc_hit",
    "grow",
    "commit_back",
    "cache",
    "free",
    "free_to_head",
    "drop_hashes",
    "cow",
    "swap_out",
    "swap_in",
    "drop_swapped",
    "resize",
)


def check_reads(bm: BlockManager) -> None:
    infos = bm.block_infos()
    by_state = {s: [b for b in infos if b.state == s] for s in BlockState}
    assert len(infos) == bm.num_blocks
    assert len(by_state[BlockState.USED]) == bm.num_used_blocks
    assert len(by_state[BlockState.CACHED]) == bm.num_cached_free_blocks
    assert len(by_state[BlockState.FREE]) + bm.num_cached_free_blocks == bm.num_free_blocks
    assert sorted(bm.free_block_ids()) == sorted(b.block_id for b in infos if b.ref_count == 0)
    allocated, filled = bm.slot_usage()
    assert allocated == sum(len(bm.table(r)) for r in bm.request_ids()) * BS
    assert filled == sum(bm.num_tokens(r) for r in bm.request_ids()) <= allocated
    for b in infos:
        assert b.ref_count == bm.ref_count(b.block_id) == len(b.owners)
        assert 0 <= b.fill <= BS


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3), st.integers(1, 12)), max_size=60))
def test_every_pool_change_keeps_the_invariants(ops):
    bm = BlockManager(12, BS, num_swap_blocks=6)
    tokens = {f"r{i}": [i % 2] * 40 for i in range(4)}  # r0/r2 and r1/r3 share content: prefix hits
    for op, i, n in ops:
        rid = f"r{i}"
        toks = tokens[rid]
        try:
            if op == "alloc" and not bm.has_table(rid) and not bm.is_swapped(rid):
                bm.allocate(rid, n)
                bm.commit(rid, n)
            elif op == "alloc_hit" and not bm.has_table(rid) and not bm.is_swapped(rid):
                hit, hit_tokens = bm.get_computed_blocks(rid, toks[: n + 1], None)
                bm.allocate(rid, n + 1, hit)
                bm.commit(rid, n + 1)
            elif op == "grow" and bm.has_table(rid):
                total = min(len(toks), bm.num_tokens(rid) + n)
                bm.allocate(rid, total)
                bm.commit(rid, total)
            elif op == "commit_back" and bm.has_table(rid):
                bm.commit(rid, max(1, bm.num_tokens(rid) - n))
            elif op == "cache" and bm.has_table(rid):
                bm.cache_full_blocks(rid, toks, None)
            elif op == "free":
                bm.free(rid)
            elif op == "free_to_head" and bm.has_table(rid):
                freed = bm.free(rid, to_head=True)
                head = bm.free_block_ids()[: len(freed)]
                assert [b for b in freed if b in head] == [b for b in head if b in freed]
            elif op == "drop_hashes":
                bm.drop_hashes(rid)
            elif op == "cow" and bm.has_table(rid):
                for src, dst in bm.ensure_writable(rid, 0, bm.num_tokens(rid)):
                    assert src != dst
            elif op == "swap_out" and bm.has_table(rid) and bm.can_swap_out(rid):
                bm.swap_out(rid)
            elif op == "swap_in" and bm.is_swapped(rid) and bm.can_swap_in(rid):
                bm.swap_in(rid)
            elif op == "drop_swapped":
                bm.drop_swapped(rid)
            elif op == "resize":
                bm.set_num_blocks(min(12, max(1, n)))
        except NoFreeBlocks:
            pass
        bm.check_invariants()
        check_reads(bm)
        for kind, _, data in bm.drain_events():
            assert kind in (EventKind.PREFIX_EVICT, EventKind.COW) and data["reason"]
    for rid in bm.request_ids():
        bm.free(rid)
    for i in range(4):
        bm.drop_swapped(f"r{i}")
    bm.check_invariants()


def test_drop_hashes_leaves_nothing_to_hit():
    bm = BlockManager(8, BS)
    toks = list(range(13))
    bm.allocate("a", 13)
    bm.commit("a", 13)
    bm.cache_full_blocks("a", toks, None)
    assert bm.num_cached_hashes == 3
    bm.drop_hashes("a")
    bm.check_invariants()
    bm.free("a")
    assert bm.num_cached_hashes == 0 and bm.num_cached_free_blocks == 0
    assert bm.get_computed_blocks("b", toks, None) == ([], 0)


def test_free_to_head_puts_blocks_first_in_table_order():
    bm = BlockManager(8, BS)
    bm.allocate("x", 8)
    bm.commit("x", 8)
    bm.allocate("lent", 12)
    lent = list(bm.table("lent"))
    bm.free("lent", to_head=True)
    assert bm.free_block_ids()[:3] == lent
    assert bm.allocate("y", 12) == lent
    bm.commit("y", 12)
    bm.check_invariants()


def test_check_invariants_catches_a_leaked_block():
    bm = BlockManager(4, BS)
    bm.allocate("a", 4)
    bm.block_tables["a"].append(3)  # a table holding a block whose ref count says free
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_table_is_a_copy_so_only_the_block_manager_writes_block_tables():
    bm = BlockManager(6, BS)
    bm.allocate("a", 8)
    bm.commit("a", 8)
    t = bm.table("a")
    t.append(5)
    t[0] = 4
    assert bm.table("a") == [0, 1] and bm.table("nobody") == []
    bm.check_invariants()


def test_has_free_run_sees_consecutive_free_ids_only():
    bm = BlockManager(6, BS)
    bm.allocate("a", 4)  # block 0
    bm.allocate("b", 4)  # block 1
    bm.allocate("c", 4)  # block 2
    bm.free("b")  # free: 1, 3, 4, 5
    assert bm.has_free_run(3) and not bm.has_free_run(4)
    bm.allocate("d", 4)  # takes block 1 or one of 3..5 (LRU order)
    assert bm.has_free_run(2)


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10), min_size=1, max_size=8),
    frees=st.lists(st.integers(0, 7), max_size=8),
    last=st.integers(1, 24),
)
def test_one_allocation_takes_the_free_queues_next_blocks_in_id_order(sizes, frees, last):
    """Which blocks an allocation takes is the free queue's (LRU) choice; the table gets them in id
    order, so that a long sequence's blocks ascend in memory (the CPU kernels read them as forward
    streams). Swap-in lays its blocks out the same way."""
    bm = BlockManager(24, BS, num_swap_blocks=24)
    for i, n in enumerate(sizes):
        if bm.can_allocate(f"r{i}", n * BS):
            bm.allocate(f"r{i}", n * BS)
            bm.commit(f"r{i}", n * BS)
    for i in frees:
        bm.free(f"r{i}")  # tail blocks first into the queue: the queue is out of id order
    need = min(last, bm.num_free_blocks)
    expect = bm.free_block_ids()[:need]
    got = bm.allocate("new", need * BS)
    assert got == sorted(expect) == bm.table("new")
    bm.commit("new", need * BS)
    bm.check_invariants()
    if bm.can_swap_out("new"):
        bm.swap_out("new")
        expect = bm.free_block_ids()[:need]
        bm.swap_in("new")
        assert bm.table("new") == sorted(expect)
        bm.check_invariants()
