"""engine/model/models.py additions: random-weight models of any config built in place, registered by a
"mem:" name for the engine, with an id-only tokenizer that refuses text."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.models import IdTokenizer, build_random, load_model, register_model, unregister_model


def _cfg():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )


def test_registered_model_runs_token_ids_and_refuses_text():
    model = build_random(_cfg(), seed=0)
    register_model("mem:unit", model)
    try:
        got, tok = load_model("mem:unit", "cpu", "float32")
        assert got is model and isinstance(tok, IdTokenizer) and tok.eos_token_id == 2
        llm = LLM(model="mem:unit", device="cpu", num_kv_blocks=16, block_size=4, max_model_len=128)
        out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        ids = out.outputs[0].token_ids
        assert len(ids) == 4 and out.outputs[0].text == "".join(f"<{i}>" for i in ids)
        with pytest.raises(ValueError, match="send the prompt as a list of token ids"):
            llm.generate(["hello"], SamplingParams(max_tokens=2))
    finally:
        unregister_model("mem:unit")
    with pytest.raises(ValueError, match=r"model='mem:unit' is not registered"):
        load_model("mem:unit", "cpu", "float32")


def test_register_needs_the_mem_prefix():
    with pytest.raises(ValueError, match="must start with 'mem:'"):
        register_model("unit", build_random(_cfg()))


def test_build_random_is_seeded_and_scaled():
    a, b = build_random(_cfg(), seed=5), build_random(_cfg(), seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    w = a.model.layers[0].mlp.down_proj.weight  # fan-in 64: std 1/8
    assert 0.09 < w.std().item() < 0.16
    assert torch.equal(a.model.norm.weight, torch.ones(32))


def test_default_model_cache_is_a_standard_hf_folder():
    """The de-quantized cache loads in plain transformers (and so in vLLM and other tools) as is:
    architectures set, the tied embedding stored under its own name, tokenizer files beside the
    weights, and the same logits as the model the engine runs."""
    import json
    import os

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.models import default_hf_folder

    d = default_hf_folder()
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # tied: one copy
    assert emb.shape == (49152, 576) and emb.abs().sum() > 0
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    plain = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ours, _ = load_model("default", device="cpu", dtype="float32")
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, ours(ids).logits)
    assert torch.equal(plain.lm_head.weight, plain.model.embed_tokens.weight)
