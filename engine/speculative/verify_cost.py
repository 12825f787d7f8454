"""What verification costs on kvscope's own engine: one target pass over k+1 new rows of one
sequence against a one-row pass at the same context, through the model runner the engine decodes
with (the C stack where it is built, the weights the engine loaded). The one home for that
measurement: the speculative decoder's start-up calibration, `bench speculative`'s
verify_cost_ratio_k*, and the Claims page's verify_cost row all time it here.

The blocks are lent by the block manager for the measurement only (an id that is never a
request's), their K/V slots zeroed afterwards and the blocks handed back to the head of the free
queue in their order, so the pool ends as it began.
"""

from __future__ import annotations

import time

import torch

from engine.model.kv_layout import cdiv
from engine.model.runner import BatchRow, token_slots
from engine.speculative.drafters import DRAFT_SUFFIX

OWNER = "verify-cost" + DRAFT_SUFFIX  # a draft-suffixed id: never a request's
DEFAULT_KS = (1, 2, 4, 8)
DEFAULT_CONTEXT = 64


def fits(bm, context: int, max_rows: int) -> bool:
    """Whether the pool's free blocks can lend one sequence of context + max_rows tokens."""
    return cdiv(context + max_rows, bm.block_size) <= bm.num_free_blocks


@torch.inference_mode()
def time_target_passes(runner, bm, rows, context: int = DEFAULT_CONTEXT, reps: int = 5, vocab_size: int = 30000):
    """{m: [seconds of each round]} for a target pass over m new rows of one sequence with
    `context` tokens already in its K/V, for every m in `rows`, the row counts alternating within
    each of `reps` rounds. Raises ValueError when the free blocks cannot hold the sequence."""
    rows = sorted(set(int(m) for m in rows))
    if not rows or rows[0] < 1 or context < 1:
        raise ValueError(f"rows must be >= 1 and context >= 1 (got rows={rows}, context={context})")
    bs = bm.block_size
    n = cdiv(context + rows[-1], bs)
    if n > bm.num_free_blocks:
        raise ValueError(f"verify cost: {n} free KV blocks needed for context + rows, {bm.num_free_blocks} free")
    bm.allocate(OWNER, n * bs)
    table = bm.table(OWNER)[:n]
    toks = [(i * 7919) % min(vocab_size, 30000) + 10 for i in range(context + rows[-1])]
    times: dict[int, list[float]] = {m: [] for m in rows}
    try:
        runner.forward([BatchRow("verify-cost", 0, toks[:context], table, context - 1)])
        for _ in range(reps):
            for m in rows:
                t = time.perf_counter()
                runner.forward([BatchRow("verify-cost", context, toks[context : context + m], table, 0)])
                times[m].append(time.perf_counter() - t)
    finally:
        runner.clear_slots(token_slots(table, bs, 0, len(table) * bs))  # every slot of the lent blocks
        bm.free(OWNER, to_head=True)
    return times


def verify_cost_ratios(runner, bm, ks=DEFAULT_KS, context: int = DEFAULT_CONTEXT, reps: int = 8, vocab_size=30000):
    """{"verify_pass_1_ms", "verify_context", "verify_cost_ratio_k<k>"...}: the best (fastest) of
    `reps` alternating rounds of each row count, a (k+1)-row pass over a 1-row pass."""
    times = time_target_passes(runner, bm, [1, *(k + 1 for k in ks)], context, reps, vocab_size)
    best = {m: min(ts) for m, ts in times.items()}
    out = {"verify_pass_1_ms": best[1] * 1e3, "verify_context": context}
    for k in ks:
        out[f"verify_cost_ratio_k{k}"] = best[k + 1] / best[1]
    return out


def engine_verify_cost_ratios(eng, ks=DEFAULT_KS, context: int = DEFAULT_CONTEXT, reps: int = 8) -> dict:
    """verify_cost_ratios on an LLMEngine (its runner and block manager), between its steps."""
    return verify_cost_ratios(eng.runner, eng.bm, ks, context, reps, eng.runner.model.config.vocab_size)
