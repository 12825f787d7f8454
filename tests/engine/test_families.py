"""engine/model/families.py and the runner on model families other than Llama: small random-weight
configs of families transformers ships that change what the K/V pool holds, each greedy
token-exact to transformers' generate in fp32 on every attention path; what the engine lacks
(sliding window, softcapping, MLA, sinks, ALiBi) is refused with the feature named."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lab.agreement import agreement, hf_greedy
from engine.model.attention import refuse_unsupported
from engine.model.families import check_supported
from engine.model.models import build_random, register_model, unregister_model

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPTS = [[1, 5, 7, 9, 11, 300, 400, 20], [1, 2, 3], [1] + list(range(100, 170)), [1] + list(range(100, 130))]


def _config(family: str):
    import transformers as tf

    if family == "qwen2":  # q/k/v projections with biases
        return tf.Qwen2Config(num_key_value_heads=2, **COMMON)
    if family == "phi3":  # fused qkv / gate_up projections, half the head dim rotated
        return tf.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, **COMMON)
    if family == "gpt_neox":  # fused qkv with biases, a quarter rotated, parallel residual, LayerNorm
        return tf.GPTNeoXConfig(rotary_pct=0.25, **COMMON)
    if family == "mistral":  # sliding window, run where the window covers max_model_len
        return tf.MistralConfig(num_key_value_heads=2, sliding_window=256, **COMMON)
    raise KeyError(family)


@pytest.fixture(scope="module", params=["qwen2", "phi3", "gpt_neox", "mistral"])
def family(request):
    model = build_random(_config(request.param), seed=1)
    name = f"mem:{request.param}"
    register_model(name, model)
    yield request.param, name, model, hf_greedy(model, PROMPTS, 12)
    unregister_model(name)


@pytest.mark.parametrize("backend", ["auto", "torch", "flex"])
def test_family_greedy_identical_to_transformers(family, backend):
    fam, name, model, ref = family
    assert len({t for r in ref for t in r}) > 8, "the random model must not collapse to one token"
    llm = LLM(
        model=name,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        num_kv_blocks=48,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=256,
    )
    outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=12, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    a = agreement(got, ref)
    assert a.exact, (fam, backend, a)
    llm.engine.check_invariants()


def test_qwen2_biases_go_through_the_merged_packed_linear():
    model = build_random(_config("qwen2"), seed=2)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    register_model("mem:qwen2-pack", model)
    try:
        llm = LLM(model="mem:qwen2-pack", device="cpu", num_kv_blocks=32, block_size=4, max_model_len=256)
        pack = llm.engine.runner.linear_pack
        if pack is None:
            pytest.skip("no packed-Linear kernel on this machine")
        assert pack.num_merged == 2 * 2  # qkv and gate_up in each of the 2 layers
    finally:
        unregister_model("mem:qwen2-pack")


# ------------------------------------------------------------------ refusals


def test_sliding_window_refused_beyond_the_window():
    import transformers as tf

    cfg = tf.MistralConfig(num_key_value_heads=2, sliding_window=64, **COMMON)
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=64\)"):
        check_supported(cfg, 512)
    check_supported(cfg, 64)  # the window covers every context: full attention
    qwen = tf.Qwen2Config(
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=1,
        num_hidden_layers=2,
        **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
    )
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(qwen, 512)
    check_supported(tf.Qwen2Config(**COMMON), 1024)  # sliding window off


def test_sliding_window_model_refused_by_the_engine():
    import transformers as tf

    model = build_random(tf.MistralConfig(num_key_value_heads=2, sliding_window=64, **COMMON))
    register_model("mem:mistral-sw", model)
    try:
        with pytest.raises(ValueError, match=r"sliding_window=64.*max_model_len=512"):
            LLM(model="mem:mistral-sw", device="cpu", max_model_len=512, num_kv_blocks=16)
    finally:
        unregister_model("mem:mistral-sw")


def test_softcap_mla_sinks_alibi_refused():
    import transformers as tf

    with pytest.raises(ValueError, match="attention logit softcapping"):
        check_supported(tf.Gemma2Config(sliding_window=4096, **COMMON), 1024)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(MLA"):
        check_supported(tf.DeepseekV3Config(), 1024)
    with pytest.raises(ValueError, match="ALiBi"):
        check_supported(tf.BloomConfig(), 1024)
    with pytest.raises(ValueError, match="attention sinks"):
        check_supported(tf.GptOssConfig(), 1024)


def test_runtime_guard_in_the_attention():
    refuse_unsupported({"sliding_window": 64}, 64)
    refuse_unsupported({"sliding_window": None, "softcap": None}, 5000)
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 64, context 65\)"):
        refuse_unsupported({"sliding_window": 64}, 65)
    with pytest.raises(ValueError, match="softcapping"):
        refuse_unsupported({"softcap": 50.0}, 10)


def test_build_random_same_weights_on_any_dtype():
    cfg = _config("qwen2")
    a = build_random(cfg, "cpu", torch.float32, seed=3)
    b = build_random(cfg, "cpu", torch.bfloat16, seed=3)
    wa, wb = a.model.layers[0].self_attn.q_proj.weight, b.model.layers[0].self_attn.q_proj.weight
    assert wb.dtype == torch.bfloat16
    torch.testing.assert_close(wa.to(torch.bfloat16), wb)
