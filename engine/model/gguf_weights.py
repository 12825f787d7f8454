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

import functools
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


@functools.lru_cache(maxsize=1)
def _value_types() -> tuple[dict[int, int], int, int]:
    """(GGUF scalar value type -> its size in bytes, the string type, the array type), from gguf-py's
    own tables"""
    from gguf.constants import GGUFValueType
    from gguf.gguf_reader import GGUFReader

    sizes = {int(t): np.dtype(n).itemsize for t, n in GGUFReader.gguf_scalar_to_np.items()}
    return sizes, int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


def _skip_value(buf, off: int, vtype: int, types: tuple[dict[int, int], int, int]) -> int:
    """The offset past one metadata value of type vtype at off (types: _value_types())."""
    scalar, string, array = types
    if vtype in scalar:
        return off + scalar[vtype]
    if vtype == string:
        return off + 8 + int.from_bytes(buf[off : off + 8], "little")
    if vtype == array:
        etype, count = int.from_bytes(buf[off : off + 4], "little"), int.from_bytes(buf[off + 4 : off + 12], "little")
        off += 12
        if etype in scalar:
            return off + count * scalar[etype]
        for _ in range(count):
            off = _skip_value(buf, off, etype, types)
        return off
    raise ValueError(f"GGUF metadata: unknown value type {vtype} at byte {off}")


def tensor_table(path: str) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """GGUF tensor name -> (ggml type name, dims innermost first, its bytes as a view of the file's
    memory map). Reads the header itself and skips the metadata values (the tokenizer's ~100k
    strings): gguf-py's reader builds every field as numpy views, about 4 s of the default model's
    first load here. Little-endian GGUF v2 / v3 (what gguf-py and llama.cpp write)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    data = np.memmap(path, mode="r")
    buf = memoryview(data)

    def u(off: int, n: int) -> int:
        return int.from_bytes(buf[off : off + n], "little")

    if bytes(buf[:4]) != b"GGUF" or u(4, 4) not in (2, 3):
        raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
    n_tensors, n_kv, off, align = u(8, 8), u(16, 8), 24, 32
    types = _value_types()
    for _ in range(n_kv):
        klen = u(off, 8)
        key = bytes(buf[off + 8 : off + 8 + klen]).decode("utf-8", "replace")
        vtype, off = u(off + 8 + klen, 4), off + 12 + klen
        if key == "general.alignment" and vtype == GGUFValueType.UINT32:
            align = u(off, 4)
        off = _skip_value(buf, off, vtype, types)
    infos = []
    for _ in range(n_tensors):
        nlen = u(off, 8)
        name = bytes(buf[off + 8 : off + 8 + nlen]).decode("utf-8")
        off += 8 + nlen
        nd = u(off, 4)
        dims = tuple(u(off + 4 + 8 * i, 8) for i in range(nd))
        off += 4 + 8 * nd
        infos.append((name, dims, u(off, 4), u(off + 4, 8)))
        off += 12
    start = -(-off // align) * align
    table = {}
    for name, dims, tid, toff in infos:
        qtype = GGMLQuantizationType(tid)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        table[name] = (qtype.name, dims, data[start + toff : start + toff + nbytes])
    return table


def read_quant_tensors(path: str, model, supported: dict[str, int]) -> dict[str, QuantTensor]:
    """module name -> QuantTensor for every Linear of `model` whose GGUF tensor has a type in
    `supported` (name -> ggml type id) and the HF weight's shape."""
    tensors = tensor_table(path)
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
        if t is None or t[0] not in supported:
            continue
        type_name, dims, data = t
        n, k = w.shape
        if dims != (k, n):  # GGUF lists dims innermost first
            continue
        blocks = np.asarray(data).reshape(n, -1)
        out[mod_name] = QuantTensor(
            gname,
            type_name,
            supported[type_name],
            blocks,
            row_order(gname, n, heads, kv_heads),
            (n, k),
        )
    return out
