"""Which model families the engine runs, and a clear refusal for what its attention lacks.

kvscope's paged attention computes plain causal softmax(QK^T / sqrt(d) ) V over every earlier
token of a request (MHA / GQA / MQA, any head dim, rotary applied by the model's own layer code
before K reaches the pool, biases in the projections). What changes the attention itself is
refused here, before an engine starts, with the feature named — never run wrong:
- sliding-window attention shorter than max_model_len (Mistral, Gemma2/3, Qwen2 with
  use_sliding_window): the pool keeps every token, the window would drop some;
- attention logit softcapping (Gemma2);
- multi-head latent attention (DeepSeek-V2/V3: the cache holds a compressed latent, not K/V);
- attention sinks (gpt-oss), ALiBi position biases (BLOOM, MPT), encoder-decoder models.
Checked token-exact against transformers in fp32 (tests/engine/test_families.py): Llama, Qwen2
(q/k/v biases), Phi3 with partial rotary, GPT-NeoX (partial rotary, fused qkv, parallel residual).
"""

from __future__ import annotations

SOFTCAP_FIELDS = ("attn_logit_softcapping",)
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
ALIBI_TYPES = ("bloom", "mpt")
SINK_TYPES = ("gpt_oss",)


def _sliding_window(cfg) -> int | None:
    """The window a layer of this config would apply, or None when every layer attends fully."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if any(t == "sliding_attention" for t in layer_types) else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


def check_supported(cfg, max_model_len: int) -> None:
    """Raises ValueError naming the feature this model needs that the engine does not build."""
    mt = getattr(cfg, "model_type", "?")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"model_type={mt!r} is an encoder-decoder model; kvscope runs decoder-only causal LMs")
    for f in SOFTCAP_FIELDS:
        if getattr(cfg, f, None):
            raise ValueError(
                f"model_type={mt!r} uses attention logit softcapping ({f}={getattr(cfg, f)}), which "
                "kvscope's paged attention does not implement"
            )
    for f in MLA_FIELDS:
        if getattr(cfg, f, None):
            raise ValueError(
                f"model_type={mt!r} uses multi-head latent attention (MLA, {f}={getattr(cfg, f)}): its "
                "cache holds a compressed latent, which kvscope's K/V pool does not implement"
            )
    if mt in SINK_TYPES:
        raise ValueError(f"model_type={mt!r} uses attention sinks, which kvscope's paged attention does not implement")
    if mt in ALIBI_TYPES or getattr(cfg, "alibi", False):
        raise ValueError(
            f"model_type={mt!r} uses ALiBi position biases, which kvscope's paged attention does not implement"
        )
    window = _sliding_window(cfg)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"model_type={mt!r} uses sliding-window attention (sliding_window={window}), which "
            f"kvscope's paged attention does not implement; it would differ from the model past "
            f"{window} tokens (max_model_len={max_model_len}). Set max_model_len <= {window} to run it "
            "as full attention"
        )
