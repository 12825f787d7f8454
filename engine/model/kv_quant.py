"""The K/V pool's storage format (`EngineConfig.kv_cache_dtype`): how a key or value vector is
written into its slot and read back widened for attention.

Formats: "fp32", "bf16", "fp16" store the numbers as that torch dtype. "int8" and "fp8_e4m3"
store each (token, KV head) row of `head_dim` numbers as one-byte codes followed by their own
float32 scale, packed in a uint8 pool of shape [num_blocks, block_size, kv_heads, head_dim + 4]:

    int8:      s = max|x| / 127,  code = round(x / s) in [-127, 127],  x' = code * s
    fp8_e4m3:  s = max|x| / 448,  code = float8_e4m3fn(x / s),           x' = float(code) * s

"int4" and "int2" are the same symmetric integer scheme with fewer levels, their codes packed
several to a byte (low bits first), and one float32 scale per group of 32 numbers of the row
(kv_layout.KV_SCALE_GROUP; the last group shorter, a row of 16 has one), the scales after the
codes; the pool is [num_blocks, block_size, kv_heads, head_dim * bits / 8 + 4 * ceil(head_dim / 32)]:

    int4:      s = max|x| / 7 over the group,  code = round(x / s) in [-7, 7], stored as code + 8
    int2:      s = max|x| / 1 over the group,  code = round(x / s) in [-1, 1], stored as code + 2

(s = 0 for an all-zero row or group, which then reads back as zeros.) Error per number: int8,
int4, int2 |x - x'| <= s / 2 (so max|x| / 14 of its group for int4, and max|x| / 2 for int2,
which keeps only the sign of the numbers above half their group's largest, and zero); fp8
|x - x'| <= |x| / 16 (3 mantissa bits) or, below fp8's normal range, s / 1024; each plus fp32
rounding (tests/engine/test_kv_quant.py and test_kv_quant_low_bits.py check these bounds).

Why a scale per 32 numbers for int4 / int2 and not one per row as the 8-bit formats keep: with 15
levels, one scale per row lets the row's largest number (keys have a few large channels) squash
the rest to a code or two. Measured on the default model (head_dim 64, K/V fake-quantized in the
attention, teacher-forced: scripts/kv_scale_groups.py, numbers in docs/BENCHMARKS.md): one scale per row, mean KL
to fp32 0.70 nats on short chat prompts and both needles of a 1k-token context lost; one per 32
numbers, KL 0.11 and both needles kept; one per 16, KL 0.09. The group of 32 costs 4 more bytes
per row of 64 (40 instead of 36: 6.4x fp32's tokens in the same bytes instead of 7.1x). For
int2 no group size helped (KL 3.7 per row, 3.4 per 16): it stays as a deliberately crude format.

Why one scale per (token, KV head) and not per (block, KV head): a block is written token by
token, so a per-block scale must either be fixed by the first write (later tokens that exceed it
are clamped: unbounded error) or raised later (re-rounding the tokens already stored, whose
values then depend on what came after them). A per-token scale makes every stored byte a
function of that token's K/V alone: the same bytes whether the token came in a prefill chunk,
a decode step, a recompute after preemption or a verify pass, so prefix-cache hits, swap,
recompute and speculation see exactly what a plain run would have written. The price is 4 bytes
per row: head_dim 64 costs 68 bytes per (token, head) instead of 256 in fp32 (3.76x the
tokens per byte, vs 3.98x for a per-block scale at block size 16).

Bytes per token come from engine/kv_layout.kv_bytes_per_token(..., scale_bytes=kv_scale_bytes(dtype),
scale_group=kv_scale_group(dtype)) (memory_math.config_kv_bytes_per_token for a config), which counts
these scales; `row_bytes` here is kv_layout's row formula (dtype_row_bytes), the one the pool is shaped by.
"""

from __future__ import annotations

import functools
import math

import torch

from engine.config import KV_CACHE_DTYPES, QUANTIZED_KV_CACHE_DTYPES
from engine.model import huge_pages, kv_layout

QUANTIZED = QUANTIZED_KV_CACHE_DTYPES
PACKED_BITS = {"int4": 4, "int2": 2}  # codes packed 8 // bits to a byte, low bits first
SCALE_BYTES = kv_layout.KV_SCALE_BYTES  # one float32 scale per row (per 32 numbers for int4 / int2)
_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": 7.0, "int2": 1.0}
# formats csrc/paged_attention.c reads in place; a pool in any other format (int4, int2) is read by
# the torch path (the runner loads no decode kernel for it)
KERNEL_CODES = {"fp32": 0, "int8": 1, "fp8_e4m3": 2, "bf16": 3, "fp16": 4}


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
    raise ValueError(f"a pool of {pool_dtype} needs its kv_cache_dtype named ({', '.join(QUANTIZED)})")


def is_quantized(fmt: str) -> bool:
    return fmt in QUANTIZED


def storage_dtype(fmt: str) -> torch.dtype:
    return torch.uint8 if is_quantized(fmt) else _FLOAT[fmt]


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes one (token, KV head) row of K (or V) occupies in the pool (kv_layout's formula)."""
    return kv_layout.dtype_row_bytes(fmt, head_dim)


@functools.lru_cache(maxsize=64)
def head_dim_of(fmt: str, nbytes: int) -> int:
    """The head_dim whose rows take `nbytes` in a quantized format (row_bytes grows with head_dim)."""
    for d in range(4, 8 * nbytes + 1, 4):
        if row_bytes(fmt, d) == nbytes:
            return d
    raise ValueError(f"no {fmt} row is {nbytes} bytes long")


def check_head_dim(fmt: str, head_dim: int) -> None:
    if is_quantized(fmt) and head_dim % 4:
        raise ValueError(
            f"kv_cache_dtype={fmt!r} needs head_dim to be a multiple of 4 (its codes fill whole "
            f"bytes and its float32 scale follows them in each row), got head_dim={head_dim}"
        )


def allocate(
    fmt: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, pin_memory: bool = False
) -> torch.Tensor:
    """A zeroed pool (K or V) for `fmt`: zeros read back as zeros in every format."""
    last = row_bytes(fmt, head_dim) if is_quantized(fmt) else head_dim
    shape = (num_blocks, block_size, kv_heads, last)
    if torch.device(device).type == "cpu" and not pin_memory:  # decode attention streams it: huge pages
        # written now, so that every page is faulted in here and not in the first steps that reach it
        return huge_pages.empty(math.prod(shape), storage_dtype(fmt)).view(shape).zero_()
    return torch.zeros(shape, dtype=storage_dtype(fmt), device=device, pin_memory=pin_memory)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] unsigned codes < 2**bits -> [..., D * bits / 8] uint8, 8 // bits codes per byte,
    the first code in the lowest bits."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack's inverse: [..., B] uint8 -> [..., B * 8 / bits] codes (uint8)."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _group_scales(xf: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """[..., D] -> (scales [..., G], group size): one per kv_layout.kv_scale_group(fmt) numbers
    (the last group shorter), or one per row."""
    d = xf.shape[-1]
    g = kv_layout.kv_scale_group(fmt) or d
    n = kv_layout.row_scale_count(d, g)
    pad = n * g - d
    a = xf.abs()
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    return a.reshape(*xf.shape[:-1], n, g).amax(-1) / _QMAX[fmt], g


def _per_number(scales: torch.Tensor, g: int, d: int) -> torch.Tensor:
    """[..., G] -> [..., D]: each number's scale."""
    return scales.repeat_interleave(g, dim=-1)[..., :d]


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """[..., D] float -> [..., row_bytes] uint8 rows: codes, then the row's float32 scale(s)."""
    xf = x.float()
    qmax = _QMAX[fmt]
    s, g = _group_scales(xf, fmt)  # [..., G]
    d = x.shape[-1]
    sn = _per_number(s, g, d)
    y = xf / torch.where(sn > 0, sn, torch.ones_like(sn))
    if fmt == "int8":
        codes = y.round().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
    elif fmt in PACKED_BITS:
        offset = qmax + 1  # int4: codes -7..7 stored as 1..15; int2: -1..1 as 1..3
        codes = pack((y.round().clamp_(-qmax, qmax) + offset).to(torch.uint8), PACKED_BITS[fmt])
    else:
        codes = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    n = codes.shape[-1]
    out = torch.empty((*x.shape[:-1], n + SCALE_BYTES * s.shape[-1]), dtype=torch.uint8, device=x.device)
    out[..., :n] = codes
    out[..., n:] = s.contiguous().view(torch.uint8)
    return out


def dequantize(rows: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., row_bytes] uint8 rows -> [..., D] values (computed in float32, returned as `dtype`)."""
    d = head_dim_of(fmt, rows.shape[-1])
    g = kv_layout.kv_scale_group(fmt) or d
    n = rows.shape[-1] - SCALE_BYTES * kv_layout.row_scale_count(d, g)
    s = rows[..., n:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [..., G]
    codes = rows[..., :n]
    if fmt == "int8":
        vals = codes.view(torch.int8).float()
    elif fmt in PACKED_BITS:
        vals = unpack(codes, PACKED_BITS[fmt]).float() - (_QMAX[fmt] + 1)
    else:
        vals = codes.view(torch.float8_e4m3fn).float()
    return (vals * _per_number(s, g, d)).to(dtype)


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """K or V vectors [..., D] -> what the pool stores for them."""
    return quantize(x, fmt) if is_quantized(fmt) else x.to(_FLOAT[fmt])


def widen(stored: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Pool contents (any leading shape) -> values [..., D] in `dtype` for attention."""
    return dequantize(stored, fmt, dtype) if is_quantized(fmt) else stored.to(dtype)


def write(pool: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """pool[slot] = encode(x[i]) for each new token i (x: [T, kv_heads, D])."""
    pool.view(-1, pool.shape[2], pool.shape[3]).index_copy_(0, slot_mapping, encode(x, fmt))
