"""The KV block pool's bookkeeping: free queue (LRU), ref counts, block tables, prefix hashes,
copy-on-write, swap space, and the contiguous worst-case-slab baseline.

Block ids index the first dimension of the K/V pool tensors. This module decides which ids a
request uses; the runner does the tensor work (writes, copies, swaps) on exactly those ids.

Prefix caching (vLLM v1 style): a full block is identified by a hash chained from its parent
block's hash, its token ids, and (first block only) the request's cache_salt, computed exactly as
vLLM computes it (engine/core/prefix_hash.py). Freed blocks keep their hash and sit
in the free queue (LRU order, oldest first); a lookup hit takes them back (ref count +1). A
cached block loses its hash only when it is popped from the free queue for new content.
Only full blocks are ever shared, and a request's hit is capped so that at least its last prompt
token is recomputed: writes go to blocks owned by one request. `ensure_writable` enforces the
rule anyway (copy-on-write) so no shared block is ever written in place.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.core.prefix_hash import DEFAULT_ALGO, PrefixHasher, block_extra_keys, event_extra_keys
from engine.model.kv_layout import cdiv
from engine.observe.snapshot import BlockInfo, BlockState
from engine.observe.trace_events import EventKind


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class NoFreeBlocks(Exception):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        allocator: str = "paged",
        slab_tokens: int = 0,
        num_swap_blocks: int = 0,
        hash_algo: str = DEFAULT_ALGO,
    ):
        self.hasher = PrefixHasher(hash_algo)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and allocator == "paged"
        self.allocator = allocator
        self.slab_blocks = cdiv(slab_tokens, block_size) if allocator == "contiguous" else 0
        self.capacity = num_blocks
        self.target_blocks = num_blocks
        self.retired: set[int] = set()  # blocks taken out of service by a budget cut
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # per cached hash: (parent hash or None, the block's token ids, its event extra keys), what a KV
        # event subscriber that attaches later is sent for blocks cached before it came
        self.hash_content: dict[bytes, tuple[bytes | None, tuple[int, ...], tuple | None]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # tokens whose K/V are written, per request
        self.req_hashes: dict[str, list[bytes]] = {}
        # swap space (CPU): slot ids
        self.num_swap_blocks = num_swap_blocks
        self.free_swap: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.swapped: dict[str, tuple[list[int], int]] = {}  # rid -> (swap slots, num_tokens)
        # metrics
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evicted_hashes = 0
        self._pending_events: list[tuple[str, str | None, dict]] = []
        # vLLM's KV events, queued here while someone wants them (vLLM's BlockPool.kv_event_queue):
        # ("stored", hash, parent_hash, token_ids, extra_keys) when a hash enters the prefix cache
        # index, ("removed", hash, None, None, None) when it leaves; the engine drains them
        self._kv_events: deque | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def table(self, rid: str) -> list[int]:
        """A copy of rid's block table (logical block i -> block id; [] for none): callers read
        it, and change it only through this class's methods."""
        return list(self.block_tables.get(rid, ()))

    def num_tokens(self, rid: str) -> int:
        """Tokens whose K/V are written in rid's blocks (0 for a request holding none)."""
        return self._num_tokens.get(rid, 0)

    def request_ids(self) -> list[str]:
        """Ids holding a block table, in allocation order."""
        return list(self.block_tables)

    def has_table(self, rid: str) -> bool:
        return rid in self.block_tables

    def is_swapped(self, rid: str) -> bool:
        return rid in self.swapped

    @property
    def is_empty(self) -> bool:
        """No request holds anything: no block table, token count, memoised hashes or swap slots."""
        return not (self.block_tables or self._num_tokens or self.req_hashes or self.swapped)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose content is still indexed by the prefix cache (reusable on a hit)."""
        return sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)

    @property
    def num_cached_hashes(self) -> int:
        return len(self.hash_to_block)

    def ref_count(self, bid: int) -> int:
        return self.blocks[bid].ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (first = next to be reused)."""
        return list(self.free_queue)

    def slot_usage(self) -> tuple[int, int]:
        """(slots in blocks held by block tables, of those the slots holding a token)."""
        allocated = sum(len(t) for t in self.block_tables.values()) * self.block_size
        filled = sum(self._num_tokens.get(rid, 0) for rid in self.block_tables)
        return allocated, filled

    def block_infos(self) -> list[BlockInfo]:
        """One BlockInfo per block in service (retired ones left out), by block id: state, ref
        count, the requests whose tables hold it and its filled slots."""
        owners: dict[int, list[str]] = {}
        fill: dict[int, int] = {}
        bs = self.block_size
        for rid, table in self.block_tables.items():
            n = self._num_tokens.get(rid, 0)
            for i, bid in enumerate(table):
                owners.setdefault(bid, []).append(rid)
                fill[bid] = max(fill.get(bid, 0), max(0, min(bs, n - i * bs)))
        out = []
        for bid in range(self.capacity):
            if bid in self.retired:
                continue
            b = self.blocks[bid]
            if b.ref_cnt > 0:
                state = BlockState.USED
            elif b.block_hash is not None:
                state = BlockState.CACHED
            else:
                state = BlockState.FREE
            out.append(
                BlockInfo(
                    bid,
                    state,
                    b.ref_cnt,
                    tuple(owners.get(bid, ())),
                    fill.get(bid, bs if state == BlockState.CACHED else 0),
                    b.block_hash.hex()[:8] if b.block_hash is not None else None,
                )
            )
        return out

    def fingerprint(self) -> tuple:
        """The whole bookkeeping state as a hashable value (tests compare it before and after a
        refused operation)."""
        return (
            tuple(self.free_queue),
            tuple((k, tuple(v)) for k, v in self.block_tables.items()),
            tuple(self._num_tokens.items()),
            tuple(b.ref_cnt for b in self.blocks),
            tuple(sorted(self.hash_to_block.values())),
            tuple(sorted(self.retired)),
            tuple(self.free_swap),
            self.num_blocks,
        )

    def drain_events(self) -> list[tuple[EventKind, str | None, dict]]:
        """Events recorded since the last call: (kind, request id, data)."""
        out, self._pending_events = self._pending_events, []
        return out

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> list[tuple]:
        """Start queueing KV events; returns every block cached now as a "stored" event (with its
        parent, tokens and extra keys, as when it was stored)."""
        self._kv_events = deque()
        return [("stored", h, *self.hash_content[h]) for h in self.hash_to_block]

    def disable_kv_events(self) -> None:
        self._kv_events = None

    def take_kv_events(self) -> list[tuple]:
        """The KV events queued since the last call, oldest first (vLLM's take_events). Pops one
        at a time: a deque's popleft is atomic, so another thread may be appending meanwhile."""
        q, out = self._kv_events, []
        while q:
            out.append(q.popleft())
        return out

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Uncache every cached block no request holds (vLLM's reset_prefix_cache); returns
        (dropped, kept in use)."""
        dropped = kept = 0
        for bid in list(self.hash_to_block.values()):
            if self.blocks[bid].ref_cnt == 0:
                self.uncache(bid)
                dropped += 1
            else:
                kept += 1
        return dropped, kept

    def cached_hashes(self) -> list[bytes]:
        """The hashes in the prefix-cache index now (read-only)."""
        return list(self.hash_to_block)

    def blocks_needed(self, rid: str, total_tokens: int) -> int:
        if self.allocator == "contiguous":
            return 0 if rid in self.block_tables else self.slab_blocks
        return max(0, cdiv(total_tokens, self.block_size) - len(self.block_tables.get(rid, ())))

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, rid: str, token_ids: list[int], salt: str | None) -> list[bytes]:
        """Hashes of the full blocks of token_ids (memoised per request, extended as it grows)."""
        hs = self.req_hashes.setdefault(rid, [])
        n_full = len(token_ids) // self.block_size
        hs.extend(self._hash_chain(token_ids, salt, len(hs), hs[-1] if hs else None, n_full))
        return hs[:n_full]

    def _hash_chain(self, token_ids: list[int], salt: str | None, first: int, parent, stop: int):
        """The hashes of full blocks first..stop-1 of token_ids, each chained on the one before
        (`parent`: block first-1's), yielded lazily: the one place a block's hash is chained."""
        bs = self.block_size
        for i in range(first, stop):
            parent = self.hasher.block(parent, token_ids[i * bs : (i + 1) * bs], block_extra_keys(i, salt))
            yield parent

    def get_computed_blocks(self, rid: str, token_ids: list[int], salt: str | None) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, leaving at least the last token to compute.
        No side effects except memoising the hashes and the query/hit counters' inputs."""
        if not self.enable_prefix_caching:
            return [], 0
        hit = self._cached_prefix(self.block_hashes(rid, token_ids, salt)[: self._max_hit_blocks(token_ids)])
        return hit, len(hit) * self.block_size

    def _max_hit_blocks(self, token_ids: list[int]) -> int:
        """Full blocks a prefix hit may cover: the last token is always computed (its logits)."""
        return (len(token_ids) - 1) // self.block_size

    def _cached_prefix(self, hashes) -> list[int]:
        """The one prefix lookup: the cached block of each leading hash, up to the first miss."""
        hit: list[int] = []
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def peek_prefix_hit(self, token_ids: list[int], salt: str | None) -> list[int]:
        """The cached blocks a request with token_ids admitted now would take for its leading full
        blocks (same cap as get_computed_blocks: the last token is always computed).
        Read-only: no ref count, free-queue (LRU) order, hash index, memo or counter changes."""
        if not self.enable_prefix_caching:
            return []
        # hashed lazily and not memoised: the walk stops at the first miss
        return self._cached_prefix(self._hash_chain(token_ids, salt, 0, None, self._max_hit_blocks(token_ids)))

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, rid: str, token_ids: list[int], salt: str | None) -> None:
        """Register hashes of the request's full, written blocks (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        n = self._num_tokens.get(rid, 0)
        table = self.block_tables.get(rid, [])
        hashes = self.block_hashes(rid, token_ids[:n], salt)
        for i, h in enumerate(hashes[: n // self.block_size]):
            b = self.blocks[table[i]]
            if b.block_hash is not None:
                continue
            if h in self.hash_to_block:
                continue  # same content already cached in another block
            b.block_hash = h
            self.hash_to_block[h] = b.block_id
            content = (
                hashes[i - 1] if i else None,
                tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]),
                event_extra_keys(i, salt),  # as vLLM's events carry them: the salt on the first block
            )
            self.hash_content[h] = content
            if self._kv_events is not None:
                self._kv_events.append(("stored", h, *content))

    def uncache(self, bid: int) -> bytes | None:
        """Drop block bid's prefix-cache hash (its content is about to change or was discarded).
        Returns the hash it had."""
        b = self.blocks[bid]
        h = b.block_hash
        if h is None:
            return None
        if self.hash_to_block.get(h) == bid:
            del self.hash_to_block[h]
            self.hash_content.pop(h, None)
            if self._kv_events is not None:
                self._kv_events.append(("removed", h, None, None, None))
        b.block_hash = None
        return h

    # ------------------------------------------------------------------ allocation
    def _pop_free(self, reason: str = "cached-free block reused for new content (LRU)") -> int:
        bid, _ = self.free_queue.popitem(last=False)
        b = self.blocks[bid]
        if b.block_hash is not None:
            self._pending_events.append(
                (EventKind.PREFIX_EVICT, None, {"block": bid, "hash": b.block_hash.hex()[:8], "reason": reason})
            )
            self.evicted_hashes += 1
            self.uncache(bid)
        b.ref_cnt = 1
        return bid

    def _take_contiguous(self, n: int) -> list[int] | None:
        run_start, run_len = 0, 0
        for i in range(self.capacity):
            if i in self.free_queue:
                if run_len == 0:
                    run_start = i
                run_len += 1
                if run_len == n:
                    ids = list(range(run_start, run_start + n))
                    for bid in ids:
                        del self.free_queue[bid]
                        self.blocks[bid].ref_cnt = 1
                        self.blocks[bid].block_hash = None
                    return ids
            else:
                run_len = 0
        return None

    def can_allocate(self, rid: str, total_tokens: int, computed_blocks: list[int] = ()) -> bool:
        need = self.blocks_needed(rid, total_tokens) - len(computed_blocks)
        # hit blocks sitting in the free queue are taken out of it, so they don't count as free
        reusable_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if self.allocator == "contiguous" and rid not in self.block_tables:
            return self.has_free_run(self.slab_blocks)
        return need <= self.num_free_blocks - reusable_free

    def has_free_run(self, n: int) -> bool:
        """n consecutive free block ids exist (what a contiguous slab needs)."""
        run = 0
        for i in range(self.capacity):
            run = run + 1 if i in self.free_queue else 0
            if run >= n:
                return True
        return False

    def allocate(self, rid: str, total_tokens: int, computed_blocks: list[int] = ()) -> list[int]:
        """Grow rid's block table to cover total_tokens (taking prefix-hit blocks first).
        Returns the newly allocated block ids. Raises NoFreeBlocks with nothing changed."""
        if not self.can_allocate(rid, total_tokens, computed_blocks):
            raise NoFreeBlocks(rid)
        table = self.block_tables.setdefault(rid, [])
        self._num_tokens.setdefault(rid, 0)
        if self.allocator == "contiguous":
            if table:
                return []
            ids = self._take_contiguous(self.slab_blocks)
            assert ids is not None
            table.extend(ids)
            return ids
        if computed_blocks:
            assert not table, "prefix hits are only taken at (re)admission"
            for bid in computed_blocks:
                b = self.blocks[bid]
                if b.ref_cnt == 0:
                    del self.free_queue[bid]
                b.ref_cnt += 1
                table.append(bid)
            self._num_tokens[rid] = len(computed_blocks) * self.block_size
        # the same blocks the free queue gives up (its LRU order decides which), laid out in id
        # order: a pool's blocks lie in id order in memory, so a sequence whose blocks ascend is
        # read by the CPU attention kernels as one forward stream (DESIGN.md, block_manager.py)
        new = sorted(self._pop_free() for _ in range(self.blocks_needed(rid, total_tokens)))
        table.extend(new)
        return new

    def commit(self, rid: str, num_tokens: int) -> list[int]:
        """Record that rid's K/V now hold num_tokens tokens; release blocks past them (e.g. the
        slots of rejected speculative tokens). Returns the released block ids."""
        self._num_tokens[rid] = num_tokens
        if self.allocator == "contiguous":
            return []
        table = self.block_tables.get(rid, [])
        keep = cdiv(num_tokens, self.block_size)
        released = []
        while len(table) > keep:
            bid = table.pop()
            released.append(bid)
            self._release(bid)
        hs = self.req_hashes.get(rid)
        if hs is not None and len(hs) > num_tokens // self.block_size:
            del hs[num_tokens // self.block_size :]
        return released

    def _release(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref_cnt -= 1
        assert b.ref_cnt >= 0, f"block {bid} ref count below zero"
        if b.ref_cnt == 0:
            self.free_queue[bid] = None  # tail: most recently freed, evicted last

    def free(self, rid: str, *, to_head: bool = False) -> list[int]:
        """Drop rid's block table. Blocks whose ref count reaches 0 keep their hash (cached-free).
        to_head=True puts the freed blocks at the head of the free queue in table order (reused
        first), e.g. blocks lent for the duration of one draft so the next allocation takes these
        same blocks back instead of evicting cached prefixes."""
        table = self.block_tables.pop(rid, [])
        self._num_tokens.pop(rid, None)
        self.req_hashes.pop(rid, None)
        for bid in reversed(table):  # tail blocks first into the queue -> evicted first
            self._release(bid)
        if to_head:
            for bid in reversed(table):
                if bid in self.free_queue:
                    self.free_queue.move_to_end(bid, last=False)
        return table

    def drop_hashes(self, rid: str) -> None:
        """Unregister the prefix-cache hashes of the blocks only rid holds, so that freeing them
        leaves nothing to hit (a manual eviction really recomputes)."""
        for bid in self.block_tables.get(rid, []):
            b = self.blocks[bid]
            if b.ref_cnt == 1 and b.block_hash is not None:
                self.uncache(bid)

    def ensure_writable(self, rid: str, start: int, end: int) -> list[tuple[int, int]]:
        """Copy-on-write: any block of rid covering token positions [start, end) that another
        request also holds is replaced by a private copy. Returns (src, dst) copies to perform."""
        copies = []
        table = self.block_tables.get(rid, [])
        if end <= start:
            return copies
        for i in range(start // self.block_size, min(len(table), cdiv(end, self.block_size))):
            bid = table[i]
            b = self.blocks[bid]
            if b.ref_cnt > 1:
                if not self.free_queue:
                    raise NoFreeBlocks(rid)
                dst = self._pop_free()
                b.ref_cnt -= 1
                table[i] = dst
                copies.append((bid, dst))
                self._pending_events.append(
                    (
                        EventKind.COW,
                        rid,
                        {"src": bid, "dst": dst, "reason": "write into a block shared with another request"},
                    )
                )
            elif b.block_hash is not None:
                # sole owner rewrites a registered block: its content changes, so unregister it
                self.uncache(bid)
        return copies

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, rid: str) -> bool:
        return len(self.block_tables.get(rid, [])) <= len(self.free_swap)

    def swap_out(self, rid: str) -> list[tuple[int, int]]:
        """Move rid's blocks to swap slots. Returns (gpu block, swap slot) copies to perform
        BEFORE the gpu blocks are reused. The gpu blocks are released."""
        table = self.block_tables.get(rid, [])
        slots = [self.free_swap.pop() for _ in table]
        pairs = list(zip(table, slots))
        n = self._num_tokens.get(rid, 0)
        self.free(rid)
        self.swapped[rid] = (slots, n)
        return pairs

    def can_swap_in(self, rid: str) -> bool:
        slots, _ = self.swapped[rid]
        return len(slots) <= self.num_free_blocks

    def swap_in(self, rid: str) -> list[tuple[int, int]]:
        """Bring rid back: returns (swap slot, gpu block) copies; the swap slots are released."""
        slots, n = self.swapped.pop(rid)
        table = sorted(self._pop_free() for _ in slots)  # in id order, as allocate() lays them out
        self.block_tables[rid] = table
        self._num_tokens[rid] = n
        self.free_swap.extend(reversed(slots))
        return list(zip(slots, table))

    def drop_swapped(self, rid: str) -> None:
        if rid in self.swapped:
            slots, _ = self.swapped.pop(rid)
            self.free_swap.extend(reversed(slots))

    @property
    def num_swap_used(self) -> int:
        return self.num_swap_blocks - len(self.free_swap)

    # ------------------------------------------------------------------ resizing
    def set_num_blocks(self, n: int) -> None:
        """Change the usable pool size (the tensors keep their capacity). Shrinking takes free
        blocks out of service (LRU first); blocks in use are never touched, so a shrink below
        current use completes as requests release blocks (apply_target runs every step)."""
        if not (isinstance(n, int) and 1 <= n <= self.capacity):
            raise ValueError(f"num_kv_blocks must be an integer in [1, {self.capacity}] (the allocated pool)")
        self.target_blocks = n
        self.apply_target()

    def apply_target(self) -> None:
        while self.num_blocks < self.target_blocks and self.retired:
            bid = min(self.retired)
            self.retired.remove(bid)
            self.free_queue[bid] = None
            self.free_queue.move_to_end(bid, last=False)
            self.num_blocks += 1
        while self.num_blocks > self.target_blocks and self.free_queue:
            bid = self._pop_free("KV budget reduced: block taken out of service")
            self.blocks[bid].ref_cnt = 0
            self.retired.add(bid)
            self.num_blocks -= 1

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every block is free or owned; ref counts equal the number of block tables holding
        the block; the hash index points at blocks carrying that hash; slots in use cover
        exactly the tokens cached (paged) or the reserved slab (contiguous)."""
        refs = [0] * self.capacity
        for rid, table in self.block_tables.items():
            for bid in table:
                assert 0 <= bid < self.capacity and bid not in self.retired, f"{rid}: block {bid} outside the pool"
                refs[bid] += 1
        for bid in self.retired:
            b = self.blocks[bid]
            assert b.ref_cnt == 0 and b.block_hash is None and bid not in self.free_queue, f"retired block {bid} in use"
        for bid in range(self.capacity):
            if bid in self.retired:
                continue
            b = self.blocks[bid]
            in_free = bid in self.free_queue
            assert b.ref_cnt == refs[bid], f"block {bid}: ref_cnt {b.ref_cnt} != tables holding it {refs[bid]}"
            assert in_free == (b.ref_cnt == 0), f"block {bid}: free={in_free} but ref_cnt={b.ref_cnt}"
        assert len(self.free_queue) + sum(1 for r in refs if r) == self.num_blocks, "a block is neither free nor owned"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].block_hash == h, f"hash index points at block {bid} with another hash"
        assert self.hash_content.keys() == self.hash_to_block.keys(), "a cached hash without its content (or back)"
        for rid, table in self.block_tables.items():
            n = self._num_tokens.get(rid, 0)
            if self.allocator == "contiguous":
                assert len(table) == self.slab_blocks and n <= len(table) * self.block_size, f"{rid}: slab mismatch"
            else:
                assert len(table) == cdiv(n, self.block_size), (
                    f"{rid}: {len(table)} blocks for {n} cached tokens (block_size {self.block_size})"
                )
        used_swap = sum(len(s) for s, _ in self.swapped.values())
        assert used_swap + len(self.free_swap) == self.num_swap_blocks, "swap slots leaked"
        assert len(set(self.free_swap)) == len(self.free_swap), "swap slot freed twice"
