"""The K/V pool's storage format (`EngineConfig.kv_cache_dtype`): how a key or value vector is
written into its slot and read back widened for attention.

Formats: "fp32", "bf16", "fp16" store the numbers as that torch dtype. "int8" and "fp8_e4m3"
store each (token, KV head) row of `head_dim` numbers as one-byte codes followed by their own
float32 scale, packed in a uint8 pool of shape [num_blocks, block_size, kv_heads, head_dim + 4]:

    int8:      s = max|x| / 127,  code = round(x / s) in [-127, 127],  x' = code * s
    fp8_e4m3:  s = max|x| / 448,  code = float8_e4m3fn(x / s),           x' = float(code) * s

(s = 0 for an all-zero row, which then reads back as zeros.) Error per number: int8
|x - x'| <= s / 2; fp8 |x - x'| <= |x| / 16 (3 mantissa bits) or, below fp8's normal range,
s / 1024; each plus fp32 rounding (tests/engine/test_kv_quant.py checks these bounds).

Why one scale per (token, KV head) and not per (block, KV head): a block is written token by
token, so a per-block scale must either be fixed by the first write (later tokens that exceed it
are clamped: unbounded error) or raised later (re-rounding the tokens already stored, whose
values then depend on what came after them). A per-token scale makes every stored byte a
function of that token's K/V alone: the same bytes whether the token came in a prefill chunk,
a decode step, a recompute after preemption or a verify pass, so prefix-cache hits, swap,
recompute and speculation see exactly what a plain run would have written. The price is 4 bytes
per row: head_dim 64 costs 68 bytes per (token, head) instead of 256 in fp32 (3.76x the
tokens per byte, vs 3.98x for a per-block scale at block size 16).

Bytes per token come from engine/kv_layout.kv_bytes_per_token(..., scale_bytes=kv_scale_bytes(dtype))
(memory_math.config_kv_bytes_per_token for a config), which counts these scales; `row_bytes` here is the
same layout seen from one row.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8")
QUANTIZED = ("int8", "fp8_e4m3")
SCALE_BYTES = 4  # one float32 scale per (token, KV head) row
_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
KERNEL_CODES = {"fp32": 0, "int8": 1, "fp8_e4m3": 2, "bf16": 3, "fp16": 4}  # csrc/paged_attention.c


def resolve(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The concrete format: "auto" is the model's dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    for name, dt in _FLOAT.items():
        if dt == model_dtype:
            return name
    raise ValueError(f"kv_cache_dtype='auto' needs a float32/bfloat16/float16 model, got {model_dtype}")


def format_of(pool_dtype: torch.dtype) -> str:
    """The float format of a plain pool tensor (quantized pools are uint8 and say their format in
    AttnMetadata.kv_format)."""
    for name, dt in _FLOAT.items():
        if dt == pool_dtype:
            return name
    raise ValueError(f"a pool of {pool_dtype} needs its kv_cache_dtype named (int8 or fp8_e4m3)")


def is_quantized(fmt: str) -> bool:
    return fmt in QUANTIZED


def storage_dtype(fmt: str) -> torch.dtype:
    return torch.uint8 if is_quantized(fmt) else _FLOAT[fmt]


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes one (token, KV head) row of K (or V) occupies in the pool."""
    if is_quantized(fmt):
        return head_dim + SCALE_BYTES
    return head_dim * torch.finfo(_FLOAT[fmt]).bits // 8


def check_head_dim(fmt: str, head_dim: int) -> None:
    if is_quantized(fmt) and head_dim % 4:
        raise ValueError(
            f"kv_cache_dtype={fmt!r} needs head_dim to be a multiple of 4 (its float32 scale "
            f"follows the codes in each row), got head_dim={head_dim}"
        )


def allocate(
    fmt: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, pin_memory: bool = False
) -> torch.Tensor:
    """A zeroed pool (K or V) for `fmt`: zeros read back as zeros in every format."""
    last = head_dim + SCALE_BYTES if is_quantized(fmt) else head_dim
    return torch.zeros(
        (num_blocks, block_size, kv_heads, last), dtype=storage_dtype(fmt), device=device, pin_memory=pin_memory
    )


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] uint8 rows: codes, then the row's float32 scale."""
    xf = x.float()
    qmax = _QMAX[fmt]
    s = xf.abs().amax(dim=-1, keepdim=True) / qmax  # [..., 1]
    y = xf / torch.where(s > 0, s, torch.ones_like(s))
    if fmt == "int8":
        codes = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    d = x.shape[-1]
    out = torch.empty((*x.shape[:-1], d + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    out[..., :d] = codes.view(torch.uint8)
    out[..., d:] = s.contiguous().view(torch.uint8)
    return out


def dequantize(rows: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] uint8 rows -> [..., D] values (computed in float32, returned as `dtype`)."""
    d = rows.shape[-1] - SCALE_BYTES
    s = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    codes = rows[..., :d]
    vals = codes.view(torch.int8).float() if fmt == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (vals * s).to(dtype)


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """K or V vectors [..., D] -> what the pool stores for them."""
    return quantize(x, fmt) if is_quantized(fmt) else x.to(_FLOAT[fmt])


def widen(stored: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Pool contents (any leading shape) -> values [..., D] in `dtype` for attention."""
    return dequantize(stored, fmt, dtype) if is_quantized(fmt) else stored.to(dtype)


def write(pool: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """pool[slot] = encode(x[i]) for each new token i (x: [T, kv_heads, D])."""
    pool.view(-1, pool.shape[2], pool.shape[3]).index_copy_(0, slot_mapping, encode(x, fmt))
