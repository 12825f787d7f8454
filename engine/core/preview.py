"""What a prompt would do if submitted now, computed without submitting it (the as-you-type
preview). Reads the engine's tokenizer, block pool and queues; changes nothing (the prefix lookup
is BlockManager.peek_prefix_hit, the limits are LLMEngine.admission_check).

Verdicts, in the order the engine would apply them:
- "rejected": add_request would refuse it (max_model_len, tier context cap, whole pool too small).
- "wait": accepted but not admitted at the next step: requests already queued (FCFS), the
  max_num_seqs limit, or too few free blocks for its first prefill chunk.
- "preempt": admitted now, but growing to prompt + max_tokens needs more blocks than are free
  now: unless other requests finish first, the scheduler will preempt one (its victim policy).
- "fits": admitted now and its whole worst case fits in the blocks free now.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SamplingParams
from engine.core.inputs import chat_ids
from engine.model.kv_layout import cdiv


@dataclass(frozen=True, slots=True)
class PromptPreview:
    token_ids: tuple[int, ...]  # the prompt as the engine would receive it (chat template applied)
    content_tokens: int  # tokens of the typed text(s) alone
    block_size: int
    hit_blocks: int  # leading full blocks the prefix cache would supply right now
    bytes_per_token: int
    max_tokens: int
    worst_tokens: int  # min(prompt + max_tokens, max_model_len)
    free_blocks: int  # free queue length (includes cached-free)
    cached_free_blocks: int
    verdict: str  # fits / preempt / wait / rejected
    reason: str
    token_texts: tuple[str, ...] = ()  # each token decoded alone (for display)
    step: int = 0  # the engine step the pool and queues were read at

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def template_tokens(self) -> int:
        return self.num_tokens - self.content_tokens

    @property
    def num_blocks(self) -> int:
        return cdiv(self.num_tokens, self.block_size)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def kv_bytes_prompt(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def kv_bytes_worst(self) -> int:
        return self.worst_tokens * self.bytes_per_token

    @property
    def blocks_worst(self) -> int:
        return cdiv(self.worst_tokens, self.block_size)


def template_ids(tokenizer, user: str, system: str | None = None) -> tuple[list[int], int]:
    """(token ids with the chat template applied, tokens of the texts alone). The ids equal
    LLMEngine.apply_chat_template(user) when there is no system prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    try:
        ids = chat_ids(tokenizer, msgs)
    except Exception:  # a tokenizer without a chat template: the texts as they are
        ids = list(tokenizer.encode((system + "\n\n" if system else "") + user, add_special_tokens=False))
    content = len(tokenizer.encode(user, add_special_tokens=False)) if user else 0
    if system:
        content += len(tokenizer.encode(system, add_special_tokens=False))
    return ids, min(content, len(ids))


def preview(engine, ids: list[int], content_tokens: int, params: SamplingParams) -> PromptPreview:
    """The preview of token ids `ids` on `engine` now (call between steps, under the engine lock)."""
    bm = engine.bm
    hit_ids = bm.peek_prefix_hit(ids, params.cache_salt) if ids else []
    worst = min(len(ids) + params.max_tokens, engine.config.max_model_len)
    free, cached_free = bm.num_free_blocks, bm.num_cached_free_blocks
    verdict, reason = _verdict(engine, ids, params, hit_ids, worst)
    return PromptPreview(
        tuple(ids),
        content_tokens,
        bm.block_size,
        len(hit_ids),
        engine.bytes_per_token,
        params.max_tokens,
        worst,
        free,
        cached_free,
        verdict,
        reason,
        tuple(engine.tokenizer.decode([i]) for i in ids),
        engine.step_num,
    )


def _verdict(engine, ids, params, hit_ids: list[int], worst: int) -> tuple[str, str]:
    bm, sched, cfg = engine.bm, engine.scheduler, engine.config
    bs = bm.block_size
    if not ids:
        return "rejected", "prompt must not be empty"
    try:
        engine.admission_check(ids, params)
    except ValueError as e:
        return "rejected", str(e)
    # hit blocks sitting in the free queue come out of it on admission: they are not free for new content
    hit = len(hit_ids)
    taken_from_free = sum(1 for b in hit_ids if bm.ref_count(b) == 0)
    available = bm.num_free_blocks - taken_from_free
    cached_note = f"{bm.num_free_blocks} free ({bm.num_cached_free_blocks} of them cached-free)"
    if sched.waiting:
        return "wait", f"{len(sched.waiting)} request(s) already queued ahead of it (first come, first served)"
    if len(sched.running) >= cfg.max_num_seqs:
        return "wait", f"max_num_seqs = {cfg.max_num_seqs} requests already running"
    if cfg.allocator == "contiguous":
        if not bm.has_free_run(bm.slab_blocks):
            return "wait", f"no contiguous run of {bm.slab_blocks} free blocks ({cached_note})"
        return "fits", f"a contiguous slab of {bm.slab_blocks} blocks is free"
    first = hit * bs + min(len(ids) - hit * bs, cfg.max_num_batched_tokens)
    need_first = cdiv(first, bs) - hit
    if need_first > available:
        return "wait", (
            f"its first prefill chunk ({first} tokens) needs {need_first} new block(s); "
            f"{available} usable of {cached_note}"
        )
    need_worst = cdiv(worst, bs) - hit
    if need_worst > available:
        return "preempt", (
            f"admitted now, but at {worst} tokens it needs {need_worst} new block(s) and only "
            f"{available} are usable now: unless others finish first, the scheduler preempts "
            f"a request (victim policy {cfg.victim_policy})"
        )
    return "fits", (
        f"admitted at the next step; its worst case ({worst} tokens, {need_worst} new block(s) "
        f"after {hit} cached) fits in the {available} usable of {cached_note}"
    )
