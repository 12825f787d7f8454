"""The KV cache's layout arithmetic, in one place: bytes per token, the model geometry read from a
config, and ceiling division. Pure Python (no torch): the engine, the memory calculator and the
roofline all call these.

A config is either a plain dict (a parsed ``config.json``) or any object with attributes
(a transformers ``PretrainedConfig``). Field names follow Hugging Face, with the common aliases
of older architectures (``n_layer``, ``n_head``, ``n_embd``, Falcon's ``multi_query`` ...).

Bytes per token, all layers:

* MHA / GQA / MQA: ``layers x kv_heads x (k_head_dim + v_head_dim) x bytes``, i.e.
  ``2 x layers x kv_heads x head_dim x bytes`` when K and V heads are the same size (one K and one
  V vector per KV head). MHA has ``kv_heads == heads``, MQA has ``kv_heads == 1``, GQA anything between.
* MLA (DeepSeek-V2/V3): each layer caches one compressed latent of ``kv_lora_rank`` numbers plus
  the shared rotary key of ``qk_rope_head_dim`` numbers: ``layers x (kv_lora_rank +
  qk_rope_head_dim) x bytes``; there is no separate K and V, so no factor 2.
* 8-bit caches (fp8, int8) as kvscope stores them (engine/model/kv_quant.py): each cached row (one
  token's K or V for one KV head, or one MLA latent) also keeps its own float32 scale:
  ``+ rows x 4`` bytes, i.e. ``2 x layers x kv_heads x (head_dim + 4)`` for int8 head rows.
* 4-bit and 2-bit caches (int4, int2) pack 2 or 4 codes per byte, each row's codes rounded up to
  whole bytes, and keep a float32 scale per group of 32 numbers of the row (the last group
  shorter): ``2 x layers x kv_heads x (head_dim / 2 + 4 x ceil(head_dim / 32))`` for int4. Their
  bytes per number (``dtype_bytes``) are 0.5 and 0.25.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


def row_code_bytes(numbers: int, itemsize: float) -> int:
    """Bytes of one cached row of ``numbers`` values at ``itemsize`` bytes each; a packed row
    (itemsize 0.5 or 0.25) rounds up to whole bytes."""
    return cdiv(numbers * round(itemsize * 8), 8)


def row_scale_count(numbers: int, scale_group: int | None) -> int:
    """Scales one cached row of ``numbers`` values keeps: one per row (``scale_group`` None), or
    one per group of ``scale_group`` numbers, the last group shorter (kv_scale_group)."""
    return 1 if scale_group is None else cdiv(numbers, scale_group)


def row_bytes(numbers: int, itemsize: float, scale_bytes: int = 0, scale_group: int | None = None) -> int:
    """Bytes one cached row (one token's K or V for one KV head, or one MLA latent) occupies:
    its codes, then its scales."""
    scales = row_scale_count(numbers, scale_group) if scale_bytes else 0
    return row_code_bytes(numbers, itemsize) + scale_bytes * scales


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: float,
    v_head_dim: int | None = None,
    scale_bytes: int = 0,
    scale_group: int | None = None,
) -> int:
    """Bytes one token occupies in a K/V cache: one K and one V vector per KV head, every layer,
    each row with its scales of `scale_bytes` each (kv_scale_bytes(dtype): 4 for kvscope's quantized
    formats), one per row or per `scale_group` numbers (kv_scale_group(dtype): 32 for int4 / int2)."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    k_row = row_bytes(head_dim, itemsize, scale_bytes, scale_group)
    return num_layers * num_kv_heads * (k_row + row_bytes(v_dim, itemsize, scale_bytes, scale_group))


def latent_bytes_per_token(
    num_layers: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    itemsize: float,
    scale_bytes: int = 0,
    scale_group: int | None = None,
) -> int:
    """MLA: one latent plus the shared rotary key per layer (no separate K and V)."""
    return num_layers * row_bytes(kv_lora_rank + qk_rope_head_dim, itemsize, scale_bytes, scale_group)


KiB = 1024
MiB = 1024**2
GiB = 1024**3

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5, "int2": 0.25}
SCALED_DTYPES = ("fp8", "int8", "int4", "int2")  # float32 scales in each cached row (engine/model/kv_quant.py)
KV_SCALE_BYTES = 4
# int4 / int2 keep one scale per 32 numbers of a row, not one per row: on the default model one
# scale per 64-number row loses the needle at 1k tokens where one per 32 keeps it (kv_quant.py)
KV_SCALE_GROUP = 32
GROUP_SCALED_DTYPES = ("int4", "int2")
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "i8": "int8",
    "uint8": "int8",
}
ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")

LAYERS_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEADS_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model", "dim")
VOCAB_FIELDS = ("vocab_size", "padded_vocab_size")
INTER_FIELDS = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")


# ---------------------------------------------------------------- field access


def config_field(cfg, key):
    """A model config field, from a transformers config object or a plain dict (None if absent)."""
    if isinstance(cfg, dict):
        return cfg.get(key)
    return getattr(cfg, key, None)


def text_part(cfg):
    """Multimodal configs (Llava, Gemma 3, ...) keep the language model under ``text_config``."""
    if not any(config_field(cfg, k) is not None for k in LAYERS_FIELDS):
        sub = config_field(cfg, "text_config")
        if sub is not None:
            return sub
    return cfg


def _first(cfg, names):
    for n in names:
        v = config_field(cfg, n)
        if v is not None:
            return n, v
    return None, None


MAX_CONFIG_INT = 2**40  # far above any real model; keeps every derived product a finite float


def pos_int(name, v):
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not math.isfinite(v))
        or v != int(v)
        or int(v) < 1
    ):
        raise ValueError(f"config field {name!r} must be a positive integer, got {v!r}")
    if v > MAX_CONFIG_INT:
        raise ValueError(f"config field {name!r} must be at most {MAX_CONFIG_INT}, got {v!r}")
    return int(v)


def need(cfg, names, what):
    n, v = _first(cfg, names)
    if v is None:
        alias = f" (also accepted: {', '.join(names[1:])})" if len(names) > 1 else ""
        raise ValueError(f"config is missing {names[0]!r}{alias}: needed for {what}")
    return pos_int(n, v)


def opt(cfg, names):
    n, v = _first(cfg, names)
    return None if v is None else pos_int(n, v)


def dtype_bytes(dtype) -> float:
    """Bytes per number for fp32/bf16/fp16/fp8/int8 (an int) or the packed int4/int2 (0.5, 0.25);
    also accepts 'bfloat16', torch dtypes ..."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


def _dtype_key(dtype) -> str:
    key = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def kv_scale_bytes(dtype) -> int:
    """Bytes of one scale: KV_SCALE_BYTES for fp8 / int8 / int4 / int2 (kvscope's layout), 0 otherwise."""
    return KV_SCALE_BYTES if _dtype_key(dtype) in SCALED_DTYPES else 0


def kv_scale_group(dtype) -> int | None:
    """Numbers per scale: KV_SCALE_GROUP for int4 / int2; None (one scale per row) otherwise."""
    return KV_SCALE_GROUP if _dtype_key(dtype) in GROUP_SCALED_DTYPES else None


def dtype_row_bytes(dtype, numbers: int) -> int:
    """Bytes of one cached row of ``numbers`` values in ``dtype``, scales included."""
    return row_bytes(numbers, dtype_bytes(dtype), kv_scale_bytes(dtype), kv_scale_group(dtype))


# ---------------------------------------------------------------- the resolved attention shape


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What one token costs in the KV cache, per layer, in numbers (not bytes)."""

    kind: str  # MHA | GQA | MQA | MLA
    num_layers: int
    num_heads: int | None  # query heads (None when the source did not report them)
    num_kv_heads: int | None  # None for MLA
    k_head_dim: int | None
    v_head_dim: int | None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @property
    def head_dim(self) -> int | None:
        return self.k_head_dim if self.k_head_dim == self.v_head_dim else None


def _is_mla(cfg) -> bool:
    return config_field(cfg, "kv_lora_rank") is not None


def kv_spec(cfg) -> KVSpec:
    """Resolve a config into its KV-cache shape; ValueError naming the first missing/bad field."""
    if cfg is None or not (isinstance(cfg, dict) or hasattr(cfg, "__dict__") or hasattr(cfg, "__slots__")):
        raise ValueError(f"config must be a dict or a config object, got {type(cfg).__name__}")
    cfg = text_part(cfg)
    layers = need(cfg, LAYERS_FIELDS, "the number of layers")
    heads = opt(cfg, HEADS_FIELDS)
    if _is_mla(cfg):
        rank = pos_int("kv_lora_rank", config_field(cfg, "kv_lora_rank"))
        rope = config_field(cfg, "qk_rope_head_dim")
        if rope is None:
            raise ValueError(
                "config is missing 'qk_rope_head_dim': MLA (kv_lora_rank is set) caches "
                "the latent plus the rotary key of this size"
            )
        return KVSpec("MLA", layers, heads, None, None, None, rank, pos_int("qk_rope_head_dim", rope))

    kv_name, kv = _first(cfg, KV_HEADS_FIELDS)
    if kv is not None:
        kv = pos_int(kv_name, kv)
    elif config_field(cfg, "multi_query") and not config_field(cfg, "new_decoder_architecture"):
        kv = 1  # Falcon-7B style MQA
    elif heads is not None:
        kv = heads  # no KV-head field: plain MHA
    else:
        raise ValueError(
            f"config is missing {HEADS_FIELDS[0]!r} (also accepted: {', '.join(HEADS_FIELDS[1:])}) "
            f"and {KV_HEADS_FIELDS[0]!r}: needed for the number of KV heads"
        )
    if heads is not None:
        if kv > heads:
            raise ValueError(f"{kv_name or 'num_key_value_heads'} ({kv}) must not exceed num_attention_heads ({heads})")
        if heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by {kv_name or 'num_key_value_heads'} ({kv})"
            )

    nope, rope, vdim = (config_field(cfg, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if nope is not None and rope is not None and vdim is not None:
        # DeepSeek-style attention without the latent compression: K and V differ in size
        kd = pos_int("qk_nope_head_dim", nope) + pos_int("qk_rope_head_dim", rope)
        vd = pos_int("v_head_dim", vdim)
    else:
        hd = config_field(cfg, "head_dim")
        if hd is not None:
            hd = pos_int("head_dim", hd)
        else:
            if heads is None:
                raise ValueError(
                    "config is missing 'head_dim' (and 'num_attention_heads' to derive it from hidden_size)"
                )
            hidden = need(cfg, HIDDEN_FIELDS, "head_dim = hidden_size / num_attention_heads")
            if hidden % heads:
                raise ValueError(
                    f"config has no 'head_dim' and hidden_size ({hidden}) is not divisible "
                    f"by num_attention_heads ({heads})"
                )
            hd = hidden // heads
        kd = vd = hd

    if heads is None:
        kind = "MQA" if kv == 1 else "GQA"  # best guess; see attention_kind
    elif kv == heads:
        kind = "MHA"
    elif kv == 1:
        kind = "MQA"
    else:
        kind = "GQA"
    return KVSpec(kind, layers, heads, kv, kd, vd)


def attention_kind(cfg) -> str:
    """ "MHA" | "GQA" | "MQA" | "MLA". Needs num_attention_heads unless the config is MLA or has 1 KV head."""
    spec = kv_spec(cfg)
    if spec.num_heads is None and spec.kind == "GQA":
        raise ValueError("config is missing 'num_attention_heads': needed to tell MHA from GQA")
    return spec.kind


def spec_bytes_per_token(spec: KVSpec, itemsize: float, scale_bytes: int = 0, scale_group: int | None = None) -> int:
    """Bytes per token for a resolved KVSpec (any attention kind)."""
    if spec.kind == "MLA":
        return latent_bytes_per_token(
            spec.num_layers, spec.kv_lora_rank, spec.qk_rope_head_dim, itemsize, scale_bytes, scale_group
        )
    return kv_bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.k_head_dim, itemsize, spec.v_head_dim, scale_bytes, scale_group
    )


def kv_geometry(cfg) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a model whose K and V heads share one size (what the
    engine's paged pool stores); ValueError for MLA or unequal K/V head dims."""
    spec = kv_spec(cfg)
    if spec.kind == "MLA" or spec.head_dim is None:
        raise ValueError(
            f"the engine's KV pool needs K and V heads of one size; this config is {spec.kind} "
            f"with K head dim {spec.k_head_dim} and V head dim {spec.v_head_dim}"
        )
    return spec.num_layers, spec.num_kv_heads, spec.head_dim


def config_int(cfg, names: tuple[str, ...], what: str, required: bool = True) -> int | None:
    """The first of ``names`` the config (or its ``text_config``) sets, as a positive int;
    ValueError naming the field when it is missing (``required``) or bad."""
    cfg = text_part(cfg)
    return need(cfg, names, what) if required else opt(cfg, names)
