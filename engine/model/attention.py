"""Paged attention, registered with transformers' AttentionInterface as "kvscope".

The HF model's own embedding, norms, rotary, projections and MLP run unchanged; only attention
is ours: it writes each new token's key/value into the block pool (slot mapping) and reads every
key/value it attends to back from the pool through the block tables. The pool tensors are the
cache; nothing else holds K/V. What a slot holds is `kv_cache_dtype`'s format (engine/model/kv_quant.py:
the model's dtype, bf16/fp16, or int8/fp8 codes with a per-row scale): writes encode, reads widen
to the query's dtype, so every path (including a chunk's attention to its own new tokens when
the pool is not in the model's dtype) sees the values the pool holds.

Batches are flattened (ragged): the model sees one row of T tokens from many requests.
- decode group (one query token per request): on CPU in fp32, engine/model/csrc/paged_attention.c
  reads every key and value in place from its block (engine/model/cpu_kernels.py builds it); elsewhere,
  or where it cannot be built, one batched SDPA over block-gathered K/V with a length mask. Where
  the kernel runs, a request feeding a few tokens after earlier context (speculative
  verification) joins this group too, one row per token, each row's context ending at itself;
- every other request (prefill chunks, and verification on the torch path): SDPA per request
  with a causal mask aligned to its position in the sequence; a chunk with no earlier context
  attends to its own new keys/values directly (the same values the pool now holds), without
  reading them back.
With EngineConfig.attention_backend="flex" (engine/model/paged_flex.py) all of the above is replaced
by one FlexAttention call per layer over the whole flattened batch, reading K/V in place through
the block tables: compiled on CUDA, eager on CPU (where the test suite checks it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model import cpu_kernels, kv_quant, paged_flex

ATTN_NAME = "kvscope"
_ctx = threading.local()


@dataclass(slots=True)
class PrefillItem:
    q_start: int  # offset of this request's first query token in the flattened batch
    q_len: int
    ctx_len: int  # tokens of context after this chunk (positions 0..ctx_len-1)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] physical blocks


@dataclass(slots=True)
class AttnMetadata:
    kv_caches: list  # per layer (k_pool, v_pool), each [num_blocks, block_size, kv_heads, head_dim]
    # (int8/fp8: uint8 [.., head_dim + 4], engine/model/kv_quant.py)
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) for each new token
    block_size: int
    decode_idx: torch.Tensor | None = None  # [Bd] positions in the batch of single-token queries
    decode_blocks: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] bool (True = attend)
    decode_len1: int = 0  # context length when the decode group has one request
    decode_kernel: object = None  # engine/cpu_kernels library: decode read in place
    decode_rows32: torch.Tensor | None = None  # [Bd] int32 batch rows of the decode queries
    decode_lens32: torch.Tensor | None = None  # [Bd] int32 context lengths
    decode_tables32: torch.Tensor | None = None  # [Bd, max_blocks] int32 block tables (padded)
    decode_max_ctx: int = 0
    prefills: list[PrefillItem] = field(default_factory=list)
    layer_offset: int = 0  # pools index = module.layer_idx + offset (draft models share a pool list)
    flex: object = None  # engine/paged_flex.FlexMeta: every row through one FlexAttention call
    max_ctx: int = 0  # the longest context any row of this batch attends to
    kv_format: str = ""  # the pool's kv_cache_dtype (engine/model/kv_quant.py); "" = the pool tensor's dtype


class forward_context:
    """Installs AttnMetadata for the forward passes inside the `with` block (this thread only)."""

    def __init__(self, meta: AttnMetadata):
        self.meta = meta

    def __enter__(self):
        self.prev = getattr(_ctx, "meta", None)
        _ctx.meta = self.meta
        return self.meta

    def __exit__(self, *exc):
        _ctx.meta = self.prev


def current_metadata() -> AttnMetadata | None:
    return getattr(_ctx, "meta", None)


def _gather(
    pool: torch.Tensor, block_ids: torch.Tensor, length: int | None, fmt: str, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks -> [kv_heads, tokens, head_dim] in `dtype` (whole blocks copied and widened, then trimmed)."""
    x = kv_quant.widen(pool.index_select(0, block_ids), fmt, dtype)  # [nb, bs, h, d]
    x = x.reshape(-1, x.shape[-2], x.shape[-1])  # [nb*bs, h, d]
    if length is not None:
        x = x[:length]
    return x.transpose(0, 1)  # [h, tokens, d]


def refuse_unsupported(kwargs: dict, max_ctx: int) -> None:
    """The paged paths attend to every earlier token with plain softmax(QK^T)V: a layer asking
    for more (a sliding window shorter than the context, logit softcapping, sinks) is refused,
    never run wrong. engine/model/families.py refuses such configs before an engine starts; this is the
    last line for a model that slips through."""
    window = kwargs.get("sliding_window")
    if window is not None and window < max_ctx:
        raise ValueError(
            f"sliding-window attention (window {window}, context {max_ctx}) is not supported by "
            "kvscope's paged attention"
        )
    if kwargs.get("softcap"):
        raise ValueError(
            f"attention logit softcapping (softcap={kwargs['softcap']}) is not supported by kvscope's paged attention"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks (s_aux) are not supported by kvscope's paged attention")


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta = current_metadata()
    if meta is None:
        # Not inside an engine forward (e.g. someone calls model.generate on a shared model):
        # behave exactly like transformers' SDPA path.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    refuse_unsupported(kwargs, meta.max_ctx)
    layer = module.layer_idx + meta.layer_offset
    k_pool, v_pool = meta.kv_caches[layer]
    # query: [1, H, T, D]; key/value: [1, Hkv, T, D]
    hkv, d = key.shape[1], key.shape[3]
    fmt = meta.kv_format or kv_quant.format_of(k_pool.dtype)
    kv_quant.write(k_pool, meta.slot_mapping, key[0].transpose(0, 1), fmt)  # [T, Hkv, D] at their slots
    kv_quant.write(v_pool, meta.slot_mapping, value[0].transpose(0, 1), fmt)

    q = query[0]  # [H, T, D]
    if meta.flex is not None:
        return paged_flex.attend(q, k_pool, v_pool, meta.flex, scaling).unsqueeze(0), None
    T = q.shape[1]
    out = torch.empty((T, q.shape[0], q.shape[2]), dtype=query.dtype, device=query.device)  # [T, H, D]
    gqa = q.shape[0] != hkv

    if meta.decode_kernel is not None:
        # decode rows straight from the blocks (engine/model/csrc/paged_attention.c), no gather, each
        # key/value widened to fp32 as it is read; the runner only sets the kernel for fp32 models
        if q.dtype != torch.float32:
            raise RuntimeError(f"the CPU decode kernel needs float32 queries, got {q.dtype}")
        qt = q.transpose(0, 1)
        if not qt.is_contiguous():
            qt = qt.contiguous()
        cpu_kernels.paged_decode_attention(
            meta.decode_kernel,
            out,
            qt,
            k_pool,
            v_pool,
            meta.decode_rows32,
            meta.decode_lens32,
            meta.decode_tables32,
            scaling if scaling is not None else d**-0.5,
            meta.decode_max_ctx,
            kv_format=kv_quant.KERNEL_CODES[fmt],
        )
    elif meta.decode_idx is not None and meta.decode_idx.numel():
        bd = meta.decode_idx.numel()
        kd = k_pool.index_select(0, meta.decode_blocks.reshape(-1))  # [Bd*nb, bs, h, d]
        vd = v_pool.index_select(0, meta.decode_blocks.reshape(-1))
        kd = kv_quant.widen(kd, fmt, q.dtype).view(bd, -1, hkv, d).transpose(1, 2)  # [Bd, h, L, d]
        vd = kv_quant.widen(vd, fmt, q.dtype).view(bd, -1, hkv, d).transpose(1, 2)
        qd = q.index_select(1, meta.decode_idx).transpose(0, 1).unsqueeze(2)  # [Bd, H, 1, D]
        if bd == 1:  # single request: trim to its length, no mask (same call as transformers' decode)
            n = meta.decode_len1
            od = F.scaled_dot_product_attention(qd, kd[:, :, :n], vd[:, :, :n], scale=scaling, enable_gqa=gqa)
        else:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=gqa)
        out.index_copy_(0, meta.decode_idx, od.squeeze(2))

    direct = key.dtype == k_pool.dtype == q.dtype  # the pool holds exactly these values
    for p in meta.prefills:
        qp = q[:, p.q_start : p.q_start + p.q_len].unsqueeze(0)  # [1, H, q, D]
        if p.q_len == p.ctx_len and direct:  # no earlier context: attend to the new K/V as they are
            kp = key[:, :, p.q_start : p.q_start + p.q_len]
            vp = value[:, :, p.q_start : p.q_start + p.q_len]
        else:
            kp = _gather(k_pool, p.block_ids, p.ctx_len, fmt, q.dtype).unsqueeze(0)  # [1, h, ctx, d]
            vp = _gather(v_pool, p.block_ids, p.ctx_len, fmt, q.dtype).unsqueeze(0)
        if p.q_len == p.ctx_len:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=p.q_len > 1, scale=scaling, enable_gqa=gqa)
        else:
            start = p.ctx_len - p.q_len
            qi = torch.arange(p.q_len, device=q.device)[:, None] + start
            kj = torch.arange(p.ctx_len, device=q.device)[None, :]
            mask = (kj <= qi)[None, None]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[p.q_start : p.q_start + p.q_len] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def build_decode_mask(ctx_lens: list[int], max_blocks: int, block_size: int, device) -> torch.Tensor | None:
    """[Bd, 1, 1, L] bool mask (True = attend); None for a single request (it is trimmed instead)."""
    L = max_blocks * block_size
    if len(ctx_lens) == 1:
        return None
    lens = torch.tensor(ctx_lens, device=device)
    return (torch.arange(L, device=device)[None, :] < lens[:, None])[:, None, None, :]
