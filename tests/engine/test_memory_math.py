"""engine/lab/memory_math.py: the seeds' worked examples, every attention kind, dtypes, parsing errors."""

import json
import sys
from types import SimpleNamespace

import pytest

from engine.lab import memory_math as mm
from engine.lab.memory_math import GiB, KiB, MiB
from ui.figures import memory_calc as mc
from ui.figures.presets import PRESET_PARAM_COUNTS, PRESETS

LLAMA3_8B = PRESETS["Llama-3-8B"]
DSV3 = PRESETS["DeepSeek-V3 (MLA)"]


def test_module_does_not_import_torch():
    code = "import sys, engine.lab.memory_math; print('torch' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the seeds' worked examples, exactly


def test_llama3_8b_bf16_bytes_per_token():
    assert mm.config_kv_bytes_per_token(LLAMA3_8B, "bf16") == 131_072 == 128 * KiB
    # per layer: 2 x 8 x 128 x 2 = 4 KiB
    assert mm.config_kv_bytes_per_token(LLAMA3_8B, "bf16") // 32 == 4096


@pytest.mark.parametrize(
    "tokens,expected",
    [
        (4_096, 512 * MiB),
        (131_072, 16 * GiB),
        (2_048, GiB // 4),
        (8_192, 1 * GiB),
        (32_768, 4 * GiB),
    ],
)
def test_llama3_8b_per_sequence(tokens, expected):
    assert mm.kv_bytes_per_sequence(LLAMA3_8B, "bf16", tokens) == expected


def test_llama3_8b_128000_tokens_is_16_8_decimal_gb():
    b = mm.kv_bytes_per_sequence(LLAMA3_8B, "bf16", 128_000)
    assert b == 16_777_216_000
    assert mc.format_bytes(b, decimal=True) == "16.78 GB"


@pytest.mark.parametrize("kind,kv_heads,gib", [("MHA", 32, 16), ("GQA", 8, 4), ("MQA", 1, 0.5)])
def test_mha_gqa_mqa_at_32k(kind, kv_heads, gib):
    cfg = dict(LLAMA3_8B, num_key_value_heads=kv_heads)
    assert mm.attention_kind(cfg) == kind
    assert mm.kv_bytes_per_sequence(cfg, "bf16", 32_768) == int(gib * GiB)
    over = mm.with_attention_kind(LLAMA3_8B, kind, num_kv_heads=kv_heads if kind == "GQA" else None)
    assert mm.kv_bytes_per_sequence(over, "bf16", 32_768) == int(gib * GiB)


def test_deepseek_v3_mla_latent():
    assert mm.attention_kind(DSV3) == "MLA"  # despite num_key_value_heads = 128
    assert mm.config_kv_bytes_per_token(DSV3, "bf16") == 61 * 576 * 2 == 70_272
    assert "512 latent + 64 rotary" in mm.formula_text(DSV3, "bf16")


def test_mla_expanded_to_mha_uses_decompressed_head_dims():
    mha = mm.with_attention_kind(DSV3, "MHA")
    # K = 128 + 64, V = 128 per head, 128 heads, 61 layers, 2 bytes
    assert mm.config_kv_bytes_per_token(mha, "bf16") == 61 * 128 * (192 + 128) * 2
    by_kind = mm.bytes_per_token_by_kind(DSV3, "bf16")
    assert by_kind["MLA"] == 70_272 and by_kind["MHA"] > 70 * by_kind["MLA"]


# ---- kinds, dtypes, aliases


def test_presets_kinds():
    kinds = {n: mm.attention_kind(c) for n, c in PRESETS.items()}
    assert kinds["Llama-2-7B (MHA)"] == "MHA"
    assert kinds["Falcon-7B (MQA)"] == "MQA"
    assert kinds["SmolLM2-135M"] == "GQA"
    assert kinds["Llama-3-70B"] == "GQA"
    assert set(kinds.values()) == set(mm.ATTENTION_KINDS)


def test_falcon_mqa_from_multi_query_flag():
    f = PRESETS["Falcon-7B (MQA)"]
    assert mm.kv_spec(f).head_dim == 64  # 4544 / 71
    assert mm.config_kv_bytes_per_token(f, "bf16") == 2 * 32 * 1 * 64 * 2
    # the new decoder architecture ignores multi_query and reads num_kv_heads
    assert mm.attention_kind(dict(f, new_decoder_architecture=True, num_kv_heads=71)) == "MHA"


def test_smollm2_matches_default_model_shape():
    s = PRESETS["SmolLM2-135M"]
    assert mm.config_kv_bytes_per_token(s, "bf16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert mm.config_kv_bytes_per_token(s, "fp32") == 46_080


@pytest.mark.parametrize(
    "dtype,b",
    [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1), ("int8", 1), ("bfloat16", 2), ("torch.float32", 4), ("FP8", 1)],
)
def test_dtypes(dtype, b):
    assert mm.dtype_bytes(dtype) == b
    # 8-bit caches keep a float32 scale per (token, KV head) row: 2 x 32 layers x 8 KV heads x 4 B
    scales = 2 * 32 * 8 * 4 if b == 1 else 0
    assert mm.kv_scale_bytes_per_token(LLAMA3_8B, dtype) == scales
    assert mm.config_kv_bytes_per_token(LLAMA3_8B, dtype) == 65_536 * b + scales


def test_bad_dtype_names_choices():
    with pytest.raises(ValueError, match="dtype must be one of"):
        mm.config_kv_bytes_per_token(LLAMA3_8B, "int3")


def test_head_dim_derived_from_hidden_size():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    assert mm.kv_spec(cfg).head_dim == 64
    assert mm.config_kv_bytes_per_token(cfg, "fp32") == 2 * 2 * 2 * 64 * 4


def test_explicit_head_dim_wins_over_hidden_size():
    cfg = {
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_size": 2048,
        "head_dim": 256,
    }  # Gemma-style
    assert mm.config_kv_bytes_per_token(cfg, "bf16") == 2 * 4 * 256 * 2


def test_object_config_and_gpt2_aliases():
    obj = SimpleNamespace(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, model_type="gpt2")
    assert mm.attention_kind(obj) == "MHA"
    assert mm.config_kv_bytes_per_token(obj, "fp16") == 2 * 12 * 12 * 64 * 2


def test_transformers_config_object():
    from transformers import LlamaConfig

    c = LlamaConfig(
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    )
    assert mm.config_kv_bytes_per_token(c, "bf16") == 131_072
    assert mm.estimate_params(c).total == mm.estimate_params(LLAMA3_8B).total


def test_text_config_of_multimodal_config():
    cfg = {"model_type": "llava", "text_config": dict(LLAMA3_8B)}
    assert mm.config_kv_bytes_per_token(cfg, "bf16") == 131_072


# ---- capacity


def test_max_concurrent_sequences():
    # 80 GiB, no weights, 4 GiB per sequence at 32K
    assert mm.max_concurrent_sequences(LLAMA3_8B, "bf16", 32_768, 80 * GiB) == 20
    w = mm.weights_bytes(LLAMA3_8B, "bf16")
    assert mm.max_concurrent_sequences(LLAMA3_8B, "bf16", 32_768, 80 * GiB, w) == (80 * GiB - w) // (4 * GiB)
    assert mm.max_concurrent_sequences(LLAMA3_8B, "bf16", 4096, 10 * GiB, 20 * GiB) == 0


def test_block_rounding():
    per = mm.kv_bytes_per_sequence(LLAMA3_8B, "bf16", 17, block_size=16)
    assert per == 32 * 131_072


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(context_len=0), "context_len"),
        (dict(context_len=-5), "context_len"),
        (dict(memory_bytes=-1), "memory_bytes"),
        (dict(weights_bytes=-1), "weights_bytes"),
    ],
)
def test_capacity_bad_inputs_name_field(kwargs, field):
    args = dict(cfg=LLAMA3_8B, dtype="bf16", context_len=1024, memory_bytes=GiB)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        mm.max_concurrent_sequences(**args)


# ---- weights


def test_weights_llama_like_counts():
    assert mm.estimate_params(PRESETS["SmolLM2-135M"]).total == 134_515_008  # tied embeddings
    assert round(mm.estimate_params(LLAMA3_8B).total / 1e9, 2) == 8.03
    assert round(mm.estimate_params(PRESETS["Llama-3-70B"]).total / 1e9, 1) == 70.6
    assert round(mm.estimate_params(PRESETS["Llama-2-7B (MHA)"]).total / 1e9, 2) == 6.74
    assert round(mm.estimate_params(PRESETS["Mistral-7B (v0.2)"]).total / 1e9, 2) == 7.24
    e = mm.estimate_params(LLAMA3_8B)
    assert e.method == "computed" and sum(e.breakdown.values()) == e.total
    assert mm.weights_bytes(LLAMA3_8B, "bf16") == 2 * e.total


def test_weights_moe_mla_is_labelled_estimate_or_given():
    e = mm.estimate_params(DSV3)
    assert e.method == "estimate" and "estimate" in e.note and "experts" in e.note
    assert 660e9 < e.total < 680e9
    given = PRESET_PARAM_COUNTS["DeepSeek-V3 (MLA)"]
    assert given == 671_000_000_000
    assert mm.estimate_params(DSV3, given).method == "given"
    assert mm.weights_bytes(DSV3, "fp8", param_count=given) == given


# ---- parsing


def test_parse_config_json_ok():
    assert mm.parse_config_json(json.dumps(LLAMA3_8B)) == LLAMA3_8B


@pytest.mark.parametrize(
    "text,msg",
    [
        ("", "empty"),
        ("{not json", "not valid JSON.*line 1"),
        ("[1, 2]", "must be an object"),
        ('{"num_attention_heads": 32, "hidden_size": 4096}', "missing 'num_hidden_layers'"),
        ('{"num_hidden_layers": 2, "num_key_value_heads": 2}', "head_dim"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 32}', "missing 'hidden_size'"),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 8}',
            "divisible by num_key_value_heads",
        ),
        ('{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}', "not divisible"),
        (
            '{"num_hidden_layers": "two", "num_attention_heads": 2, "head_dim": 8}',
            "'num_hidden_layers' must be a positive integer",
        ),
        ('{"num_hidden_layers": 4, "kv_lora_rank": 512}', "qk_rope_head_dim"),
    ],
)
def test_parse_config_json_errors_name_the_problem(text, msg):
    with pytest.raises(ValueError, match=msg):
        mm.parse_config_json(text)


def test_attention_kind_needs_heads_to_tell_mha_from_gqa():
    cfg = {"num_hidden_layers": 2, "num_key_value_heads": 4, "head_dim": 64}
    assert mm.config_kv_bytes_per_token(cfg, "bf16") == 2 * 2 * 4 * 64 * 2
    with pytest.raises(ValueError, match="num_attention_heads"):
        mm.attention_kind(cfg)


def test_with_attention_kind_errors():
    with pytest.raises(ValueError, match="one of"):
        mm.with_attention_kind(LLAMA3_8B, "MLA")
    with pytest.raises(ValueError, match="divisor of num_attention_heads"):
        mm.with_attention_kind(LLAMA3_8B, "GQA", num_kv_heads=5)
    with pytest.raises(ValueError, match="GQA is not possible"):
        mm.with_attention_kind(PRESETS["Falcon-7B (MQA)"], "GQA")  # 71 heads is prime


def test_config_from_engine_info_object_and_dict():
    info = SimpleNamespace(model="default", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    cfg = mc.config_from_engine_info(info)
    assert mm.config_kv_bytes_per_token(cfg, "fp32") == 46_080
    assert mc.config_from_engine_info({"hf_config": LLAMA3_8B})["vocab_size"] == 128256


def test_format_bytes():
    assert mc.format_bytes(131_072) == "128 KiB"
    assert mc.format_bytes(16 * GiB) == "16 GiB"
    assert mc.format_bytes(GiB // 2) == "512 MiB"
    assert mc.format_bytes(70_272) == "68.62 KiB"
    assert mc.format_bytes(512) == "512 B"
