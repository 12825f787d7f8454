"""KV-cache and weight memory arithmetic from a model config. Pure Python; no torch, no streamlit.

The formulas and the config reader live in engine/model/kv_layout.py (one home, shared with the engine
and the roofline); this module adds what the memory calculator needs on top: per-sequence and
concurrency sums, attention-kind what-ifs, weight estimates, config parsing.

Binary units throughout (KiB = 1024 B, GiB = 1024**3 B).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# re-exported: the calculator's callers use mm.*
from engine.model.kv_layout import (  # noqa: F401
    ATTENTION_KINDS,
    DTYPE_BYTES,
    HEADS_FIELDS,
    HIDDEN_FIELDS,
    INTER_FIELDS,
    KV_HEADS_FIELDS,
    KV_SCALE_BYTES,
    LAYERS_FIELDS,
    MAX_CONFIG_INT,
    SCALED_DTYPES,
    VOCAB_FIELDS,
    GiB,
    KiB,
    KVSpec,
    MiB,
    attention_kind,
    cdiv,
    config_field,
    dtype_bytes,
    kv_scale_bytes,
    kv_scale_group,
    kv_spec,
    need,
    opt,
    pos_int,
    spec_bytes_per_token,
    text_part,
)

# ---------------------------------------------------------------- KV bytes


def config_kv_bytes_per_token(cfg, dtype) -> int:
    """kv_layout's formula for a model config (config.json dict or HF config) and a dtype name:
    KV-cache bytes one token occupies, all layers (K and V, or the MLA latent), with the
    scales of a quantized cache as kvscope stores it (engine/model/kv_quant.py)."""
    return spec_bytes_per_token(kv_spec(cfg), dtype_bytes(dtype), kv_scale_bytes(dtype), kv_scale_group(dtype))


def kv_scale_bytes_per_token(cfg, dtype) -> int:
    """The part of config_kv_bytes_per_token that is float32 scales (0 for float dtypes)."""
    return config_kv_bytes_per_token(cfg, dtype) - spec_bytes_per_token(kv_spec(cfg), dtype_bytes(dtype))


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
        tokens = cdiv(context_len, block_size) * block_size
    return config_kv_bytes_per_token(cfg, dtype) * tokens


def max_concurrent_sequences(
    cfg, dtype, context_len, memory_bytes, weights_bytes=0, block_size: int | None = None
) -> int:
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
    text = text_part(base)
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
            raise ValueError(
                "config is missing 'qk_nope_head_dim'/'v_head_dim': needed to expand MLA into per-head K and V"
            )
    for k in KV_HEADS_FIELDS[1:]:
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
                    raise ValueError(
                        f"num_attention_heads ({heads}) has no divisor between 2 and "
                        f"{heads - 1}: GQA is not possible, choose MHA or MQA"
                    )
        if (
            isinstance(num_kv_heads, bool)
            or not isinstance(num_kv_heads, int)
            or not 1 < num_kv_heads < heads
            or heads % num_kv_heads
        ):
            raise ValueError(
                f"num_kv_heads for GQA must be a divisor of num_attention_heads ({heads}) "
                f"strictly between 1 and {heads}, got {num_kv_heads!r}"
            )
        kv = num_kv_heads
    out["num_key_value_heads"] = kv
    return out


def bytes_per_token_by_kind(cfg, dtype) -> dict[str, int]:
    """Bytes per token for the config as it is and its MHA / GQA / MQA (and MLA, if it is MLA)
    variants with the same layers, heads and head dims. Kinds that don't apply are left out."""
    spec = kv_spec(cfg)
    out: dict[str, int] = {}
    if spec.num_heads is None:
        return {spec.kind: config_kv_bytes_per_token(cfg, dtype)}
    for kind in ("MHA", "GQA", "MQA"):
        try:
            out[kind] = config_kv_bytes_per_token(with_attention_kind(cfg, kind), dtype)
        except ValueError:
            pass
    if spec.kind == "MLA":
        out["MLA"] = config_kv_bytes_per_token(cfg, dtype)
    return out


def formula_factors(cfg, dtype) -> str:
    """The factors of the bytes-per-token product with this config's numbers (no result)."""
    spec = kv_spec(cfg)
    b = dtype_bytes(dtype)
    sb = kv_scale_bytes_per_token(cfg, dtype)
    scales = f" + {sb:,} scale bytes" if sb else ""
    if spec.kind == "MLA":
        return (
            f"{spec.num_layers} layers x ({spec.kv_lora_rank} latent + {spec.qk_rope_head_dim} rotary key) "
            f"x {b} bytes{scales}"
        )
    heads = "KV head" if spec.num_kv_heads == 1 else "KV heads"
    if spec.k_head_dim == spec.v_head_dim:
        return (
            f"2 (K and V) x {spec.num_layers} layers x {spec.num_kv_heads} {heads} x {spec.k_head_dim} head dim "
            f"x {b} bytes{scales}"
        )
    return (
        f"{spec.num_layers} layers x {spec.num_kv_heads} {heads} x ({spec.k_head_dim} K dim + "
        f"{spec.v_head_dim} V dim) x {b} bytes{scales}"
    )


def formula_text(cfg, dtype) -> str:
    """The bytes-per-token sum written out with this config's numbers."""
    text = f"{formula_factors(cfg, dtype)} = {config_kv_bytes_per_token(cfg, dtype):,} bytes per token"
    if kv_spec(cfg).kind == "MLA":
        text += "  (one shared latent per layer: no separate K and V)"
    return text


def sliding_window(cfg) -> int | None:
    """The config's sliding-window size, if it declares one (kvscope's sums assume full attention)."""
    v = config_field(text_part(cfg), "sliding_window")
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


# ---------------------------------------------------------------- weights


@dataclass(frozen=True, slots=True)
class ParamEstimate:
    total: int
    method: str  # "given" | "computed" | "estimate"
    note: str
    breakdown: dict = field(default_factory=dict)


def _mlp_matrices(cfg) -> int:
    mt = str(config_field(cfg, "model_type") or "").lower()
    act = str(config_field(cfg, "hidden_act") or config_field(cfg, "activation_function") or "").lower()
    non_gated = mt in ("gpt2", "gpt_neox", "falcon", "opt", "bloom", "gpt_bigcode", "gptj", "phi")
    if non_gated or act in ("gelu_new", "gelu_pytorch_tanh", "relu") and mt not in ("gemma", "gemma2", "gemma3_text"):
        return 2
    return 3  # gated MLP (SwiGLU/GeGLU): gate, up, down


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
    cfg = text_part(cfg)
    if spec.num_heads is None:
        raise ValueError("config is missing 'num_attention_heads': needed to count attention weights")
    h = need(cfg, HIDDEN_FIELDS, "the weight count")
    vocab = need(cfg, VOCAB_FIELDS, "the embedding weight count")
    heads, L = spec.num_heads, spec.num_layers
    notes = []

    if spec.kind == "MLA":
        nope, vdim = config_field(cfg, "qk_nope_head_dim"), config_field(cfg, "v_head_dim")
        if nope is None or vdim is None:
            raise ValueError("config is missing 'qk_nope_head_dim'/'v_head_dim': needed to count MLA weights")
        nope, vdim = pos_int("qk_nope_head_dim", nope), pos_int("v_head_dim", vdim)
        rope, rank = spec.qk_rope_head_dim, spec.kv_lora_rank
        qd = nope + rope
        qr = config_field(cfg, "q_lora_rank")
        q = (h * qr + qr + qr * heads * qd) if qr else h * heads * qd
        attn = q + h * (rank + rope) + rank + rank * heads * (nope + vdim) + heads * vdim * h
    else:
        attn = (
            h * heads * spec.k_head_dim
            + h * spec.num_kv_heads * (spec.k_head_dim + spec.v_head_dim)
            + heads * spec.v_head_dim * h
        )
        if config_field(cfg, "attention_bias") or config_field(cfg, "bias"):
            attn += heads * spec.k_head_dim + spec.num_kv_heads * (spec.k_head_dim + spec.v_head_dim) + h

    m = _mlp_matrices(cfg)
    inter = opt(cfg, INTER_FIELDS)
    if inter is None:
        inter = 4 * h
        notes.append("intermediate size not in config: assumed 4 x hidden")
    n_experts = opt(cfg, ("n_routed_experts", "num_local_experts", "num_experts"))
    moe = n_experts is not None and n_experts > 1
    if moe:
        e_inter = opt(cfg, ("moe_intermediate_size",)) or inter
        shared = opt(cfg, ("n_shared_experts",)) or 0
        shared_inter = opt(cfg, ("shared_expert_intermediate_size",))
        shared_p = m * h * shared_inter if shared_inter else shared * m * h * e_inter
        moe_layer = n_experts * m * h * e_inter + shared_p + h * n_experts
        dense_layers = min(L, opt(cfg, ("first_k_dense_replace",)) or 0)
        mlp_total = dense_layers * m * h * inter + (L - dense_layers) * moe_layer
        notes.append(f"MoE: all {n_experts} experts counted (weights held in memory), router included")
    else:
        mlp_total = L * m * h * inter
    norms = L * 2 * h + h
    embed = vocab * h
    tied = config_field(cfg, "tie_word_embeddings")
    if tied is None:
        tied = str(config_field(cfg, "model_type") or "").lower() in ("falcon", "gpt2")
    head = 0 if tied else vocab * h
    total = embed + L * attn + mlp_total + norms + head
    exact_kinds = spec.kind != "MLA" and not moe and m == 3
    method = "computed" if exact_kinds else "estimate"
    note = "counted from the config (llama-like: embeddings, attention, gated MLP, norms" + (
        ", tied lm_head)" if tied else ", lm_head)"
    )
    if not exact_kinds:
        note = (
            "estimate from the config"
            + ("; " + "; ".join(notes) if notes else "")
            + ("; MLA projections counted DeepSeek-style" if spec.kind == "MLA" else "")
            + "; biases and extra heads not counted"
        )
    elif notes:
        note += "; " + "; ".join(notes)
    return ParamEstimate(
        int(total),
        method,
        note,
        {"embeddings": embed, "attention": L * attn, "mlp": mlp_total, "norms": norms, "lm_head": head},
    )


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
    except ValueError as e:  # integers over Python's digit limit
        raise ValueError(f"config JSON is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config JSON must be an object {{...}}, got {type(cfg).__name__}")
    kv_spec(cfg)
    return cfg
