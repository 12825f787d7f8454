"""Why int4 / int2 K/V keep one scale per 32 numbers (engine/model/kv_quant.py): the quality of one
scale per row against one per group of the head dim, on the default model.

K and V are fake-quantized (round to the format's levels with the chosen scale grouping, kept in
float32) as the attention receives them, so the fp32 pool holds exactly what a pool of that
format would widen to; then, teacher-forced, mean KL to fp32 and top-1 agreement on the last 8
positions of 3 short chat prompts, and needle recall (hit, log p of the code) at depths 0.1 and
0.5 of a context of CONTEXT tokens.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/kv_scale_groups.py [CONTEXT=1024]
"""

import sys
import time

import torch
from transformers import AttentionInterface

from engine import EngineConfig, LLMEngine
from engine.bench.kvquant import kl_rows, teacher_forced_logprobs
from engine.lab import prompt_sets as PS
from engine.model import attention

VARIANTS = [  # (name, qmax, numbers per scale)
    ("int4 per row", 7, 64),
    ("int4 per 32", 7, 32),
    ("int4 per 16", 7, 16),
    ("int2 per row", 1, 64),
    ("int2 per 16", 1, 16),
    ("int3 per row", 3, 64),
]
MODE = {"q": None}
paged = attention.paged_attention_forward


def fake_quant(x, qmax, g):
    sh = x.shape
    y = x.float().reshape(*sh[:-1], sh[-1] // g, g)
    s = y.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((y / s).round().clamp(-qmax, qmax) * s).reshape(sh).to(x.dtype)


def quantized_attention(module, query, key, value, *a, **k):
    if MODE["q"] is not None:
        qmax, g = MODE["q"]
        key, value = fake_quant(key, qmax, g), fake_quant(value, qmax, g)
    return paged(module, query, key, value, *a, **k)


def main():
    context = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    torch.set_num_threads(1)
    AttentionInterface.register(attention.ATTN_NAME, quantized_attention)
    attention.register = lambda: None  # keep the wrapper registered
    cfg = EngineConfig(
        model="default",
        attention_backend="torch",
        enable_prefix_caching=False,
        max_model_len=context + 256,
        num_kv_blocks=(context + 256) // 16 + 8,
        num_threads=1,
    )
    eng = LLMEngine(cfg)
    chat = PS.w16_prompts(eng.tokenizer, n=3, seed=0, min_tokens=30, max_tokens=120, return_token_ids=True)
    needles = PS.needle_prompts(eng.tokenizer, depths=(0.1, 0.5), n_codes=1, context_tokens=context)

    def run():
        short = [teacher_forced_logprobs(eng, p, len(p) - 8) for p in chat]
        hits = []
        for n in needles:
            lp = teacher_forced_logprobs(eng, n.prompt_token_ids + n.answer_token_ids, len(n.prompt_token_ids))
            ans = torch.tensor(n.answer_token_ids)
            hits.append((bool((lp.argmax(-1) == ans).all()), round(float(lp.gather(1, ans[:, None]).sum()), 2)))
        return short, hits

    t = time.time()
    ref, ref_hits = run()
    print(f"fp32 needles {ref_hits} ({time.time() - t:.0f} s per variant)", flush=True)
    for name, qmax, g in VARIANTS:
        MODE["q"] = (qmax, g)
        got, hits = run()
        kl = torch.cat([kl_rows(r, q) for r, q in zip(ref, got)])
        top1 = torch.cat([(r.argmax(-1) == q.argmax(-1)).float() for r, q in zip(ref, got)])
        print(f"{name}: mean KL {kl.mean():.4f}, top-1 {top1.mean():.2f}, needles {hits}", flush=True)


if __name__ == "__main__":
    main()
