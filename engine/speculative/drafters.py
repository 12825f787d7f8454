"""Drafters: propose the tokens the target verifies next.

- "ngram" (ngram_propose): prompt lookup. The last n tokens (n from prompt_lookup_max down to
  _min) are matched against the request's earlier tokens (most recent occurrence); the tokens that
  followed it are the draft. Deterministic, so its draft distribution q is a point mass.
- "draft_model" (and "self_draft" with draft_quantize="int8"), ModelDrafter with its own pool: a
  second model with the same tokenizer and its OWN paged K/V pool (same block ids and block size
  as the target's). Its blocks are tracked in the engine's BlockManager under the id
  f"{rid}#draft", so they take real room in the pool and show in the pool map. Every step the
  draft's cached tokens are compared with the request's tokens; K/V past the common prefix is
  rolled back (blocks released, slots cleared) and the missing tokens are fed again (at most 2
  after a verify, the whole context on the first decode step or after its draft cache was dropped).
- "self_draft" with draft_layers=L (early exit), ModelDrafter on the shared pool: the target's
  first L layers + final norm + lm_head, run on the TARGET's pool. Layers < L read the target's
  own K/V for the computed prefix (same weights, same inputs, so exactly what an L-layer model
  would have cached). The draft's writes for the new positions (last token + drafts) land in the
  target's own uncomputed slots, which the verify pass overwrites in every layer before reading
  them; positions past the target's blocks go to blocks borrowed for the duration of propose()
  only (under f"{rid}#draft"). After drafting, every slot the draft wrote is zeroed and the
  borrowed blocks are freed, so the pool is byte-for-byte what it would be without drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.sampler import probs as sampler_probs
from engine.core.scheduler import Scheduler
from engine.model.kv_layout import cdiv
from engine.model.runner import BatchRow, ModelRunner, token_slots
from engine.observe import trace_events as ev

DRAFT_SUFFIX = "#draft"


def draft_id(request_id: str) -> str:
    return request_id + DRAFT_SUFFIX


@dataclass(slots=True)
class SpecContext:
    """The parts of the engine speculative decoding uses (and nothing else of it)."""

    engine_config: EngineConfig
    bm: BlockManager
    runner: ModelRunner  # the target's runner (and pool)
    scheduler: Scheduler  # running requests (their next blocks come first), waiting on memory
    emit: Callable  # emit(kind, request_id, **data)
    model: torch.nn.Module  # the target model
    tokenizer: object  # the target's tokenizer (token text in events)
    device: torch.device
    dtype: torch.dtype
    is_live: Callable[[str], bool]  # is this id a live (unfinished) request of the engine?


def ngram_propose(tokens, k: int, n_min: int, n_max: int, match_bound: bool = False) -> list[int]:
    """Prompt lookup: the longest suffix n-gram (n_max..n_min) that occurred earlier; returns
    the k tokens that followed its most recent earlier occurrence. match_bound: at most m + 1
    tokens, m being how far that occurrence matches the context's end (its n tokens and on
    backwards, past n_max): a one-token match drafts 2, a long copy the full k."""
    ext = list(tokens)
    arr = np.asarray(ext, dtype=np.int64)
    L = len(arr)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pat = ext[L - n :]
        # starts i with arr[i:i+n] == pat and i + n < L (something follows it): those whose first
        # token matches, in one vector compare, then the rest of the n-gram from the latest back
        for i in np.flatnonzero(arr[: L - n] == pat[0])[::-1].tolist():
            if ext[i : i + n] == pat:
                m = n
                if match_bound:
                    while m + 1 < k and m < i + n and ext[i + n - 1 - m] == ext[L - 1 - m]:
                        m += 1
                # copy what followed the match; when the copy reaches the end of the context it
                # continues from its own output (a repeating loop keeps drafting full length)
                src = i + n
                for j in range(min(k, m + 1) if match_bound else k):
                    ext.append(ext[src + j])
                return ext[L:]
    return []


class ModelDrafter:
    """Drafts with a model: either its own pool (draft_model / int8 copy) or, for early exit,
    the target's pool. See the module docstring."""

    def __init__(self, ctx: SpecContext, model, num_layers: int | None, shared_pool: bool):
        self.ctx = ctx
        self.bm = ctx.bm
        self.num_layers = num_layers
        self.shared = shared_pool
        if shared_pool:
            self.runner = ctx.runner
        else:
            dtype = next(model.parameters()).dtype if not _is_quantized(model) else torch.float32
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                dtype = torch.float32
            self.runner = ModelRunner(
                model,
                num_blocks=ctx.bm.capacity,
                block_size=ctx.bm.block_size,
                dtype=dtype,
                device=ctx.device,
                num_layers=num_layers,
                linear_backend=ctx.engine_config.linear_backend,
                attention_backend=ctx.engine_config.attention_backend,
            )
        self.dtoks: dict[str, list[int]] = {}  # own pool: tokens whose draft K/V are cached

    # ----------------------------------------------------------- own-pool bookkeeping
    def drop(self, rid: str, reason: str) -> None:
        self.dtoks.pop(rid, None)
        if self.shared:
            return
        freed = self.bm.free(draft_id(rid))
        if freed:
            self.ctx.emit(ev.BLOCK_FREE, draft_id(rid), blocks=list(freed), reason=reason)

    def _allocate(self, kv_id: str, total_tokens: int, reason: str) -> None:
        new = self.bm.allocate(kv_id, total_tokens)
        if new:
            self.ctx.emit(ev.BLOCK_ALLOC, kv_id, blocks=list(new), reason=reason)

    def owned(self) -> list[str]:
        return list(self.dtoks)

    def _rollback(self, rid: str, keep: int) -> None:
        bm = self.bm
        did = draft_id(rid)
        old = bm.num_tokens(did)
        if keep >= old:
            return
        bs = bm.block_size
        table = bm.table(did)
        self.runner.clear_slots(token_slots(table, bs, keep, min(old, len(table) * bs)))  # past the table: no block
        released = bm.commit(did, keep)
        self.dtoks[rid] = self.dtoks[rid][:keep]
        if released:
            self.ctx.emit(
                ev.BLOCK_FREE, did, blocks=released, reason="draft KV rolled back past the tokens the target kept"
            )

    # ----------------------------------------------------------- propose
    def propose(self, reqs: list, ks: dict[str, int]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """reqs: requests in decode that may draft; ks: rid -> number of draft tokens wanted.
        Returns rid -> (drafts, q rows or None for greedy)."""
        bm = self.bm
        bs = bm.block_size
        # blocks the target's decode rows need this step come first
        reserve = sum(
            bm.blocks_needed(r.request_id, r.num_computed_tokens + 1)
            for r in self.ctx.scheduler.running
            if r.num_tokens - r.num_computed_tokens == 1
        )
        if self.ctx.scheduler.waiting_for_memory() and not self.shared:
            for rid in list(self.dtoks):
                self.drop(rid, "draft KV dropped: waiting requests need the blocks")
            return {}
        plan = []  # (req, k, start, feed tokens)
        borrowed: dict[str, tuple[int, int]] = {}  # shared mode: rid -> (first draft pos, end pos)
        for req in reqs:
            rid = req.request_id
            k = ks[rid]
            ctx = req.all_token_ids
            N = len(ctx)
            if self.shared:
                start = req.num_computed_tokens  # == N - 1
                table = bm.table(rid)
                while k >= 1:
                    need = max(0, cdiv(start + k, bs) - len(table))
                    if need <= bm.num_free_blocks - reserve:
                        break
                    k -= 1
                if k < 1:
                    continue
                if need:
                    bm.allocate(draft_id(rid), need * bs)  # lent until propose() returns: no event
                copies = bm.ensure_writable(rid, start, min(start + k, len(table) * bs))
                if copies:
                    self.runner.copy_blocks(copies)
                borrowed[rid] = (start, start + k)
                plan.append((req, k, start, [ctx[-1]]))
                continue
            did = draft_id(rid)
            have = self.dtoks.get(rid, [])
            common = 0
            lim = min(len(have), N - 1)  # always re-feed the last token
            while common < lim and have[common] == ctx[common]:
                common += 1
            if rid in self.dtoks:
                self._rollback(rid, common)
            while k >= 1:
                need = bm.blocks_needed(did, N + k - 1)
                if need <= bm.num_free_blocks - reserve:
                    break
                k -= 1
            if k < 1:
                if rid in self.dtoks:
                    self.drop(rid, "draft KV dropped: no free blocks beyond what the target needs")
                continue
            self._allocate(did, N + k - 1, "draft model's K/V for the context and its drafts")
            self.dtoks.setdefault(rid, list(ctx[:common]))
            plan.append((req, k, common, list(ctx[common:])))
        if not plan:
            return {}
        out: dict[str, tuple[list[int], list | None]] = {}
        state = [[req, k, start, feed, []] for req, k, start, feed in plan]
        active = state
        while active:
            rows = []
            for req, k, start, feed, drafts in active:
                kv_id = req.request_id if self.shared else draft_id(req.request_id)
                table = bm.table(kv_id)
                if self.shared:
                    table = table + bm.table(draft_id(req.request_id))
                rows.append(BatchRow(kv_id, start, feed, table, len(feed) - 1))
            logits = self.runner.forward(rows, num_layers=self.num_layers)
            nxt = []
            for i, st in enumerate(active):
                req, k, start, feed, drafts = st
                p = req.params
                if p.greedy:
                    tok = int(torch.argmax(logits[i]))
                    qrow = None
                else:
                    qrow = sampler_probs(logits[i], p)
                    tok = int(torch.multinomial(qrow, 1, generator=req.generator))
                drafts.append((tok, qrow))
                st[2] = start + len(feed)
                st[3] = [tok]
                if len(drafts) < k:
                    nxt.append(st)
            active = nxt
        for req, k, start, feed, drafts in state:
            rid = req.request_id
            ids = [t for t, _ in drafts]
            q = None if req.params.greedy else torch.stack([r for _, r in drafts])
            out[rid] = (ids, q)
            if self.shared:
                first, end = borrowed[rid]
                table = bm.table(rid) + bm.table(draft_id(rid))
                self.runner.clear_slots(token_slots(table, bs, first, end))
                # back to the head of the free queue, in their order: the verify pass allocates
                # these same (now hash-less) blocks instead of evicting more cached prefixes
                bm.free(draft_id(rid), to_head=True)
            else:
                did = draft_id(rid)
                n = len(req.all_token_ids) + len(ids) - 1
                bm.commit(did, n)
                self.dtoks[rid] = req.all_token_ids + ids[:-1]
        return out


def _is_quantized(model) -> bool:
    return any("quantized" in type(m).__module__ for m in model.modules())


def check_same_tokenizer(name: str, draft_model, draft_tok, target_model, target_tok) -> None:
    tv, dv = target_model.config.vocab_size, draft_model.config.vocab_size
    if tv != dv:
        raise ValueError(
            f"speculative.draft_model {name!r}: vocab size {dv} differs from the target's {tv}; "
            "the draft must use the target's tokenizer"
        )
    if draft_tok is not target_tok:
        if len(draft_tok) != len(target_tok) or draft_tok.get_vocab() != target_tok.get_vocab():
            raise ValueError(
                f"speculative.draft_model {name!r}: its tokenizer's vocabulary differs from the "
                "target's; the draft must use the same tokenizer"
            )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise ValueError(f"speculative.draft_model {name!r}: {attr} is {b}, the target's is {a}")
