"""Continuous batching: which requests run this step and with how many tokens.

Every step: (1) swapped requests come back when blocks allow; (2) running requests get their
next tokens (decode: 1 + speculative drafts; unfinished prefill: the next chunk), preempting a
victim when blocks run out; (3) waiting requests are admitted in order (preempted ones first)
while the token budget (max_num_batched_tokens), max_num_seqs and free blocks allow, taking
their longest cached prefix from the prefix cache. Every decision that leaves a request waiting
or takes its memory is recorded with a reason.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.sequence import Request, Status, WaitReason
from engine.model.kv_layout import cdiv
from engine.observe.trace_events import EventKind


@dataclass(slots=True)
class ScheduledItem:
    req: Request
    num_new_tokens: int  # tokens fed this step (includes draft tokens)
    num_spec_tokens: int = 0  # of those, speculative draft tokens (at the end)
    decode: bool = False  # req.in_decode when scheduled: the row feeds the newest output token

    @property
    def phase(self) -> str:
        """What this row of the forward pass is (the one definition every module reads): "verify"
        (the newest output token and its drafts), "decode" (that token alone) or "prefill"
        (anything else: prompt chunks, a prompt's last token alone, a recompute)."""
        if self.num_spec_tokens:
            return "verify"
        return "decode" if self.decode else "prefill"


@dataclass(slots=True)
class SchedulerOutput:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    """Owns each request's token bookkeeping (vLLM's scheduler does): num_computed_tokens and
    spec_token_ids are written here only (set_drafts, commit_computed, preempt, remove)."""

    def __init__(
        self,
        config: EngineConfig,
        bm: BlockManager,
        emit: Callable,
        swap_out: Callable,
        swap_in: Callable,
        *,
        clock: Callable[[], float],
        bytes_per_token: int,
    ):
        self.config = config
        self.bm = bm
        self.emit = emit  # emit(kind, request_id, **data)
        self.swap_out_fn = swap_out  # perform (gpu block, swap slot) copies
        self.swap_in_fn = swap_in  # perform (swap slot, gpu block) copies
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.admit_counter = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        self.step = 0
        self.bytes_per_token = bytes_per_token  # for history points
        self.now = clock  # seconds since the engine started

    # ------------------------------------------------------------------ queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> list[int]:
        """Take a request out of whatever queue holds it and free its memory; the blocks freed."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.swapped:
            self.swapped.remove(req)
        self.bm.drop_swapped(req.request_id)
        freed = self.bm.free(req.request_id)
        req.spec_token_ids = []
        req.num_computed_tokens = 0  # its blocks are released (cached-free or free)
        return freed

    # ------------------------------------------------------------------ update from the step's output
    def set_drafts(self, reqs: list[Request], drafts: dict[str, list[int]]) -> None:
        """The drafter's proposals for the next step (absent = none): scheduled as verify rows."""
        for r in reqs:
            r.spec_token_ids = list(drafts.get(r.request_id) or [])

    def commit_computed(self, req: Request, num_computed: int) -> list[int]:
        """The step computed (and kept) K/V through num_computed tokens: the request's count, its
        drafts used up, and the block manager's commit (blocks past it handed back, returned)."""
        req.num_computed_tokens = num_computed
        req.spec_token_ids = []
        return self.bm.commit(req.request_id, num_computed)

    def drop_computed(self, req: Request) -> list[int]:
        """kv_cache=False: the K/V are thrown away after each step (the next recomputes all)."""
        req.num_computed_tokens = 0
        return self.bm.free(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def waiting_for_memory(self) -> bool:
        """Some waiting request could not be admitted for lack of free KV blocks."""
        return any(r.wait_reason == WaitReason.NO_FREE_BLOCKS for r in self.waiting)

    _MEMORY_WAITS = (
        WaitReason.NO_FREE_BLOCKS,
        WaitReason.NO_CONTIGUOUS_RUN,
        WaitReason.MEMORY_PRESSURE,
        WaitReason.SWAPPED,
    )

    def _wait(self, req: Request, reason: WaitReason | None, text: str | None) -> None:
        """Record why req is not running (None: it runs); a WAIT event when it starts waiting for memory."""
        if reason in self._MEMORY_WAITS and req.wait_reason != reason:
            self.emit(EventKind.WAIT, req.request_id, wait_reason=reason, reason=text)
        req.wait_reason = reason
        req.wait_reason_text = text

    def _allocate(self, req: Request, total_tokens: int, computed: list[int] = ()) -> None:
        new = self.bm.allocate(req.request_id, total_tokens, computed)
        if new:
            self.emit(
                EventKind.BLOCK_ALLOC,
                req.request_id,
                blocks=list(new),
                reason=f"block table grown to cover {total_tokens} tokens",
            )

    # ------------------------------------------------------------------ preemption
    def _pick_victim(self, current: Request, scheduled: set[str]) -> Request:
        cands = [r for r in self.running if r.request_id not in scheduled and r is not current]
        if not cands:
            return current
        if self.config.victim_policy == "lru":
            return min(cands, key=lambda r: (r.last_scheduled_step, r.admit_order))
        # vLLM's default: lowest priority (highest number) first, then the last admitted
        return max(cands, key=lambda r: (r.priority, r.admit_order))

    def preempt(self, req: Request, why: str, out: SchedulerOutput | None = None, mode: str | None = None) -> None:
        mode = mode or self.config.preemption_mode
        if req in self.running:
            self.running.remove(req)
        nblocks = len(self.bm.table(req.request_id))
        self.num_preemptions += 1
        req.num_preemptions += 1
        if mode == "swap" and not self.bm.can_swap_out(req.request_id):
            mode = "recompute"
            why += "; swap space full, fell back to recompute"
        if mode == "swap":
            pairs = self.bm.swap_out(req.request_id)
            self.swap_out_fn(pairs)
            req.status = Status.SWAPPED
            self.swapped.append(req)
            self.num_swaps += 1
            self.emit(
                EventKind.PREEMPT, req.request_id, mode="swap", blocks_freed=nblocks, tokens_to_recompute=0, reason=why
            )
            self.emit(
                EventKind.SWAP_OUT,
                req.request_id,
                blocks=[b for b, _ in pairs],
                swap_slots=[s for _, s in pairs],
                tokens=req.num_computed_tokens,
                reason=why,
            )
        else:
            self.bm.free(req.request_id)
            req.num_computed_tokens = 0
            req.spec_token_ids = []
            req.status = Status.PREEMPTED
            self._wait(req, WaitReason.PREEMPTED, "preempted: " + why)
            self.waiting.appendleft(req)
            self.emit(
                EventKind.PREEMPT,
                req.request_id,
                mode="recompute",
                blocks_freed=nblocks,
                tokens_to_recompute=req.num_tokens,
                reason=why,
            )
        req.add_history(
            self.step, self.now(), 0, self.bytes_per_token, "swapped" if req.status == Status.SWAPPED else "preempted"
        )
        if out is not None:
            out.preempted.append(req)

    # ------------------------------------------------------------------ schedule
    def schedule(self, step: int) -> SchedulerOutput:
        self.step = step
        cfg = self.config
        bm = self.bm
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. swap in (FIFO) when blocks allow and no one was preempted yet
        while self.swapped and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            if not bm.can_swap_in(req.request_id):
                self._wait(req, WaitReason.SWAPPED, "swapped out: waiting for free blocks to swap back in")
                break
            self.swapped.popleft()
            pairs = bm.swap_in(req.request_id)
            self.swap_in_fn(pairs)
            req.status = Status.RUNNING
            self._wait(req, None, None)
            self.running.append(req)
            self.emit(
                EventKind.SWAP_IN,
                req.request_id,
                blocks=[b for _, b in pairs],
                swap_slots=[s for s, _ in pairs],
                tokens=req.num_computed_tokens,
                reason="blocks available again",
            )

        # 2. running requests
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if budget <= 0:
                self._wait(req, WaitReason.TOKEN_BUDGET, "token budget (max_num_batched_tokens) used up this step")
                i += 1
                continue
            base = req.num_tokens - req.num_computed_tokens
            decode = req.in_decode
            spec = req.spec_token_ids if decode else []
            num_new = min(base + len(spec), budget, cfg.max_model_len - req.num_computed_tokens)
            n_spec = max(0, num_new - base)
            if num_new <= 0:
                i += 1
                continue
            ok = True
            while not bm.can_allocate(req.request_id, req.num_computed_tokens + num_new):
                if n_spec:  # first give up draft tokens rather than someone's cache
                    num_new -= n_spec
                    n_spec = 0
                    continue
                victim = self._pick_victim(req, scheduled)
                need = bm.blocks_needed(req.request_id, req.num_computed_tokens + num_new)
                why = (
                    f"no free KV blocks: {req.request_id} needs {need} more, {bm.num_free_blocks} free; "
                    f"policy {cfg.victim_policy}"
                )
                self.preempt(victim, why, out)
                if victim is req:
                    ok = False
                    break
            if not ok:
                continue  # req was removed from running; same index now holds the next one
            self._allocate(req, req.num_computed_tokens + num_new)
            out.items.append(ScheduledItem(req, num_new, n_spec, decode))
            scheduled.add(req.request_id)
            req.last_scheduled_step = step
            self._wait(req, None, None)
            budget -= num_new
            i += 1

        # 3. waiting requests (preempted ones sit at the front)
        while self.waiting:
            req = self.waiting[0]
            if out.preempted:
                self._wait(
                    req, WaitReason.MEMORY_PRESSURE, "not admitted: memory pressure (a request was preempted this step)"
                )
                break
            if len(self.running) >= cfg.max_num_seqs:
                self._wait(req, WaitReason.SEQ_LIMIT, f"seq limit: max_num_seqs={cfg.max_num_seqs} running")
                break
            if budget <= 0:
                self._wait(req, WaitReason.TOKEN_BUDGET, "token budget (max_num_batched_tokens) used up this step")
                break
            computed, hit_tokens = ([], 0)
            if req.num_computed_tokens == 0:
                computed, hit_tokens = bm.get_computed_blocks(req.request_id, req.all_token_ids, req.params.cache_salt)
            num_new = min(req.num_tokens - hit_tokens, budget)
            total = hit_tokens + num_new
            if not bm.can_allocate(req.request_id, total, computed):
                need = bm.blocks_needed(req.request_id, total) - len(computed)
                if cfg.allocator == "contiguous":
                    self._wait(
                        req,
                        WaitReason.NO_CONTIGUOUS_RUN,
                        f"no contiguous run of {bm.slab_blocks} free blocks ({bm.num_free_blocks} free in total)",
                    )
                else:
                    self._wait(
                        req, WaitReason.NO_FREE_BLOCKS, f"no free KV blocks: needs {need}, {bm.num_free_blocks} free"
                    )
                break
            self.waiting.popleft()
            self._allocate(req, total, computed)
            bm.record_prefix_query(req.num_tokens, hit_tokens)
            first_time = req.admit_order < 0
            req.num_computed_tokens = hit_tokens
            if first_time:
                req.admit_order = self.admit_counter
                self.admit_counter += 1
                req.num_cached_tokens = hit_tokens
            if hit_tokens:
                self.emit(
                    EventKind.PREFIX_HIT,
                    req.request_id,
                    blocks=list(computed),
                    tokens=hit_tokens,
                    reason="longest cached prefix of full blocks reused",
                )
            self.emit(
                EventKind.ADMIT,
                req.request_id,
                resumed=not first_time,
                prompt_tokens=req.num_prompt_tokens,
                tokens_to_compute=req.num_tokens - hit_tokens,
                cached_tokens=hit_tokens,
                num_blocks=len(bm.table(req.request_id)),
                reason="resumed after preemption" if not first_time else "blocks and budget available",
            )
            req.status = Status.RUNNING
            self._wait(req, None, None)
            req.last_scheduled_step = step
            self.running.append(req)
            out.items.append(ScheduledItem(req, num_new, 0))
            scheduled.add(req.request_id)
            budget -= num_new

        for req in self.waiting:
            if req is not (self.waiting[0] if self.waiting else None) and not req.wait_reason_text:
                self._wait(req, WaitReason.QUEUED, "queued behind earlier requests (FCFS)")
        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def blocks_for_whole_request(self, num_tokens: int) -> int:
        if self.config.allocator == "contiguous":
            return self.bm.slab_blocks
        return cdiv(num_tokens, self.bm.block_size)
