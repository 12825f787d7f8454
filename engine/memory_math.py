"""KV-cache and weight memory arithmetic from a model config. Pure Python; no torch, no streamlit.

A config is either a plain dict (a parsed ``config.json``) or any object with attributes
(a transformers ``PretrainedConfig``). Field names follow Hugging Face, with the common aliases
of older architectures (``n_layer``, ``n_head``, ``n_embd``, Falcon's ``multi_query`` ...).

Bytes per token, all layers, K and V:

* MHA / GQA / MQA: ``2 x layers x kv_heads x head_dim x bytes`` (the 2 is one K and one V vector
  per KV head). MHA has ``kv_heads == heads``, MQA has ``kv_heads == 1``, GQA anything between.
* MLA (DeepSeek-V2/V3): each layer caches one compressed latent of ``kv_lora_rank`` numbers plus
  the shared rotary key of ``qk_rope_head_dim`` numbers: ``layers x (kv_lora_rank +
  qk_rope_head_dim) x bytes``; there is no separate K and V, so no factor 2.
* 8-bit caches (fp8, int8) as kvscope stores them (engine/kv_quant.py): each cached row (one
  token's K or V for one KV head, or one MLA latent) also keeps its own float32 scale, so add
  ``rows x 4`` bytes: ``2 x layers x kv_heads x (head_dim + 4)`` for int8 head rows.

Binary units throughout (KiB = 1024 B, GiB = 1024**3 B); :func:`format_bytes` also offers decimal.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 ** 2
GiB = 1024 ** 3

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8", "e4m3": "fp8", "e5m2": "fp8",
    "i8": "int8", "uint8": "int8",
}
SCALED_DTYPES = ("fp8", "int8")          # one float32 scale per cached row (engine/kv_quant.py)
KV_SCALE_BYTES = 4
ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_VOCAB = ("vocab_size", "padded_vocab_size")
_INTER = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")


# ---------------------------------------------------------------- field access

def _raw(cfg, key):
    if isinstance(cfg, dict):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _text_part(cfg):
    """Multimodal configs (Llava, Gemma 3, ...) keep the language model under ``text_config``."""
    if not any(_raw(cfg, k) is not None for k in _LAYERS):
        sub = _raw(cfg, "text_config")
        if sub is not None:
            return sub
    return cfg


def _first(cfg, names):
    for n in names:
        v = _raw(cfg, n)
        if v is not None:
            return n, v
    return None, None


MAX_CONFIG_INT = 2 ** 40     # far above any real model; keeps every derived product a finite float


def _pos_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)) or v != int(v) or int(v) < 1:
        raise ValueError(f"config field {name!r} must be a positive integer, got {v!r}")
    if v > MAX_CONFIG_INT:
        raise ValueError(f"config field {name!r} must be at most {MAX_CONFIG_INT}, got {v!r}")
    return int(v)


def _need(cfg, names, what):
    n, v = _first(cfg, names)
    if v is None:
        alias = f" (also accepted: {', '.join(names[1:])})" if len(names) > 1 else ""
        raise ValueError(f"config is missing {names[0]!r}{alias}: needed for {what}")
    return _pos_int(n, v)


def _opt(cfg, names):
    n, v = _first(cfg, names)
    return None if v is None else _pos_int(n, v)


def dtype_bytes(dtype) -> int:
    """Bytes per number for fp32/bf16/fp16/fp8/int8 (also accepts 'bfloat16', torch dtypes ...)."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


# ---------------------------------------------------------------- the resolved attention shape

@dataclass(frozen=True, slots=True)
class KVSpec:
    """What one token costs in the KV cache, per layer, in numbers (not bytes)."""

    kind: str                     # MHA | GQA | MQA | MLA
    num_layers: int
    num_heads: int | None         # query heads (None when the source did not report them)
    num_kv_heads: int | None      # None for MLA
    k_head_dim: int | None
    v_head_dim: int | None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @property
    def head_dim(self) -> int | None:
        return self.k_head_dim if self.k_head_dim == self.v_head_dim else None

    @property
    def numbers_per_token_per_layer(self) -> int:
        if self.kind == "MLA":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim)


def _is_mla(cfg) -> bool:
    return _raw(cfg, "kv_lora_rank") is not None


def kv_spec(cfg) -> KVSpec:
    """Resolve a config into its KV-cache shape; ValueError naming the first missing/bad field."""
    if cfg is None or not (isinstance(cfg, dict) or hasattr(cfg, "__dict__") or hasattr(cfg, "__slots__")):
        raise ValueError(f"config must be a dict or a config object, got {type(cfg).__name__}")
    cfg = _text_part(cfg)
    layers = _need(cfg, _LAYERS, "the number of layers")
    heads = _opt(cfg, _HEADS)
    if _is_mla(cfg):
        rank = _pos_int("kv_lora_rank", _raw(cfg, "kv_lora_rank"))
        rope = _raw(cfg, "qk_rope_head_dim")
        if rope is None:
            raise ValueError("config is missing 'qk_rope_head_dim': MLA (kv_lora_rank is set) caches "
                             "the latent plus the rotary key of this size")
        return KVSpec("MLA", layers, heads, None, None, None, rank, _pos_int("qk_rope_head_dim", rope))

    kv_name, kv = _first(cfg, _KV_HEADS)
    if kv is not None:
        kv = _pos_int(kv_name, kv)
    elif _raw(cfg, "multi_query") and not _raw(cfg, "new_decoder_architecture"):
        kv = 1                                          # Falcon-7B style MQA
    elif heads is not None:
        kv = heads                                      # no KV-head field: plain MHA
    else:
        raise ValueError(f"config is missing {_HEADS[0]!r} (also accepted: {', '.join(_HEADS[1:])}) "
                         f"and {_KV_HEADS[0]!r}: needed for the number of KV heads")
    if heads is not None:
        if kv > heads:
            raise ValueError(f"{kv_name or 'num_key_value_heads'} ({kv}) must not exceed "
                             f"num_attention_heads ({heads})")
        if heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by "
                             f"{kv_name or 'num_key_value_heads'} ({kv})")

    nope, rope, vdim = (_raw(cfg, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if nope is not None and rope is not None and vdim is not None:
        # DeepSeek-style attention without the latent compression: K and V differ in size
        kd = _pos_int("qk_nope_head_dim", nope) + _pos_int("qk_rope_head_dim", rope)
        vd = _pos_int("v_head_dim", vdim)
    else:
        hd = _raw(cfg, "head_dim")
        if hd is not None:
            hd = _pos_int("head_dim", hd)
        else:
            if heads is None:
                raise ValueError("config is missing 'head_dim' (and 'num_attention_heads' to derive it "
                                 "from hidden_size)")
            hidden = _need(cfg, _HIDDEN, "head_dim = hidden_size / num_attention_heads")
            if hidden % heads:
                raise ValueError(f"config has no 'head_dim' and hidden_size ({hidden}) is not divisible "
                                 f"by num_attention_heads ({heads})")
            hd = hidden // heads
        kd = vd = hd

    if heads is None:
        kind = "MQA" if kv == 1 else "GQA"              # best guess; see attention_kind
    elif kv == heads:
        kind = "MHA"
    elif kv == 1:
        kind = "MQA"
    else:
        kind = "GQA"
    return KVSpec(kind, layers, heads, kv, kd, vd)


def attention_kind(cfg) -> str:
    """"MHA" | "GQA" | "MQA" | "MLA". Needs num_attention_heads unless the config is MLA or has 1 KV head."""
    spec = kv_spec(cfg)
    if spec.num_heads is None and spec.kind == "GQA":
        raise ValueError("config is missing 'num_attention_heads': needed to tell MHA from GQA")
    return spec.kind


# ---------------------------------------------------------------- KV bytes

def _canonical(dtype) -> str:
    key = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def kv_scale_bytes_per_token(cfg, dtype) -> int:
    """Bytes of per-row float32 scales one token adds to an 8-bit cache (0 for float dtypes)."""
    if _canonical(dtype) not in SCALED_DTYPES:
        return 0
    spec = kv_spec(cfg)
    rows = 1 if spec.kind == "MLA" else 2 * spec.num_kv_heads
    return spec.num_layers * rows * KV_SCALE_BYTES


def kv_bytes_per_token(cfg, dtype) -> int:
    """KV-cache bytes one token occupies, all layers (K and V, or the MLA latent), with the
    per-row scales of an 8-bit cache. The engine sizes its pool with this function too."""
    spec = kv_spec(cfg)
    numbers = spec.num_layers * spec.numbers_per_token_per_layer
    return numbers * dtype_bytes(dtype) + kv_scale_bytes_per_token(cfg, dtype)


def _check_tokens(name, v, minimum=0):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


def kv_bytes_per_sequence(cfg, dtype, context_len, block_size: int | None = None) -> int:
    """Bytes for one sequence of ``context_len`` tokens; with ``block_size``, rounded up to whole
    blocks (what a paged allocator actually reserves)."""
    _check_tokens("context_len", context_len)
    tokens = context_len
    if block_size is not None:
        _check_tokens("block_size", block_size, 1)
        tokens = -(-context_len // block_size) * block_size
    return kv_bytes_per_token(cfg, dtype) * tokens


def max_concurrent_sequences(cfg, dtype, context_len, memory_bytes, weights_bytes=0,
                             block_size: int | None = None) -> int:
    """How many sequences of ``context_len`` tokens fit in ``memory_bytes`` after the weights."""
    _check_tokens("context_len", context_len, 1)
    for name, v in (("memory_bytes", memory_bytes), ("weights_bytes", weights_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    free = memory_bytes - weights_bytes
    if free <= 0:
        return 0
    return int(free // kv_bytes_per_sequence(cfg, dtype, context_len, block_size))


def with_attention_kind(cfg, kind: str, num_kv_heads: int | None = None) -> dict:
    """A copy of the config (as a dict) switched to another attention layout, for what-if sums.

    MHA: KV heads = query heads; MQA: 1 KV head; GQA: ``num_kv_heads`` (default: the config's own
    when it is already GQA, else the largest divisor of the head count <= 8 and > 1). An MLA config
    switched to MHA/GQA/MQA caches its decompressed K (qk_nope+qk_rope) and V (v_head_dim) heads.
    """
    kind = str(kind).upper()
    if kind not in ("MHA", "GQA", "MQA"):
        raise ValueError(f"attention kind override must be one of ('MHA', 'GQA', 'MQA'), got {kind!r}")
    base = dict(cfg) if isinstance(cfg, dict) else config_to_dict(cfg)
    text = _text_part(base)
    out = dict(text) if text is not base else base
    if not isinstance(out, dict):
        out = config_to_dict(out)
    spec = kv_spec(out)
    heads = spec.num_heads
    if heads is None:
        raise ValueError("config is missing 'num_attention_heads': needed to switch the attention kind")
    if spec.kind == "MLA":
        out["kv_lora_rank"] = None
        if out.get("v_head_dim") is None or out.get("qk_nope_head_dim") is None:
            raise ValueError("config is missing 'qk_nope_head_dim'/'v_head_dim': needed to expand MLA "
                             "into per-head K and V")
    for k in _KV_HEADS[1:]:
        out.pop(k, None)
    out.pop("multi_query", None)
    if kind == "MHA":
        kv = heads
    elif kind == "MQA":
        kv = 1
    else:
        if num_kv_heads is None:
            if spec.kind == "GQA":
                num_kv_heads = spec.num_kv_heads
            else:
                num_kv_heads = max((d for d in range(2, min(8, heads - 1) + 1) if heads % d == 0), default=None)
                if num_kv_heads is None:
                    raise ValueError(f"num_attention_heads ({heads}) has no divisor between 2 and "
                                     f"{heads - 1}: GQA is not possible, choose MHA or MQA")
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or not 1 < num_kv_heads < heads \
                or heads % num_kv_heads:
            raise ValueError(f"num_kv_heads for GQA must be a divisor of num_attention_heads ({heads}) "
                             f"strictly between 1 and {heads}, got {num_kv_heads!r}")
        kv = num_kv_heads
    out["num_key_value_heads"] = kv
    return out


def bytes_per_token_by_kind(cfg, dtype) -> dict[str, int]:
    """Bytes per token for the config as it is and its MHA / GQA / MQA (and MLA, if it is MLA)
    variants with the same layers, heads and head dims. Kinds that don't apply are left out."""
    spec = kv_spec(cfg)
    out: dict[str, int] = {}
    if spec.num_heads is None:
        return {spec.kind: kv_bytes_per_token(cfg, dtype)}
    for kind in ("MHA", "GQA", "MQA"):
        try:
            out[kind] = kv_bytes_per_token(with_attention_kind(cfg, kind), dtype)
        except ValueError:
            pass
    if spec.kind == "MLA":
        out["MLA"] = kv_bytes_per_token(cfg, dtype)
    return out


def formula_factors(cfg, dtype) -> str:
    """The factors of the bytes-per-token product with this config's numbers (no result)."""
    spec = kv_spec(cfg)
    b = dtype_bytes(dtype)
    sb = kv_scale_bytes_per_token(cfg, dtype)
    scales = f" + {sb:,} scale bytes" if sb else ""
    if spec.kind == "MLA":
        return (f"{spec.num_layers} layers x ({spec.kv_lora_rank} latent + {spec.qk_rope_head_dim} rotary key) "
                f"x {b} bytes{scales}")
    heads = "KV head" if spec.num_kv_heads == 1 else "KV heads"
    if spec.k_head_dim == spec.v_head_dim:
        return (f"2 (K and V) x {spec.num_layers} layers x {spec.num_kv_heads} {heads} x {spec.k_head_dim} head dim "
                f"x {b} bytes{scales}")
    return (f"{spec.num_layers} layers x {spec.num_kv_heads} {heads} x ({spec.k_head_dim} K dim + "
            f"{spec.v_head_dim} V dim) x {b} bytes{scales}")


def formula_text(cfg, dtype) -> str:
    """The bytes-per-token sum written out with this config's numbers."""
    text = f"{formula_factors(cfg, dtype)} = {kv_bytes_per_token(cfg, dtype):,} bytes per token"
    if kv_spec(cfg).kind == "MLA":
        text += "  (one shared latent per layer: no separate K and V)"
    return text


def sliding_window(cfg) -> int | None:
    """The config's sliding-window size, if it declares one (kvscope's sums assume full attention)."""
    v = _raw(_text_part(cfg), "sliding_window")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


# ---------------------------------------------------------------- weights

@dataclass(frozen=True, slots=True)
class ParamEstimate:
    total: int
    method: str                   # "given" | "computed" | "estimate"
    note: str
    breakdown: dict = field(default_factory=dict)


def _mlp_matrices(cfg) -> int:
    mt = str(_raw(cfg, "model_type") or "").lower()
    act = str(_raw(cfg, "hidden_act") or _raw(cfg, "activation_function") or "").lower()
    non_gated = mt in ("gpt2", "gpt_neox", "falcon", "opt", "bloom", "gpt_bigcode", "gptj", "phi")
    if non_gated or act in ("gelu_new", "gelu_pytorch_tanh", "relu") and mt not in ("gemma", "gemma2", "gemma3_text"):
        return 2
    return 3                      # gated MLP (SwiGLU/GeGLU): gate, up, down


def estimate_params(cfg, param_count: int | None = None) -> ParamEstimate:
    """Parameter count: ``param_count`` if given (e.g. a published figure), else computed from the
    config. Dense llama-like configs are counted matrix by matrix (embeddings, attention, MLP,
    norms, lm_head unless tied); MoE and MLA configs are counted the same way with every expert
    included, labelled an estimate (biases, MTP heads and other extras are not counted)."""
    if param_count is not None:
        if isinstance(param_count, bool) or not isinstance(param_count, (int, float)) or param_count < 1:
            raise ValueError(f"param_count must be a positive number, got {param_count!r}")
        return ParamEstimate(int(param_count), "given", "published / user-given parameter count")
    spec = kv_spec(cfg)
    cfg = _text_part(cfg)
    if spec.num_heads is None:
        raise ValueError("config is missing 'num_attention_heads': needed to count attention weights")
    h = _need(cfg, _HIDDEN, "the weight count")
    vocab = _need(cfg, _VOCAB, "the embedding weight count")
    heads, L = spec.num_heads, spec.num_layers
    notes = []

    if spec.kind == "MLA":
        nope, vdim = _raw(cfg, "qk_nope_head_dim"), _raw(cfg, "v_head_dim")
        if nope is None or vdim is None:
            raise ValueError("config is missing 'qk_nope_head_dim'/'v_head_dim': needed to count MLA weights")
        nope, vdim = _pos_int("qk_nope_head_dim", nope), _pos_int("v_head_dim", vdim)
        rope, rank = spec.qk_rope_head_dim, spec.kv_lora_rank
        qd = nope + rope
        qr = _raw(cfg, "q_lora_rank")
        q = (h * qr + qr + qr * heads * qd) if qr else h * heads * qd
        attn = q + h * (rank + rope) + rank + rank * heads * (nope + vdim) + heads * vdim * h
    else:
        attn = h * heads * spec.k_head_dim + h * spec.num_kv_heads * (spec.k_head_dim + spec.v_head_dim) \
            + heads * spec.v_head_dim * h
        if _raw(cfg, "attention_bias") or _raw(cfg, "bias"):
            attn += heads * spec.k_head_dim + spec.num_kv_heads * (spec.k_head_dim + spec.v_head_dim) + h

    m = _mlp_matrices(cfg)
    inter = _opt(cfg, _INTER)
    if inter is None:
        inter = 4 * h
        notes.append("intermediate size not in config: assumed 4 x hidden")
    n_experts = _opt(cfg, ("n_routed_experts", "num_local_experts", "num_experts"))
    moe = n_experts is not None and n_experts > 1
    if moe:
        e_inter = _opt(cfg, ("moe_intermediate_size",)) or inter
        shared = _opt(cfg, ("n_shared_experts",)) or 0
        shared_inter = _opt(cfg, ("shared_expert_intermediate_size",))
        shared_p = m * h * shared_inter if shared_inter else shared * m * h * e_inter
        moe_layer = n_experts * m * h * e_inter + shared_p + h * n_experts
        dense_layers = min(L, _opt(cfg, ("first_k_dense_replace",)) or 0)
        mlp_total = dense_layers * m * h * inter + (L - dense_layers) * moe_layer
        notes.append(f"MoE: all {n_experts} experts counted (weights held in memory), router included")
    else:
        mlp_total = L * m * h * inter
    norms = L * 2 * h + h
    embed = vocab * h
    tied = _raw(cfg, "tie_word_embeddings")
    if tied is None:
        tied = str(_raw(cfg, "model_type") or "").lower() in ("falcon", "gpt2")
    head = 0 if tied else vocab * h
    total = embed + L * attn + mlp_total + norms + head
    exact_kinds = spec.kind != "MLA" and not moe and m == 3
    method = "computed" if exact_kinds else "estimate"
    note = ("counted from the config (llama-like: embeddings, attention, gated MLP, norms"
            + (", tied lm_head)" if tied else ", lm_head)"))
    if not exact_kinds:
        note = "estimate from the config" + ("; " + "; ".join(notes) if notes else "") \
            + ("; MLA projections counted DeepSeek-style" if spec.kind == "MLA" else "") \
            + "; biases and extra heads not counted"
    elif notes:
        note += "; " + "; ".join(notes)
    return ParamEstimate(int(total), method, note, {
        "embeddings": embed, "attention": L * attn, "mlp": mlp_total, "norms": norms, "lm_head": head})


def weights_bytes(cfg, dtype, param_count: int | None = None) -> int:
    """Bytes of weights at ``dtype``: ``param_count`` (if given) or :func:`estimate_params` x bytes."""
    return estimate_params(cfg, param_count).total * dtype_bytes(dtype)


# ---------------------------------------------------------------- parsing, formatting

def config_to_dict(cfg) -> dict:
    if isinstance(cfg, dict):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}


def parse_config_json(text: str) -> dict:
    """Parse a pasted ``config.json``; ValueError saying what is wrong (bad JSON with line/column,
    not an object, or the first missing/bad field needed for the KV-cache sums)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("config JSON is empty: paste the contents of a model's config.json")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config JSON is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise ValueError("config JSON is nested too deeply") from None
    except ValueError as e:    # integers over Python's digit limit
        raise ValueError(f"config JSON is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config JSON must be an object {{...}}, got {type(cfg).__name__}")
    kv_spec(cfg)
    return cfg


def format_bytes(n: float, decimal: bool = False) -> str:
    """``131072 -> '128 KiB'``; ``decimal=True`` uses kB/MB/GB (1000-based)."""
    if n != n or n is None:
        return "n/a"
    base, units = (1000, ("B", "kB", "MB", "GB", "TB", "PB")) if decimal else \
        (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
    v = float(n)
    i = 0
    while abs(v) >= base and i < len(units) - 1:
        v /= base
        i += 1
    if i == 0:
        return f"{int(v):,} B"
    s = f"{v:,.2f}".rstrip("0").rstrip(".")
    return f"{s} {units[i]}"


def config_from_engine_info(info) -> dict:
    """A config dict for the loaded model, from the app's ``engine_info`` (an EngineInfo-like object
    or dict). Uses a full HF config when one is attached (``hf_config``/``model_config``/``config``),
    else the fields EngineInfo reports (layers, KV heads, head dim; query heads if present)."""
    for key in ("hf_config", "model_config", "config"):
        sub = _raw(info, key)
        if isinstance(sub, dict) or (sub is not None and hasattr(sub, "to_dict")):
            return config_to_dict(sub)
    out = {"num_hidden_layers": _raw(info, "num_layers") or _raw(info, "num_hidden_layers"),
           "num_key_value_heads": _raw(info, "num_kv_heads") or _raw(info, "num_key_value_heads"),
           "head_dim": _raw(info, "head_dim")}
    heads = _raw(info, "num_heads") or _raw(info, "num_attention_heads")
    if heads:
        out["num_attention_heads"] = heads
    kv_spec(out)
    return out


# ---------------------------------------------------------------- presets (published config values)

PRESETS: dict[str, dict] = {
    "SmolLM2-135M": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rope_theta": 100000, "rms_norm_eps": 1e-05,
    },
    "Llama-3-8B": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    },
    "Llama-3-70B": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    },
    "Mistral-7B (v0.2)": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "sliding_window": None, "rms_norm_eps": 1e-05,
    },
    "DeepSeek-V3 (MLA)": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "vocab_size": 129280, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
    },
    "Llama-2-7B (MHA)": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_size": 4096, "intermediate_size": 11008, "vocab_size": 32000,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
    },
    "Falcon-7B (MQA)": {
        "model_type": "falcon", "architectures": ["FalconForCausalLM"],
        "num_hidden_layers": 32, "num_attention_heads": 71, "multi_query": True,
        "new_decoder_architecture": False, "parallel_attn": True, "bias": False, "alibi": False,
        "hidden_size": 4544, "vocab_size": 65024,
    },
}

# Published total parameter counts, used instead of the computed estimate where the estimate
# would miss pieces (DeepSeek-V3: 671B total, 37B active per token; the MTP module is extra).
PRESET_PARAM_COUNTS: dict[str, int] = {
    "DeepSeek-V3 (MLA)": 671_000_000_000,
}


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {name!r}")
    return dict(PRESETS[name])

