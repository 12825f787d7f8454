"""The cache suite: cost per generated token with and without the KV cache."""

from __future__ import annotations

from engine.bench import common as C
from engine.bench.common import SuiteResult
from engine.bench.report import BenchUnavailable, line_figure


def suite_cache(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, _ = C.require_engine()
    res = SuiteResult()
    tok = ctx.tokenizer()
    lengths = ctx.pick((64, 256, 512, 1024), (256, 1024), smoke=(16, 32))
    # decode with the cache is cheap: time more tokens there for a steadier per-token figure
    n_new_of = {True: ctx.pick(33, 17, smoke=3), False: ctx.pick(9, 5, smoke=3)}
    per_tok = {True: {}, False: {}}
    for use_cache in (True, False):
        label = "with KV cache" if use_cache else "without KV cache"
        ctx.start(label)
        n_new = n_new_of[use_cache]
        llm = C.make_llm(
            ctx,
            kv_cache=use_cache,
            max_num_seqs=2,
            max_model_len=2048,
            num_kv_blocks=C.blocks_for([max(lengths)], n_new) + 8,
        )
        try:
            if llm.engine.snapshot().info.kv_cache != use_cache:
                raise BenchUnavailable(
                    f"kv_cache={use_cache} accepted but the engine reports kv_cache="
                    f"{llm.engine.snapshot().info.kv_cache}"
                )
            C.warm_up(llm, SamplingParams, C.filler_ids(tok, 32, seed=9))
            for n in lengths:
                marks = C.token_times(
                    llm, C.filler_ids(tok, n, seed=n), C.greedy(SamplingParams, n_new), request_id=f"ctx{n}-{use_cache}"
                )
                r = C.decode_rate(marks)
                if r is None:
                    raise BenchUnavailable("engine.step() did not report tokens as they were generated")
                per_tok[use_cache][n] = 1.0 / r
        finally:
            C.free_llm(llm)
        ctx.done(label)
    for n in lengths:
        res.add(f"cache_ms_per_token_at_{n}", per_tok[True][n] * 1e3, "decode, prefill excluded")
        res.add(f"nocache_ms_per_token_at_{n}", per_tok[False][n] * 1e3, "every step recomputes the whole prefix")
        res.add(f"nocache_over_cache_at_{n}", per_tok[False][n] / per_tok[True][n], "")
    res.figures.append(
        (
            "cache_cost",
            line_figure(
                "Cost per generated token as context grows",
                {
                    "with KV cache": (list(lengths), [per_tok[True][n] * 1e3 for n in lengths]),
                    "without KV cache": (list(lengths), [per_tok[False][n] * 1e3 for n in lengths]),
                },
                "context (tokens)",
                "ms per token",
                log_y=True,
            ),
        )
    )
    return res
