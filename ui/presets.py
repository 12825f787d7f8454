"""Published config values of well-known models, offered by the memory calculator (and used as
fixtures by the tests of engine/memory_math.py)."""
from __future__ import annotations

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

