"""The fused C stack on a model, as several tests drive it: a runner with 64 blocks of 16 in fp32,
and one prefill then two ragged batches of decode / verify rows over the default tokenizer."""

from __future__ import annotations

import torch

from engine.model.runner import BatchRow, ModelRunner


def runner(model, backend: str = "c", fmt: str = "gguf") -> ModelRunner:
    return ModelRunner(
        model,
        num_blocks=64,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        weight_format=fmt,
        decode_backend=backend,
    )


def ragged_cases(tok) -> list[list[BatchRow]]:
    """A 20-odd-token prefill of "a", then "a" decoding one token beside "b"'s 20-token prefill,
    then "a" verifying five rows beside "b" decoding one."""
    prompt = tok.encode("A paged KV cache keeps each request's keys and values in fixed-size blocks, so")
    ta, tb = list(range(0, 8)), list(range(16, 24))
    return [
        [BatchRow("a", 0, prompt, ta, 0)],
        [BatchRow("a", len(prompt), [42], ta, 0), BatchRow("b", 0, prompt[:20], tb, 19)],
        [BatchRow("a", len(prompt) + 1, [7, 8, 9, 10, 11], ta, 0), BatchRow("b", 20, [11], tb, 0)],
    ]
