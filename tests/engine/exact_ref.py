"""Shared prompts and transformers' own greedy outputs for the exactness tests (computed once
per test session on the real default model)."""

from __future__ import annotations

import functools

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the KV cache makes decoding faster.",
    "List three prime numbers.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "Summarize this review comment: the function leaks a file handle when the parser throws, "
    "and the retry loop never backs off, so a flaky disk turns into a busy loop. " * 6,
    "Translate 'good morning, how are you?' to Spanish.",
    "Once upon a time",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
]
MAX_TOKENS = 24


@functools.lru_cache(maxsize=1)
def reference():
    """(prompt token ids, transformers greedy continuation ids) for every prompt."""
    from transformers import AutoTokenizer  # noqa: F401

    from engine.model.models import load_model

    model, tok = load_model("default")
    torch.set_num_threads(1)  # the engine's thread policy too (see EngineConfig.num_threads)
    ids, refs = [], []
    for p in PROMPTS:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(x, dict) or hasattr(x, "input_ids"):
            x = x["input_ids"]
        x = list(x)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([x]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(x), dtype=torch.long),
            )
        ids.append(x)
        refs.append(out[0, len(x) :].tolist())
    return ids, refs
