"""The prefix suite: a shared system prompt with and without the prefix cache."""

from __future__ import annotations

from engine.bench import common as C
from engine.bench.common import SuiteResult
from engine.bench.report import BenchUnavailable, bar_figure
from engine.lab import prompt_sets as PS


def suite_prefix(ctx: C.BenchContext) -> SuiteResult:
    LLM, SamplingParams, _ = C.require_engine()
    res = SuiteResult()
    ctx.start("prompts")
    tok = ctx.tokenizer()
    n = ctx.pick(16, 6, smoke=2)
    prompts, shared = PS.shared_prefix_prompts(tok, n + 1, prefix_tokens=ctx.pick(1000, 1000, smoke=80))
    warm, prompts = prompts[0], prompts[1:]
    ctx.done("prompts")
    res.add("shared_prefix_tokens", shared, f"{n} questions behind one system prompt")
    blocks = C.blocks_for([len(p) for p in prompts] + [len(warm)], 2) + 16
    ttft, first = {}, {}
    for mode, caching in (("cold", False), ("hit", True)):
        ctx.start(f"TTFT {mode}")
        llm = C.make_llm(ctx, enable_prefix_caching=caching, num_kv_blocks=blocks, max_num_seqs=4)
        try:
            C.warm_up(llm, SamplingParams, [t for t in reversed(warm)])  # unrelated tokens: no shared prefix
            llm.generate([warm], C.greedy(SamplingParams, 1))  # fills the prefix cache when on
            times, toks = [], []
            for p in prompts:  # one at a time: TTFT without batching effects
                outs, wall = C.timed_generate(llm, [p], C.greedy(SamplingParams, 1))
                times.append(wall)
                toks.append(C.token_ids_of(outs[0]))
            m = C.snapshot_metrics(llm)
        finally:
            C.free_llm(llm)
        if caching and not m.prefix_cache_hits:
            raise BenchUnavailable("enable_prefix_caching=True accepted but the snapshot shows no prefix-cache hits")
        if not caching and m.prefix_cache_hits:
            raise BenchUnavailable("enable_prefix_caching=False still reported prefix-cache hits")
        ttft[mode], first[mode] = sorted(times)[len(times) // 2], toks
        if caching:
            res.add("prefix_cache_hit_rate", m.prefix_cache_hit_rate, "tokens found / tokens looked up (engine metric)")
        ctx.done(f"TTFT {mode}")
    res.add("ttft_cold_s", ttft["cold"], "median, prefix caching off (wall time of a 1-token request)")
    res.add("ttft_hit_s", ttft["hit"], "median, prefix caching on, shared prefix already cached")
    res.add("ttft_reduction", 1 - ttft["hit"] / ttft["cold"], "1 - hit / cold (target >= 0.8)")
    res.add("outputs_match", first["cold"] == first["hit"], "first token identical with and without the cache")
    res.figures.append(
        (
            "prefix_ttft",
            bar_figure(
                "TTFT with a ~1,000-token shared system prompt",
                ["cold (no prefix cache)", "prefix-cache hit"],
                [ttft["cold"], ttft["hit"]],
                "seconds (median)",
            ),
        )
    )
    return res
