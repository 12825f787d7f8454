"""AppTest for pages/memory_calculator.py: widgets drive the numbers the page shows. The
calculator itself needs no engine (the loaded model's shape comes from session state, handed in
here with make_engine_info); the page still runs through app.py, whose sidebar builds the tiny
test-mode engine."""

import pytest

from tests.app import helpers as H
from tests.conftest import REPO_ROOT
from tests.factories import make_engine_info

pytestmark = pytest.mark.usefixtures("tiny_test_mode")


@pytest.fixture
def calc(app_test):
    """factory: calc(**session_state) runs the Memory calculator once with that state."""
    return lambda **state: app_test("pages/memory_calculator.py", state=state).run()


def test_default_is_llama3_8b_bf16(calc):
    at = calc()
    assert not at.exception
    assert not at.error
    m = H.metrics(at)
    assert m["KV bytes per token"] == ["131,072 B"]
    assert m["KV per sequence"] == ["512 MiB"]
    code = at.code[0].value
    assert "= 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes\n" in code
    assert "= 131,072 B  (128 KiB)" in code
    assert "131,072 B x 4,096 tokens\n" in code and "= 536,870,912 B  (512 MiB)" in code
    assert len(at.get("plotly_chart")) == 3


def test_seed_examples_via_widgets(calc):
    at = calc()
    at.checkbox(key="mc_weights").uncheck()
    at.number_input(key="mc_context").set_value(131_072)
    at.run()
    m = H.metrics(at)
    assert m["KV per sequence"] == ["16 GiB"] and m["Total needed"] == ["16 GiB"]
    assert m["Max concurrent"] == ["5"]  # 80 GiB / 16 GiB

    at.number_input(key="mc_context").set_value(32_768)
    for kind, expected in (("MHA", "16 GiB"), ("GQA", "4 GiB"), ("MQA", "512 MiB")):
        at.selectbox(key="mc_kind").set_value(kind)
        at.run()
        assert not at.exception
        assert H.metrics(at)["KV per sequence"] == [expected], kind


def test_deepseek_v3_mla(calc):
    at = calc()
    at.selectbox(key="mc_preset").set_value("DeepSeek-V3 (MLA)")
    at.run()
    m = H.metrics(at)
    assert m["KV bytes per token"] == ["70,272 B"]
    assert "MLA" in at.subheader[0].value
    assert "61 layers x (512 latent + 64 rotary key) x 2 bytes\n" in at.code[0].value
    assert "= 70,272 B" in at.code[0].value
    # the published 671B total is used for the weights: 1.34 TB in bf16 does not fit in 80 GiB
    assert m["Max concurrent"] == ["0"]
    assert any("671.00 billion parameters" in c.value and "published" in c.value for c in at.caption)
    at.checkbox(key="mc_weights").uncheck()
    for ctx, shown in ((2048, "137.25 MiB"), (8192, "549 MiB"), (32_768, "2.14 GiB"), (131_072, "8.58 GiB")):
        at.number_input(key="mc_context").set_value(ctx)
        at.run()
        assert H.metrics(at)["KV per sequence"] == [shown], ctx


def test_llama3_context_table_from_the_seed(calc):
    at = calc()
    at.checkbox(key="mc_weights").uncheck()
    for ctx, shown in ((2048, "256 MiB"), (8192, "1 GiB"), (32_768, "4 GiB"), (131_072, "16 GiB")):
        at.number_input(key="mc_context").set_value(ctx)
        at.run()
        assert H.metrics(at)["KV per sequence"] == [shown], ctx


def test_dtype_and_concurrency_change_numbers(calc):
    at = calc()
    at.checkbox(key="mc_weights").uncheck()
    at.selectbox(key="mc_dtype").set_value("fp8")
    at.number_input(key="mc_concurrency").set_value(8)
    at.run()
    m = H.metrics(at)
    # 1 byte per number + a float32 scale per (token, KV head) row, as kvscope stores fp8: 65,536 + 2,048
    assert m["KV bytes per token"] == ["67,584 B"]
    assert m["Total needed"] == ["2.06 GiB"]  # 8 x 4,096 x 67,584 B
    at.selectbox(key="mc_dtype").set_value("fp32")
    at.run()
    assert H.metrics(at)["KV bytes per token"] == ["262,144 B"]


def test_weights_and_gpu_memory(calc):
    at = calc()
    at.number_input(key="mc_gpu_gib").set_value(24.0)
    at.run()
    m = H.metrics(at)
    # Llama-3-8B: 8.03B params x 2 B = 14.96 GiB weights; (24 GiB - weights) / 512 MiB
    assert m["Max concurrent"] == ["18"]
    at.number_input(key="mc_gpu_gib").set_value(8.0)
    at.run()
    assert H.metrics(at)["Max concurrent"] == ["0"]
    assert at.warning


def test_pasted_json_ok_and_invalid(calc):
    at = calc()
    at.radio(key="mc_source").set_value("Paste config.json")
    at.run()
    assert not at.exception and not at.error
    assert H.metrics(at)["KV bytes per token"] == ["23,040 B"]  # the SmolLM2 example shown
    at.text_area(key="mc_json").input('{"num_hidden_layers": 32, "num_attention_heads": 32,')
    at.run()
    assert not at.exception
    assert at.error and "not valid JSON" in at.error[0].value
    at.text_area(key="mc_json").input('{"num_attention_heads": 32, "hidden_size": 4096}')
    at.run()
    assert not at.exception
    assert "num_hidden_layers" in at.error[0].value
    at.text_area(key="mc_json").input(
        '{"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "model_type": "gpt2"}'
    )
    at.run()
    assert not at.error
    assert H.metrics(at)["KV bytes per token"] == ["36,864 B"]  # 2 x 12 layers x 12 heads x 64 x 2 B


def test_gqa_groups_selector(calc):
    at = calc()
    at.checkbox(key="mc_weights").uncheck()
    at.selectbox(key="mc_kind").set_value("GQA")
    at.run()
    assert at.selectbox(key="mc_gqa_heads").value == 8
    at.selectbox(key="mc_gqa_heads").set_value(4)
    at.run()
    assert H.metrics(at)["KV bytes per token"] == ["65,536 B"]


def test_loaded_model_from_session_state(calc):
    info = {
        "model": "default",
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_dim": 64,
        "num_attention_heads": 9,
        "hidden_size": 576,
        "vocab_size": 49152,
    }
    at = calc(engine_info=info)
    assert at.radio(key="mc_source").value == "The loaded model"
    assert not at.exception
    assert H.metrics(at)["KV bytes per token"] == ["23,040 B"]
    assert "GQA" in at.subheader[0].value


def test_loaded_model_engine_info_dataclass_without_query_heads(calc):
    # SmolLM2-135M in fp32 as the engine reports it: 2 x 30 layers x 3 KV heads x 64 x 4 B per token
    info = make_engine_info(
        model="default",
        dtype="float32",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        num_blocks=100,
        bytes_per_token=46_080,
        victim_policy="last_admitted",
    )
    assert (info.bytes_per_block, info.kv_cache_bytes) == (737_280, 73_728_000)
    at = calc(engine_info=info)
    assert not at.exception and not at.error
    at.selectbox(key="mc_dtype").set_value("fp32")
    at.run()
    assert H.metrics(at)["KV bytes per token"] == ["46,080 B"]  # matches the engine's own figure
    assert "query heads not reported" in at.subheader[0].value
    assert any("weights not counted" in c.value for c in at.caption)


def test_parameter_count_override(calc):
    at = calc()
    at.number_input(key="mc_params_b").set_value(8.0)
    at.number_input(key="mc_gpu_gib").set_value(16.0)
    at.run()
    # 8e9 params x 2 B = 16,000,000,000 B of weights; 16 GiB - that = 1,179,869,184 B -> 2 x 512 MiB
    assert H.metrics(at)["Max concurrent"] == ["2"]
    assert "16,000,000,000 B weights" in at.code[0].value
    assert any("your parameter count" in c.value for c in at.caption)


def test_measured_kv_quantization_cost_beside_the_dtype(calc):
    """assets/measurements/kvquant.json (bench kvquant on the default model) is shown with its date."""
    import json

    data = json.loads((REPO_ROOT / "assets" / "measurements" / "kvquant.json").read_text())
    at = calc(mc_dtype="int8")
    assert not at.exception
    caps = [c.value for c in at.caption if c.value.startswith("Measured ")]
    assert len(caps) == 1 and f"Measured {data['date']}" in caps[0]
    r = data["dtypes"]["int8"]
    assert f"{r['token_agreement']:.0%} of greedy tokens identical" in caps[0]


def test_int4_and_int2_kv_dtypes(calc):
    """The calculator offers every pool format the engine has; int4 on Llama-3-8B: 32 layers x 8 KV
    heads x 2 rows of 128 numbers, each 64 code bytes + 4 scales of 4 bytes."""
    at = calc()
    assert {"int4", "int2"} <= set(at.selectbox(key="mc_dtype").options)
    at.selectbox(key="mc_dtype").set_value("int4")
    at.run()
    assert not at.exception and not at.error
    assert H.metrics(at)["KV bytes per token"] == [f"{2 * 32 * 8 * (64 + 16):,} B"]
    assert "x 0.5 bytes + 8,192 scale bytes" in at.code[0].value
    import json

    data = json.loads((REPO_ROOT / "assets" / "measurements" / "kvquant.json").read_text())
    caps = [c.value for c in at.caption if c.value.startswith("Measured ")]
    if "int4" in data.get("recall_grid", {}).get("hit", {}):  # the recall grid to the model's context
        assert len(caps) == 1 and "needles at depths 0.1/0.5/0.9 recalled by prompt length: 1k " in caps[0]
    at.selectbox(key="mc_dtype").set_value("int2")
    at.run()
    assert H.metrics(at)["KV bytes per token"] == [f"{2 * 32 * 8 * (32 + 16):,} B"]
