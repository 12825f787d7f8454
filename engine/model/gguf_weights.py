"""The quantized blocks behind a model's Linear layers, read from the GGUF it was loaded from.

transformers' GGUF loader de-quantizes every tensor to fp32 (gguf-py's `dequantize`), undoing
llama.cpp's q/k row interleave on the way (`_reverse_permute_weights`); the engine's quantized
Linear reads the file's own blocks instead. This module finds, for each HF Linear of a Llama
layout, its GGUF tensor, its ggml type and the row order that maps it onto the HF weight.
Whether a tensor's blocks de-quantize to exactly the HF weight is checked by engine/model/linear.py
when it packs them (bitwise), so a wrong mapping falls back to the fp32 path instead of
computing with other weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


@dataclass(frozen=True)
class QuantTensor:
    name: str  # the GGUF tensor name
    type_name: str  # ggml type, e.g. "Q4_1"
    type_id: int
    blocks: np.ndarray  # uint8 [rows, bytes per row], a view of the file's memory map
    rows: np.ndarray  # int32 [N]: HF output n is GGUF row rows[n]
    shape: tuple[int, int]  # (N, K) as the HF weight


def gguf_name(module_name: str, tied: bool) -> str | None:
    """The GGUF tensor holding an HF Llama module's weight (None: not one we map)."""
    if module_name == "lm_head" or module_name.endswith(".lm_head"):
        return "token_embd.weight" if tied else "output.weight"
    m = _LAYER.search(module_name)
    if m and m.group(3) in _NAMES:
        return f"blk.{m.group(1)}.{_NAMES[m.group(3)]}.weight"
    return None


def row_order(name: str, n: int, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """HF row -> GGUF row: the inverse of llama.cpp's q/k permutation, as transformers applies it
    (reshape (heads, dim, 2) and swap the last two axes), applied to row indices."""
    idx = np.arange(n, dtype=np.int32)
    heads = num_heads if ".attn_q." in name else num_kv_heads if ".attn_k." in name else 0
    if heads:
        idx = idx.reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)
    return np.ascontiguousarray(idx, dtype=np.int32)


def read_quant_tensors(path: str, model, supported: dict[str, int]) -> dict[str, QuantTensor]:
    """module name -> QuantTensor for every Linear of `model` whose GGUF tensor has a type in
    `supported` (name -> ggml type id) and the HF weight's shape."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or "output.weight" not in tensors
    out = {}
    for mod_name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2 or not hasattr(mod, "in_features"):
            continue
        gname = gguf_name(mod_name, tied)
        t = tensors.get(gname) if gname else None
        if t is None or t.tensor_type.name not in supported:
            continue
        n, k = w.shape
        if tuple(int(x) for x in t.shape) != (k, n):  # GGUF lists dims innermost first
            continue
        blocks = np.asarray(t.data).reshape(n, -1)
        out[mod_name] = QuantTensor(
            gname,
            t.tensor_type.name,
            supported[t.tensor_type.name],
            blocks,
            row_order(gname, n, heads, kv_heads),
            (n, k),
        )
    return out
