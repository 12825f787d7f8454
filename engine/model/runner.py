"""Batch preparation (input ids, positions, slot mapping, block tables) and the forward pass.

Owns the K/V pool tensors (per layer, [num_blocks, block_size, num_kv_heads, head_dim], in the
format of `kv_cache_dtype`: engine/model/kv_quant.py) and the CPU swap space. The HF model runs with
attention implementation "kvscope" (engine/model/attention.py) only inside our forward; other callers
of the same model object get transformers' SDPA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model import attention, cpu_kernels, fused_decode, kv_quant, linear, paged_flex
from engine.model import device as device_policy
from engine.model.attention import AttnMetadata, PrefillItem, build_decode_mask, forward_context
from engine.model.kv_layout import cdiv, kv_geometry

KERNEL_MAX_QUERY_TOKENS = 32  # up to this many new tokens after earlier context go to the decode kernel
# model types whose HF model forward is exactly embed -> rotary -> decoder layers -> norm, so the
# runner may call those pieces itself (skipping HF's mask building); others run model(...) whole
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass(slots=True)
class BatchRow:
    """One request's slice of the flattened batch."""

    request_id: str
    start: int  # first position fed
    tokens: list[int]  # token ids fed (num_new)
    block_table: list[int]
    logits_from: int  # index within `tokens` of the first row whose logits are needed (-1: none)


def token_slots(block_table, block_size: int, start: int, end: int) -> list[int]:
    """The flat pool slot (block id * block_size + offset) of each position in [start, end) of a
    request holding `block_table`: the one home of the token -> pool slot rule (the forward
    writes K/V there; rollbacks and drafters clear them there)."""
    bs = block_size
    return [block_table[p // bs] * bs + p % bs for p in range(start, end)]


def slot_mapping(rows: list[BatchRow], block_size: int) -> list[int]:
    """token_slots of every token fed, in batch order: where each token's K/V is written, for
    both forward paths (the C path gets this list too)."""
    return [s for r in rows for s in token_slots(r.block_table, block_size, r.start, r.start + len(r.tokens))]


@dataclass(slots=True)
class FlatBatch:
    """A batch flattened into one token sequence: what both forward paths (torch and C) feed."""

    ids: list[int]  # every token fed, in row order
    positions: list[int]
    offsets: list[int]  # each row's first index in `ids`
    logit_rows: list[int]  # indices in `ids` whose logits are returned, in order
    slots: list[int]  # slot_mapping: where each token's K/V is written


def flatten(rows: list[BatchRow], block_size: int) -> FlatBatch:
    """The one batch flattening (the torch path's metadata and the C path's arrays read it)."""
    ids, pos, offsets, logit_rows = [], [], [], []
    t = 0
    for r in rows:
        n = len(r.tokens)
        offsets.append(t)
        ids.extend(r.tokens)
        pos.extend(range(r.start, r.start + n))
        if r.logits_from >= 0:
            logit_rows.extend(range(t + r.logits_from, t + n))
        t += n
    return FlatBatch(ids, pos, offsets, logit_rows, slot_mapping(rows, block_size))


def query_tables(row: BatchRow, block_size: int) -> list[list[int]]:
    """For each token of `row`, the block table of its context up to itself: the token as one
    query row over its sequence (decode, verification and, on the C path, prefill chunks)."""
    return [row.block_table[: cdiv(row.start + j + 1, block_size)] for j in range(len(row.tokens))]


def padded_tables(tables: list[list[int]], num_blocks: int) -> list[list[int]]:
    """Block tables padded to one width with their last id, once every id is checked to lie in
    the pool of `num_blocks` (the kernels read them unchecked)."""
    if max(max(x) for x in tables) >= num_blocks or min(min(x) for x in tables) < 0:
        raise RuntimeError(f"a block table holds a block id outside the pool of {num_blocks}")
    mb = max(len(x) for x in tables)
    return [x + [x[-1]] * (mb - len(x)) for x in tables]


def weight_pack(model, weight_format: str):
    """engine/model/linear.py's pack for the requested weight format ("auto": GGUF blocks where the
    model came from a GGUF and the kernel runs, else fp32)."""
    from engine.model.models import gguf_source

    src = gguf_source(model)
    if weight_format in ("auto", "gguf") and src is not None and model.dtype == torch.float32:
        pack = linear.pack_model(model, weight_format="gguf", gguf_path=src)
        if pack is not None and any(k != "fp32" for k in pack.formats):
            return pack
    if weight_format == "gguf":
        why = (
            "the model was not loaded from a GGUF file (only model='default' on CPU in float32 is)"
            if src is None
            else f"the quantized CPU kernel is not available here ({cpu_kernels.status()})"
        )
        raise ValueError(f"weight_format='gguf': {why}; use weight_format='fp32' or 'auto'")
    for fmt in ("bf16", "fp16"):  # fp32 weights that are exactly 16-bit values: read at 16 bits
        if weight_format == fmt or (
            weight_format == "auto"
            and src is None
            and model.dtype == torch.float32
            and cpu_kernels.load() is not None
            and linear.half_exact(model, fmt)
        ):
            pack = linear.pack_model(model, weight_format=fmt)
            if pack is not None and any(k != "fp32" for k in pack.formats):
                return pack
            if weight_format == fmt:
                raise ValueError(
                    f"weight_format={fmt!r}: no Linear weight of this model is exactly a {fmt} value "
                    f"in whole blocks of 32 columns, or the CPU kernel is not available "
                    f"({cpu_kernels.status()}); use weight_format='fp32' or 'auto'"
                )
    return linear.pack_model(model)


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_swap_blocks: int = 0,
        num_layers: int | None = None,
        linear_backend: str = "auto",
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        weight_format: str = "auto",
        decode_backend: str = "auto",
    ):
        attention.register()
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(model.config)
        if num_layers is not None:
            self.num_layers = num_layers
        self.kv_format = kv_quant.resolve(kv_cache_dtype, dtype)
        kv_quant.check_head_dim(self.kv_format, self.head_dim)
        geo = (block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                kv_quant.allocate(self.kv_format, num_blocks, *geo, device),
                kv_quant.allocate(self.kv_format, num_blocks, *geo, device),
            )
            for _ in range(self.num_layers)
        ]
        self.num_swap_blocks = num_swap_blocks
        self.swap_space = None
        if num_swap_blocks:
            pin = device.type == "cuda"
            self.swap_space = [
                (
                    kv_quant.allocate(self.kv_format, num_swap_blocks, *geo, "cpu", pin),
                    kv_quant.allocate(self.kv_format, num_swap_blocks, *geo, "cpu", pin),
                )
                for _ in range(self.num_layers)
            ]
        inner = getattr(model, "model", None)
        self.fast = (
            getattr(model.config, "model_type", None) in FAST_MODEL_TYPES
            and hasattr(model, "lm_head")
            and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
        )
        self.last_forward_s = 0.0
        # CPU-only speed paths (packed Linears, the C decode kernel) never run on CUDA
        self.linear_pack = None
        if linear_backend == "auto" and device.type == "cpu":
            self.linear_pack = weight_pack(model, weight_format)
        elif weight_format == "gguf":
            raise ValueError("weight_format='gguf' needs linear_backend='auto' on CPU")
        self.decode_kernel = None
        self.attention_backend = "torch"
        want = attention_backend
        if want == "auto":
            want = device_policy.auto_attention_backend(device.type, dtype == torch.float32, True)
        if want == "flex":
            why = paged_flex.unavailable_reason(device, block_size)
            if why and attention_backend == "flex":
                raise ValueError(why)
            self.attention_backend = "torch" if why else "flex"
        elif (
            want == "cpu_kernel"
            and device.type == "cpu"
            and dtype == torch.float32
            and self.kv_format in kv_quant.KERNEL_CODES  # int4 / int2 pools: the torch path widens them
        ):
            if cpu_kernels.supports(model.config.num_attention_heads, self.num_kv_heads, self.head_dim):
                self.decode_kernel = cpu_kernels.load()
                if self.decode_kernel is not None:
                    self.attention_backend = "cpu_kernel"
        # the C whole-stack path (engine/model/fused_decode.py) where the model and pool allow it
        if decode_backend not in fused_decode.DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {fused_decode.DECODE_BACKENDS}, got {decode_backend!r}")
        self.fused = None
        self.decode_backend_reason = "decode_backend='transformers'"
        if decode_backend != "transformers":
            why = fused_decode.unsupported_reason(self)
            if why is None:
                self.fused = fused_decode.FusedStack(self)
                self.decode_backend_reason = ""
            elif decode_backend == "c":
                raise ValueError(f"decode_backend='c': {why}; use decode_backend='auto' or 'transformers'")
            else:
                self.decode_backend_reason = why

    @property
    def decode_backend(self) -> str:
        """ "c": every layer in engine/model/csrc/layer.c (one call a step); "transformers": the HF layer code."""
        return "c" if self.fused is not None else "transformers"

    @property
    def weight_format(self) -> str:
        """ "gguf" / "fp32": what the packed Linears compute from; "torch": transformers' F.linear."""
        return self.linear_pack.weight_format if self.linear_pack is not None else "torch"

    @property
    def weight_bytes_per_step(self) -> int:
        """Weight bytes one forward pass reads: every Linear as the engine holds it (GGUF blocks
        or fp32), plus the norms; the embedding rows looked up are not counted (one row a token)."""
        lin = self.linear_pack.bytes if self.linear_pack is not None else 0
        rest = 0
        for m in self.model.modules():
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or isinstance(m, torch.nn.Embedding):
                continue
            if isinstance(m, torch.nn.Linear):
                if self.linear_pack is None or m not in self.linear_pack.members:
                    rest += w.numel() * w.element_size()
            elif w.dim() == 1:
                rest += w.numel() * w.element_size()
        return lin + rest

    # ------------------------------------------------------------------ block copies
    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.inference_mode()
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_space):
            for gpu, slot in pairs:
                sk[slot].copy_(k[gpu])
                sv[slot].copy_(v[gpu])

    @torch.inference_mode()
    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_space):
            for slot, gpu in pairs:
                k[gpu].copy_(sk[slot])
                v[gpu].copy_(sv[slot])

    @torch.inference_mode()
    def clear_slots(self, slots: list[int]) -> None:
        """Zero the K/V of the given flat slots (rolled-back speculative tokens)."""
        if not slots:
            return
        idx = torch.tensor(slots, device=self.device)
        for k, v in self.kv_caches:
            k.view(-1, *k.shape[2:]).index_fill_(0, idx, 0)
            v.view(-1, *v.shape[2:]).index_fill_(0, idx, 0)

    def read_slots(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V held at these flat slots, widened to float32: [len(slots), kv_heads, head_dim]."""
        idx = torch.tensor(slots, device=self.device)
        k, v = self.kv_caches[layer]
        return (
            kv_quant.widen(k.view(-1, *k.shape[2:]).index_select(0, idx), self.kv_format, torch.float32),
            kv_quant.widen(v.view(-1, *v.shape[2:]).index_select(0, idx), self.kv_format, torch.float32),
        )

    # ------------------------------------------------------------------ forward
    def build_metadata(self, rows: list[BatchRow]):
        bs = self.block_size
        flat = flatten(rows, bs)
        dec_idx, dec_tables, dec_lens, prefills, flex_rows = [], [], [], [], []
        flex = self.attention_backend == "flex"
        max_ctx = 0
        for r, t in zip(rows, flat.offsets):
            n = len(r.tokens)
            table = r.block_table
            ctx = r.start + n
            max_ctx = max(max_ctx, ctx)
            if flex:
                flex_rows.append((t, n, r.start, table[: cdiv(ctx, bs)]))
            elif r.start > 0 and (n == 1 or (n <= KERNEL_MAX_QUERY_TOKENS and self.decode_kernel is not None)):
                # decode rows: one token after earlier context, or (with the kernel) a few of them
                # (speculative verification, a short chunk), each a row over the context up to
                # itself, which is the causal mask; their K/V are in the pool before attention reads it
                dec_idx.extend(range(t, t + n))
                dec_tables.extend(query_tables(r, bs))
                dec_lens.extend(range(r.start + 1, ctx + 1))
            else:
                prefills.append(PrefillItem(t, n, ctx, torch.tensor(table[: cdiv(ctx, bs)], device=self.device)))
        dev = self.device
        meta = AttnMetadata(
            self.kv_caches,
            torch.tensor(flat.slots, device=dev),
            bs,
            prefills=prefills,
            max_ctx=max_ctx,
            kv_format=self.kv_format,
        )
        if flex_rows:
            meta.flex = paged_flex.build(flex_rows, self.kv_caches[0][0].shape[0], bs, dev)
        if dec_idx:
            padded = padded_tables(dec_tables, self.kv_caches[0][0].shape[0])
            mb = len(padded[0])
            meta.decode_idx = torch.tensor(dec_idx, device=dev)
            if self.decode_kernel is not None:
                meta.decode_kernel = self.decode_kernel
                meta.decode_rows32 = torch.tensor(dec_idx, dtype=torch.int32)
                meta.decode_lens32 = torch.tensor(dec_lens, dtype=torch.int32)
                meta.decode_tables32 = torch.tensor(padded, dtype=torch.int32)
                meta.decode_max_ctx = max(dec_lens)
            else:
                meta.decode_blocks = torch.tensor(padded, device=dev)
                meta.decode_mask = build_decode_mask(dec_lens, mb, bs, dev)
                meta.decode_len1 = dec_lens[0]
        return (
            torch.tensor(flat.ids, device=dev),
            torch.tensor(flat.positions, device=dev),
            meta,
            torch.tensor(flat.logit_rows, device=dev, dtype=torch.long),
        )

    @torch.inference_mode()
    def forward(self, rows: list[BatchRow], num_layers: int | None = None) -> torch.Tensor:
        """Runs the flattened batch; returns fp32 logits for the requested rows, in order."""
        t0 = time.perf_counter()
        if self.fused is not None:
            with linear.packed_linears(self.linear_pack):
                bs = self.block_size
                tables = padded_tables([x for r in rows for x in query_tables(r, bs)], self.kv_caches[0][0].shape[0])
                logits = self.fused.run(flatten(rows, bs), tables, num_layers)
            self.last_forward_s = time.perf_counter() - t0
            return logits
        input_ids, positions, meta, logit_rows = self.build_metadata(rows)
        logits = self.run_model(input_ids, positions, meta, logit_rows, num_layers)
        self.last_forward_s = time.perf_counter() - t0
        return logits

    def run_model(self, input_ids, positions, meta, logit_rows, num_layers=None) -> torch.Tensor:
        model = self.model
        cfg = model.config
        prev = cfg._attn_implementation
        cfg._attn_implementation = attention.ATTN_NAME
        try:
            with forward_context(meta), linear.packed_linears(self.linear_pack):
                if self.fast:
                    inner = model.model
                    h = inner.embed_tokens(input_ids.unsqueeze(0))
                    pos = positions.unsqueeze(0)
                    pe = inner.rotary_emb(h, position_ids=pos)
                    layers = inner.layers[: (num_layers or self.num_layers)]
                    for layer in layers:
                        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                        if isinstance(h, tuple):
                            h = h[0]
                    h = inner.norm(h[0].index_select(0, logit_rows))
                    logits = model.lm_head(h)
                else:
                    outp = model(
                        input_ids=input_ids.unsqueeze(0),
                        position_ids=positions.unsqueeze(0),
                        use_cache=False,
                        logits_to_keep=logit_rows,
                    )
                    logits = outp.logits[0]
        finally:
            cfg._attn_implementation = prev
        return logits.float()
