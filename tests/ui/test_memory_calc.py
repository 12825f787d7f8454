"""ui/figures/memory_calc.py: numbers, formula text and figures are pure functions of the inputs."""

import plotly.graph_objects as go
import pytest

from engine.lab import memory_math as mm
from engine.lab.memory_math import GiB, MiB
from ui.figures import memory_calc as mc
from ui.figures.presets import PRESETS

L3 = PRESETS["Llama-3-8B"]
DS = PRESETS["DeepSeek-V3 (MLA)"]


def test_compute_llama3_worked_example():
    r = mc.compute(L3, "bf16", 4096, 1, 80 * GiB)
    assert r.kind == "GQA"
    assert r.bytes_per_token == 131_072
    assert r.bytes_per_sequence == 512 * MiB
    assert r.kv_total == 512 * MiB and r.total == 512 * MiB and r.fits
    assert r.max_concurrent == 160
    text = "\n".join(r.formula_lines)
    assert r.formula_lines[0] == "bytes per token  = 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes"
    assert r.formula_lines[1].strip() == "= 131,072 B  (128 KiB)"
    assert "131,072 B x 4,096 tokens" in text and "= 536,870,912 B  (512 MiB)" in text
    assert r.formula_lines[-1].strip() == "= 160"
    assert max(len(line) for line in r.formula_lines) <= 90  # readable without scrolling


def test_compute_with_weights_and_concurrency():
    w = mm.weights_bytes(L3, "bf16")
    r = mc.compute(L3, "bf16", 32_768, 8, 80 * GiB, w)
    assert r.kv_total == 32 * GiB and r.total == 32 * GiB + w
    assert r.max_concurrent == (80 * GiB - w) // (4 * GiB)
    assert any("weights" in line and f"{w:,} B" in line for line in r.formula_lines)
    too_small = mc.compute(L3, "bf16", 4096, 1, 10 * GiB, w)
    assert too_small.max_concurrent == 0 and not too_small.fits
    assert "do not fit" in too_small.formula_lines[-1]


def test_compute_mla_and_bad_concurrency():
    r = mc.compute(DS, "bf16", 131_072, 1, 80 * GiB)
    assert r.kind == "MLA" and r.bytes_per_token == 70_272
    assert "512 latent + 64 rotary key" in r.formula_lines[0]
    assert r.formula_lines[1].strip() == "= 70,272 B  (68.62 KiB)"
    with pytest.raises(ValueError, match="concurrency"):
        mc.compute(L3, "bf16", 4096, 0, GiB)


def test_summary_rows():
    rows = mc.summary_rows(mc.compute(L3, "bf16", 131_072, 1, 80 * GiB))
    by = {r["quantity"]: r for r in rows}
    assert by["KV bytes per token"]["bytes"] == "131,072" and by["KV bytes per token"]["size"] == "128 KiB"
    assert by["KV per sequence"]["size"] == "16 GiB"
    assert by["max concurrent sequences"]["size"] == "5"


def test_context_points():
    pts = mc.context_points(4096, hi=131_072)
    assert pts[0] == 512 and pts[-1] == 131_072 and 4096 in pts
    assert pts == sorted(pts) and len(pts) <= mc.MAX_CONTEXT_POINTS
    assert 3000 in mc.context_points(3000)
    assert len(mc.context_points(10_000_000, hi=10_000_000)) <= mc.MAX_CONTEXT_POINTS + 1


def test_bytes_by_kind_figure_values():
    fig = mc.bytes_by_kind_figure(L3, "bf16")
    assert isinstance(fig, go.Figure)
    bar = fig.data[0]
    assert list(bar.x) == ["MHA", "GQA (this config)", "MQA"]
    assert list(bar.y) == [524_288, 131_072, 16_384]
    assert list(bar.text) == ["512 KiB", "128 KiB", "16 KiB"]
    ds = mc.bytes_by_kind_figure(DS, "bf16").data[0]
    assert list(ds.x)[-1] == "MLA (this config)" and list(ds.y)[-1] == 70_272


def test_memory_vs_context_figure():
    fig = mc.memory_vs_context_figure(L3, "bf16", 32_768, 1, 80 * GiB)
    by = {t.name: t for t in fig.data}
    assert set(by) == {"MHA", "GQA (this config)", "MQA", "your setting"}
    xs = list(by["GQA (this config)"].x)
    i = xs.index(32_768)
    assert by["MHA"].y[i] == 16.0 and by["GQA (this config)"].y[i] == 4.0 and by["MQA"].y[i] == 0.5
    assert list(by["your setting"].y) == [4.0]
    assert fig.layout.shapes[0].y0 == 80.0  # the GPU memory line
    with_w = mc.memory_vs_context_figure(L3, "bf16", 32_768, 2, 80 * GiB, 16 * GiB)
    assert [t for t in with_w.data if t.name == "your setting"][0].y[0] == 16 + 8


def test_max_concurrency_figure():
    fig = mc.max_concurrency_figure(L3, "bf16", 32_768, 80 * GiB)
    bar = fig.data[0]
    xs = list(bar.x)
    assert list(bar.y)[xs.index("32,768")] == 20
    assert list(bar.y)[xs.index("131,072")] == 5
    assert list(bar.y)[xs.index("2,048")] == 320


def test_figures_are_pure():
    a = mc.memory_vs_context_figure(L3, "fp8", 8192, 4, 24 * GiB, GiB).to_json()
    b = mc.memory_vs_context_figure(L3, "fp8", 8192, 4, 24 * GiB, GiB).to_json()
    assert a == b


# ---------------------------------------------------------------- bench kvquant's measurement beside the dtype

KVQ = {
    "date": "2026-12-02",
    "model": "default",
    "command": "python -m engine bench kvquant --quick",
    "dtypes": {
        "fp32": {
            "tokens_per_mib": 22.76,
            "decode_tok_s": 20.0,
            "needle_recall": 1.0,
            "token_agreement": 1.0,
            "sequences_identical": 1.0,
            "mean_kl": 0.0,
            "tokens_vs_fp32": 1.0,
        },
        "int8": {
            "tokens_per_mib": 85.67,
            "decode_tok_s": 19.5,
            "needle_recall": 0.5,
            "token_agreement": 0.75,
            "sequences_identical": 0.25,
            "mean_kl": 0.0123,
            "tokens_vs_fp32": 3.765,
        },
        "fp8_e4m3": {
            "tokens_per_mib": 85.67,
            "decode_tok_s": 19.0,
            "needle_recall": 0.0,
            "token_agreement": 0.5,
            "sequences_identical": 0.0,
            "mean_kl": 0.1,
            "tokens_vs_fp32": 3.765,
        },
    },
}


def test_kvquant_caption_shows_the_measured_figures_and_date():
    text = mc.kvquant_caption(KVQ, "int8")
    assert text.startswith("Measured 2026-12-02 on kvscope's engine (default model) vs an fp32 cache: ")
    for part in (
        "75% of greedy tokens identical",
        "25% of outputs identical",
        "mean KL 0.012 nats",
        "needle recall 50% (fp32: 100%)",
        "86 tokens per MiB (3.77x fp32)",
        "19.5 tok/s decode",
        "`python -m engine bench kvquant --quick`",
    ):
        assert part in text, part
    assert "needle recall 0%" in mc.kvquant_caption(KVQ, "fp8")  # the calculator's "fp8" is fp8_e4m3
    assert "fp32 is the reference" in mc.kvquant_caption(KVQ, "fp32")


def test_kvquant_caption_none_without_a_measurement():
    assert mc.kvquant_caption(None, "int8") is None
    assert mc.kvquant_caption(KVQ, "bf16") is None  # not in this file
    assert mc.kvquant_caption({"dtypes": {"int8": {"token_agreement": 1.0}}}, "int8") is None  # incomplete


def test_kvquant_caption_shows_short_prompt_agreement_and_recall_by_context():
    import copy

    data = copy.deepcopy(KVQ)
    data["dtypes"]["fp32"]["recall_by_context"] = {"512": 1.0, "4096": 1.0}
    data["dtypes"]["int4"] = dict(
        data["dtypes"]["int8"], short_top1_agreement=0.94, recall_by_context={"512": 1.0, "4096": 0.0}
    )
    text = mc.kvquant_caption(data, "int4")
    assert "on short prompts 94% of next-token picks are fp32's" in text
    assert "needle recall by context tokens 512: 100% (fp32 100%), 4,096: 0% (fp32 100%)" in text
    assert "int4" in mc.KV_DTYPES and "int2" in mc.KV_DTYPES and mc.KVQUANT_NAMES["fp8"] == "fp8_e4m3"
    # a file without the sweep reads as before
    assert "by context" not in mc.kvquant_caption(KVQ, "int8")


def test_kvquant_caption_shows_the_recall_grid_where_the_file_has_it():
    import copy

    data = copy.deepcopy(KVQ)
    data["recall_grid"] = {
        "contexts": [1024, 8192],
        "depths": [0.1, 0.5, 0.9],
        "hit": {
            "fp32": {"1024": [True] * 3, "8192": [True] * 3},
            "int8": {"1024": [True] * 3, "8192": [True, False, True]},
        },
    }
    text = mc.kvquant_caption(data, "int8")
    assert (
        "needles at depths 0.1/0.5/0.9 recalled by prompt length: 1k 3/3 (fp32 3/3), 8k 2/3 (fp32 3/3), "
        "so it loses a needle from 8k tokens (depth 0.5)"
    ) in text
    assert "by context tokens" not in text  # the grid replaces the shorter sweep
    assert "recalled by prompt length" not in mc.kvquant_caption(data, "fp8")  # not in the grid: the sweep's text
