"""Random GGUF weight blocks for the quantized-Linear tests (test_quant_linear, test_amx_linear)."""

from __future__ import annotations

import numpy as np
import torch


def random_blocks(type_id: int, n: int, k: int, seed: int, d=None, m=None) -> np.ndarray:
    """n rows of k weights as GGUF blocks with finite random fp16 scales (and mins), or every
    block's scale d / min m as given (Q4_1, Q8_0; a given one draws nothing from the generator)."""
    rng = np.random.default_rng(seed)
    if type_id in (1, 30):  # 16-bit floats: finite random values
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
        h = w.to(torch.float16 if type_id == 1 else torch.bfloat16)
        return h.view(torch.int16).numpy().view(np.uint8).reshape(n, -1)
    nb = n * k // 32

    def fp16(v):
        drawn = rng.standard_normal((nb, 1)) * 0.05 if v is None else np.full((nb, 1), v)
        return drawn.astype(np.float16).view(np.uint8)

    if type_id == 3:
        body = [fp16(d), fp16(m), rng.integers(0, 256, (nb, 16), dtype=np.uint8)]
    else:
        body = [fp16(d), rng.integers(0, 256, (nb, 32), dtype=np.uint8)]
    return np.concatenate(body, axis=1).reshape(n, -1)
