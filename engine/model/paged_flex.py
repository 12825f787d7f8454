"""Paged attention through PyTorch's FlexAttention: every row of the flattened batch (prefill
chunks, decode rows, speculative verification rows) attends to its keys and values where they
lie in the block pool, in one call per layer, with no gather.

The pool of a layer, [num_blocks, block_size, kv_heads, head_dim], is viewed (not copied) as one
long key sequence of num_blocks * block_size slots. A query token of request s at position p may
attend slot k when k's block holds logical block b of request s (phys_to_logical[s, k // bs] = b)
and b * bs + k % bs <= p: the block table and the causal mask in one `mask_mod`. The BlockMask is
built directly from the block tables: for each group of Q_BLOCK query rows, the physical blocks
of the requests in that group (vLLM's "direct build"), so the kernel visits only those blocks.

Devices: on CUDA flex_attention runs compiled (Triton); the block mask's KV block is the engine's
block size, so CUDA needs a block size of 16, 32, 64 or 128. On CPU it runs eagerly (unfused: it
materialises the [heads, tokens, pool slots] scores, fine for the tiny test model, slow for real
ones), which is how the test suite exercises this exact path without a GPU; the compiled CPU
kernel takes ~25 s to compile per shape on a 2-core machine, too slow for a batch whose length
changes every step. torch >= 2.5 has every API used here (the GPU machines run 2.11).
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

import torch

from engine.model.kv_layout import cdiv

Q_BLOCK = 16  # query rows per block-mask row group (vLLM's direct build uses 16)
CUDA_BLOCK_SIZES = (16, 32, 64, 128)
_lock = threading.Lock()
_compiled: dict = {}


def unavailable_reason(device: torch.device, block_size: int) -> str | None:
    """Why the flex path cannot run here, or None when it can."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({e})"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return f"torch {torch.__version__} has no BlockMask.from_kv_blocks"
    if device.type == "cuda" and block_size not in CUDA_BLOCK_SIZES:
        return f"attention_backend='flex' on CUDA needs block_size in {CUDA_BLOCK_SIZES}, got {block_size}"
    if device.type not in ("cpu", "cuda"):
        return f"attention_backend='flex' is not wired for device type {device.type!r}"
    return None


def _compile_wanted(device: torch.device) -> bool:
    env = os.environ.get("KVSCOPE_FLEX_COMPILE")
    if env is not None:
        return env == "1"
    return device.type == "cuda"


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if not _compile_wanted(device):
        return flex_attention
    with _lock:
        fn = _compiled.get("flex")
        if fn is None:
            fn = _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
        return fn


@dataclass(slots=True)
class FlexMeta:
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask over (T, pool slots)
    kernel_options: dict | None
    compiled: bool


def build(
    rows: list[tuple[int, int, int, list[int]]], num_blocks: int, block_size: int, device: torch.device
) -> FlexMeta:
    """rows: per request (first row in the flattened batch, number of new tokens, first position,
    block table covering its context). Returns the block mask every layer of this step uses."""
    from torch.nn.attention.flex_attention import BlockMask

    bs = block_size
    T = sum(n for _, n, _, _ in rows)
    S = len(rows)
    n_qb = cdiv(T, Q_BLOCK)
    # kernels may evaluate the mask on rows padded up to whole query blocks: those rows see nothing
    q_seq = torch.zeros(n_qb * Q_BLOCK, dtype=torch.int32)
    q_pos = torch.full((n_qb * Q_BLOCK,), -1, dtype=torch.int32)
    p2l = torch.full((S, num_blocks), -1, dtype=torch.int32)
    groups: list[set] = [set() for _ in range(n_qb)]
    for s, (t0, n, start, table) in enumerate(rows):
        q_seq[t0 : t0 + n] = s
        q_pos[t0 : t0 + n] = torch.arange(start, start + n, dtype=torch.int32)
        if table:
            p2l[s, torch.tensor(table, dtype=torch.long)] = torch.arange(len(table), dtype=torch.int32)
        for qb in range(t0 // Q_BLOCK, (t0 + n - 1) // Q_BLOCK + 1):
            groups[qb].update(table)
    width = num_blocks  # BlockMask's layout: [.., q blocks, every KV block], the used ones first
    kv_num = torch.tensor([len(g) for g in groups], dtype=torch.int32)
    kv_idx = torch.zeros((n_qb, width), dtype=torch.int32)
    for i, g in enumerate(groups):
        if g:
            kv_idx[i, : len(g)] = torch.tensor(sorted(g), dtype=torch.int32)
    q_seq, q_pos, p2l = q_seq.to(device), q_pos.to(device), p2l.to(device)

    def mask_mod(b, h, q_idx, kv_idx_):
        lb = p2l[q_seq[q_idx], kv_idx_ // bs]
        return (lb >= 0) & (lb * bs + kv_idx_ % bs <= q_pos[q_idx])

    mask = BlockMask.from_kv_blocks(
        kv_num.view(1, 1, n_qb).to(device),
        kv_idx.view(1, 1, n_qb, width).to(device),
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(T, num_blocks * bs),
    )
    compiled = _compile_wanted(device)
    opts = {"BLOCK_M": Q_BLOCK, "BLOCK_N": bs} if compiled else None
    return FlexMeta(mask, opts, compiled)


def attend(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, fm: FlexMeta, scale: float | None
) -> torch.Tensor:
    """q [H, T, D] -> out [T, H, D], attending in place to the pools."""
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    k = k_pool.view(-1, hkv, d).transpose(0, 1).unsqueeze(0)  # [1, Hkv, slots, D], a view
    v = v_pool.view(-1, hkv, d).transpose(0, 1).unsqueeze(0)
    if k.dtype != q.dtype:
        # converting would copy the whole pool every layer: exactly the gather this path avoids
        raise ValueError(
            f"attention_backend='flex' reads the pool in the compute dtype; the pool holds {k.dtype}, "
            f"the queries are {q.dtype} (a quantized or differently typed KV cache needs the torch path)"
        )
    fn = _flex_fn(q.device)
    kw = {"kernel_options": fm.kernel_options} if fm.kernel_options else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = fn(q.unsqueeze(0), k, v, block_mask=fm.block_mask, scale=scale, enable_gqa=q.shape[0] != hkv, **kw)
    return out[0].transpose(0, 1)
