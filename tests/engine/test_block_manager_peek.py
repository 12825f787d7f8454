"""BlockManager.peek_prefix_hit: the as-you-type preview's lookup. It must agree with what
admission would take (get_computed_blocks) and change nothing at all."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager

BS = 4


def full_state(bm: BlockManager) -> tuple:
    """Everything the pool keeps, including what fingerprint() leaves out (hash keys, per-block
    hashes, memoised request hashes, counters, pending events)."""
    return (
        bm.fingerprint(),
        tuple(bm.free_queue),
        copy.deepcopy(bm.hash_to_block),
        tuple((b.block_id, b.ref_cnt, b.block_hash) for b in bm.blocks),
        copy.deepcopy(bm.req_hashes),
        bm.prefix_queries,
        bm.prefix_hits,
        bm.evicted_hashes,
        tuple(copy.deepcopy(bm).drain_events()),  # its queued decision events (read on a copy)
    )


def _fill(bm: BlockManager, rid: str, toks: list[int], keep: bool) -> None:
    hit, _ = bm.get_computed_blocks(rid, toks, None)
    bm.allocate(rid, len(toks), hit)
    bm.commit(rid, len(toks))
    bm.cache_full_blocks(rid, toks, None)
    if not keep:
        bm.free(rid)


@settings(max_examples=150, deadline=None)
@given(
    cached=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=20), st.booleans()), max_size=4),
    probe=st.lists(st.integers(0, 2), min_size=1, max_size=24),
    salt=st.sampled_from([None, "tenant-a"]),
)
def test_peek_matches_admission_and_changes_nothing(cached, probe, salt):
    bm = BlockManager(16, BS)
    for i, (toks, keep) in enumerate(cached):
        if bm.num_free_blocks * BS >= len(toks) + BS:
            _fill(bm, f"c{i}", toks, keep)
    before = full_state(bm)
    peek = bm.peek_prefix_hit(probe, salt)
    assert full_state(bm) == before
    n = len(peek)
    # what admission would take: same count (get_computed_blocks memoises hashes, so on a copy)
    other = copy.deepcopy(bm)
    hit, hit_tokens = other.get_computed_blocks("probe", probe, salt)
    assert peek == hit and hit_tokens == n * BS
    assert n <= (len(probe) - 1) // BS


def test_peek_sees_where_an_edited_prefix_stops_matching():
    bm = BlockManager(16, BS)
    shared = list(range(10, 22))  # 3 full blocks
    _fill(bm, "a", shared + [1, 2], keep=False)
    assert len(bm.peek_prefix_hit(shared + [7, 8], None)) == 3
    edited = shared[:5] + [99] + shared[6:]  # edit inside block 1
    assert len(bm.peek_prefix_hit(edited + [7, 8], None)) == 1
    assert bm.peek_prefix_hit(shared + [7, 8], "other-tenant") == []  # a salt never matches unsalted
    off = BlockManager(16, BS, enable_prefix_caching=False)
    assert off.peek_prefix_hit(shared + [7], None) == []
