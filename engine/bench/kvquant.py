"""`python -m engine bench kvquant`: what a quantized K/V cache costs in quality, and what it buys.

For each pool format (EngineConfig.kv_cache_dtype: fp32 as the reference, bf16, fp16, fp8_e4m3,
int8, int4, int2) on one fixed prompt set (engine/lab/prompt_sets.py: chat prompts, long-context prompts of 1-2k
tokens, needle-in-a-haystack prompts), greedy decoding through the engine, then:

- agreement with the fp32-KV run: `token_agreement` (identical tokens at the same position / all
  tokens), `sequences_identical` (fraction of prompts whose whole output is identical),
  `first_divergence` (per prompt, the first position that differs; null when none) and its median;
- `mean_kl`: KL(p_fp32 || p_dtype) of the next-token distributions, mean over positions,
  teacher-forced on the fp32 run's tokens (each pool format reads the same context);
- `needle_recall`: fraction of needle prompts whose greedy continuation of the primed answer ("The
  access code ... is") is exactly the planted code, scored teacher-forced (argmax at every code
  token: the same as greedy generation of those tokens), and `needle_logprob`, the mean log
  probability of the code's tokens; fp32's own recall says what the test can measure on the model;
- short prompts alone (the chat prompts, 30-300 tokens), teacher-forced on fp32's tokens:
  `short_top1_agreement` (the format's most likely next token is fp32's, per position: no
  cascade after a first difference, unlike token_agreement) and `short_mean_kl`;
- long-range recall at growing distance (`recall_by_context`, `logprob_by_context`): needles
  near the start (depth 0.1) of contexts of RECALL_CONTEXTS tokens (quick: RECALL_CONTEXTS_QUICK;
  prompt_sets.needle_sweep), scored
  as needle_recall is, for the formats of RECALL_DTYPES (bf16 / fp16 match fp32 to 1e-4 nats and
  are skipped to keep the run short);
- `bytes_per_token` (memory_math's formula, scales included), `tokens_per_mib`, and batch-1
  `decode_tok_s` after a chat prompt.
Teacher-forced passes run the engine's own ModelRunner on an idle engine's pool (prefix caching
off, so no cached block is overwritten): the same write -> widen -> attend path as decoding.

The default model's results also go to assets/measurements/kvquant.json (with the date), which
the Memory calculator page shows beside the dtype choice. That file also keeps "recall_grid": a
needle at depths 0.1 / 0.5 / 0.9 of prompts of 1k to 8k tokens (the default model's own limit) for
fp32 / int8 / int4 / int2, measured apart by scripts/kv_recall_grid.py (too long for this suite on
a shared 2-core machine) and kept when this suite rewrites the file; the kv_quant Claims row and
the Memory calculator read it (engine/lab/recall_grid.py).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics

from engine.bench import common as C
from engine.config import KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES
from engine.model.kv_layout import cdiv
from engine.speculative.drafters import DRAFT_SUFFIX

DTYPES = tuple(d for d in KV_CACHE_DTYPES if d != "auto")  # fp32 first: the reference
RECALL_DTYPES = ("fp32", *QUANTIZED_KV_CACHE_DTYPES)
# contexts of the recall sweep: the full run goes to 4096 tokens (the default model's own limit is
# 8192; on the shared 2-core machine one 4096-token teacher-forced pass per format took minutes),
# quick stops at 2048 with one needle per length, smoke is a token sweep the tiny model can run
RECALL_CONTEXTS = (512, 1024, 2048, 4096)
RECALL_CONTEXTS_QUICK = (512, 1024, 2048)
ASSET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "assets",
    "measurements",
    "kvquant.json",
)


def teacher_forced_logprobs(eng, tokens: list[int], first: int):
    """log-softmax rows predicting tokens[first:], one forward pass over tokens[:-1] on the pool
    of an idle engine, in blocks its block manager lends for the pass (no request holds them and
    nothing is cached; handed back to the head of the free queue)."""
    import torch

    from engine.model.runner import BatchRow

    if eng.has_unfinished_requests() or eng.bm.enable_prefix_caching:
        raise RuntimeError("teacher forcing needs an idle engine without prefix caching")
    feed = tokens[:-1]
    n_blocks = cdiv(len(feed), eng.bm.block_size)
    if n_blocks > eng.bm.num_blocks:
        raise RuntimeError(f"{len(feed)} tokens need {n_blocks} blocks; the pool has {eng.bm.num_blocks}")
    owner = "teacher-forced" + DRAFT_SUFFIX  # never a request's id (add_request refuses the suffix)
    eng.bm.allocate(owner, len(feed))
    try:
        logits = eng.runner.forward([BatchRow(owner, 0, feed, eng.bm.table(owner), first - 1)])
    finally:
        eng.bm.free(owner, to_head=True)
    return torch.log_softmax(logits.float(), dim=-1)


def kl_rows(ref_logp, logp):
    """KL(ref || other) per row, natural log."""
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = total = 0
    first = []
    for a, b in zip(ref, got):
        total += len(a)
        same += sum(x == y for x, y in zip(a, b))
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None and len(a) != len(b):
            d = min(len(a), len(b))
        first.append(d)
    diverged = [d for d in first if d is not None]
    return {
        "token_agreement": same / total if total else 1.0,
        "sequences_identical": sum(d is None for d in first) / len(first) if first else 1.0,
        "first_divergence": first,
        "first_divergence_median": statistics.median(diverged) if diverged else None,
    }


def _prompt_set(ctx, tok):
    from engine.lab import prompt_sets as PS

    chat = PS.w16_prompts(
        tok,
        n=ctx.pick(8, 3, smoke=2),
        seed=0,
        min_tokens=30,
        max_tokens=ctx.pick(300, 120, smoke=40),
        return_token_ids=True,
    )
    lo, hi = ctx.pick((1024, 2048), (1024, 1024), smoke=(96, 128))
    long = PS.long_context_prompts(tok, n=ctx.pick(3, 1, smoke=1), seed=0, min_tokens=lo, max_tokens=hi)
    needles = PS.needle_prompts(
        tok,
        depths=ctx.pick(PS.NEEDLE_DEPTHS, (0.1, 0.5, 0.9), smoke=(0.5,)),
        n_codes=ctx.pick(2, 1, smoke=1),
        context_tokens=ctx.pick(1536, 1024, smoke=128),
    )
    sweep = PS.needle_sweep(
        tok, contexts=ctx.pick(RECALL_CONTEXTS, RECALL_CONTEXTS_QUICK, smoke=(96, 192)), n_codes=ctx.pick(2, 1, smoke=1)
    )
    return chat, long, needles, sweep


def needle_scores(eng, needles) -> tuple[list[bool], list[float]]:
    """Per needle prompt: whether greedy decoding continues the primer with exactly the code
    (argmax at every code token, teacher-forced), and the code's total log probability."""
    import torch

    hits, lps = [], []
    for n in needles:
        lp = teacher_forced_logprobs(eng, n.prompt_token_ids + n.answer_token_ids, len(n.prompt_token_ids))
        ans = torch.tensor(n.answer_token_ids)
        hits.append(bool((lp.argmax(-1).cpu() == ans).all()))
        lps.append(float(lp.gather(1, ans[:, None].to(lp.device)).sum()))
    return hits, lps


def suite_kvquant(ctx: C.BenchContext):
    import torch

    _, SamplingParams, _ = C.require_engine()
    res = C.SuiteResult()
    new_tokens = ctx.pick(48, 16, smoke=6)
    decode_tokens = ctx.pick(48, 16, smoke=4)
    by_dtype: dict[str, dict] = {}
    ref_tokens = ref_logp = None
    chat = long = needles = sweep = None
    longest = max(ctx.pick(RECALL_CONTEXTS, RECALL_CONTEXTS_QUICK, smoke=(192,)))
    max_len = max(2304, longest + 256)
    for dt in DTYPES:
        ctx.start(f"kv_cache_dtype={dt}")
        llm = C.make_llm(
            ctx,
            kv_cache_dtype=dt,
            enable_prefix_caching=False,
            max_model_len=max_len,
            max_num_seqs=8,
            num_kv_blocks=max(320, max_len // 16 + 16),
        )
        eng = llm.engine
        try:
            if chat is None:
                chat, long, needles, sweep = _prompt_set(ctx, eng.tokenizer)
            prompts = chat + long
            C.warm_up(llm, SamplingParams, chat[0])
            outs = llm.generate(prompts, C.greedy(SamplingParams, new_tokens))
            tokens = [C.token_ids_of(o) for o in outs]
            logp = [
                teacher_forced_logprobs(eng, p + t, len(p))
                for p, t in zip(prompts, tokens if ref_tokens is None else ref_tokens)
            ]
            hits, lps = needle_scores(eng, needles)
            swept = {c: needle_scores(eng, ns) for c, ns in sweep.items()} if dt in RECALL_DTYPES else {}
            rate = C.decode_rate(
                C.token_times(llm, chat[0], C.greedy(SamplingParams, decode_tokens), request_id=f"decode-{dt}")
            )
            info = eng.info()
        finally:
            C.free_llm(llm)
        if ref_tokens is None:
            ref_tokens, ref_logp = tokens, logp
        kl = torch.cat([kl_rows(r, q) for r, q in zip(ref_logp, logp)])
        n_chat = len(chat)
        short_kl = torch.cat([kl_rows(r, q) for r, q in zip(ref_logp[:n_chat], logp[:n_chat])])
        short_top1 = torch.cat(
            [(r.argmax(-1) == q.argmax(-1)).float() for r, q in zip(ref_logp[:n_chat], logp[:n_chat])]
        )
        row = {
            "bytes_per_token": info.bytes_per_token,
            "tokens_per_mib": 2**20 / info.bytes_per_token,
            "kv_cache_dtype": info.kv_cache_dtype,
            **agreement(ref_tokens, tokens),
            "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()),
            "short_top1_agreement": float(short_top1.mean()),
            "short_mean_kl": float(short_kl.mean()),
            "needle_recall": sum(hits) / len(hits),
            "needle_hits": hits,
            "needle_logprob": sum(lps) / len(lps),
            "decode_tok_s": rate,
            "attention_backend": info.attention_backend,
        }
        if swept:
            row["recall_by_context"] = {str(c): sum(h) / len(h) for c, (h, _) in swept.items()}
            row["logprob_by_context"] = {str(c): sum(lp) / len(lp) for c, (_, lp) in swept.items()}
        by_dtype[dt] = row
        ctx.done(f"kv_cache_dtype={dt}")
    fp32_bpt = by_dtype["fp32"]["bytes_per_token"]
    for dt, r in by_dtype.items():
        r["tokens_vs_fp32"] = fp32_bpt / r["bytes_per_token"]
        res.add(
            f"{dt}_bytes_per_token",
            r["bytes_per_token"],
            f"{r['tokens_per_mib']:.1f} tokens per MiB, {r['tokens_vs_fp32']:.2f}x fp32's tokens in the same bytes",
        )
        res.add(
            f"{dt}_token_agreement",
            r["token_agreement"],
            f"sequences identical {r['sequences_identical']:.2f}; first divergence at {r['first_divergence']}",
        )
        res.add(f"{dt}_mean_kl", r["mean_kl"], f"nats, teacher-forced on fp32's tokens (max {r['max_kl']:.3g})")
        res.add(f"{dt}_needle_recall", r["needle_recall"], f"mean log p(code) {r['needle_logprob']:.2f}")
        res.add(
            f"{dt}_short_top1_agreement",
            r["short_top1_agreement"],
            f"chat prompts, teacher-forced on fp32's tokens; KL {r['short_mean_kl']:.3g} nats",
        )
        if "recall_by_context" in r:
            curve = ", ".join(f"{c}: {v:.2f}" for c, v in r["recall_by_context"].items())
            res.add(
                f"{dt}_recall_by_context",
                r["recall_by_context"],
                f"needle recall by context tokens: {curve}",
                row=False,
            )
        res.add(f"{dt}_decode_tok_s", r["decode_tok_s"], f"batch 1, {r['attention_backend']} attention")
    prompt_set = {
        "chat_prompts": len(chat),
        "chat_prompt_tokens": [len(p) for p in chat],
        "long_prompts": len(long),
        "long_prompt_tokens": [len(p) for p in long],
        "needle_prompts": len(needles),
        "needle_depths": sorted({n.depth for n in needles}),
        "needle_context_tokens": [n.context_tokens for n in needles],
        "recall_contexts": list(sweep),
        "recall_depth": sorted({n.depth for ns in sweep.values() for n in ns}),
        "recall_needles_per_context": len(next(iter(sweep.values()))),
        "recall_prompt_tokens": {str(c): [n.context_tokens for n in ns] for c, ns in sweep.items()},
        "recall_dtypes": [d for d in DTYPES if d in RECALL_DTYPES],
        "new_tokens": new_tokens,
        "decode_tokens": decode_tokens,
    }
    res.add("by_dtype", by_dtype, row=False)
    res.add("prompt_set", prompt_set, row=False)
    if by_dtype["fp32"]["needle_recall"] == 0:
        ctx.note(
            "kvquant: fp32 itself recalls none of the needles on this model, so needle_recall cannot show a "
            "loss here; needle_logprob still compares the formats"
        )
    if ctx.model == "default" and not ctx.smoke:
        path = write_asset(by_dtype, prompt_set, quick=ctx.quick, model=ctx.model)
        ctx.files.append(path)
    return res


def write_asset(by_dtype: dict, prompt_set: dict, *, quick: bool, model: str, path: str = ASSET) -> str:
    """The latest measurement for the Memory calculator page, with its date."""
    now = datetime.datetime.now(datetime.timezone.utc)
    data = {
        "date": now.date().isoformat(),
        "measured_at": now.isoformat(timespec="seconds"),
        "command": "python -m engine bench kvquant" + (" --quick" if quick else ""),
        "model": model,
        "machine": {
            k: v
            for k, v in C.machine_info().items()
            if k in ("cpu", "nproc", "torch", "torch_threads", "load_avg_1m_at_start")
        },
        "prompt_set": prompt_set,
        "dtypes": by_dtype,
    }
    try:  # the recall grid to the model's context (scripts/kv_recall_grid.py) is measured apart: kept
        with open(path) as f:
            grid = json.load(f).get("recall_grid")
    except (OSError, ValueError, AttributeError):
        grid = None
    if grid is not None:
        data["recall_grid"] = grid
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    return path
