"""The C kernels' two x86 builds give the same bits: on a CPU with AVX-512, the whole C stack built
for AVX2 (KVSCOPE_ISA=avx2, engine/model/cpu_kernels.py) and built natively computes bitwise the
same logits and K/V on the default model's GGUF weights (Q4_1 Linears, Q8_0 lm_head, RMSNorm, SiLU,
decode and prefill attention), over a prefill and ragged decode / verify rows (with AMX's tiles off:
their Q4_1 sums have bits of their own, tests/engine/test_amx_linear.py). Each build runs in
its own process (a process loads one build). On a CPU without AVX-512 both names build the same
code, so the test is skipped there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.model import kernel_isa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import hashlib, json, torch
from engine.model import cpu_kernels, kernel_isa
from engine.model.models import load_model
from tests.engine.c_stack import ragged_cases, runner
torch.set_num_threads(1)
model, tok = load_model("default")
r = runner(model)
assert r.decode_backend == "c", cpu_kernels.status()
cases = ragged_cases(tok)
h = hashlib.sha256()
for rows in cases:
    h.update(r.forward(rows).numpy().tobytes())
for k, v in r.kv_caches:
    h.update(k.numpy().tobytes()); h.update(v.numpy().tobytes())
print(json.dumps({"isa": kernel_isa.summary(), "sha256": h.hexdigest()}))
"""


def _run(isa: str) -> dict:
    env = dict(os.environ, KVSCOPE_ISA=isa, KVSCOPE_AMX="0", PYTHONPATH=ROOT)  # the vector paths (AMX: its own bits)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    kernel_isa.build_path("native") != "AVX-512", reason="no AVX-512 path here: the two builds are the same code"
)
def test_avx2_build_bitwise_equals_native_build():
    native, avx2 = _run("native"), _run("avx2")
    print(native, avx2)
    assert native["isa"].startswith("AVX-512") and avx2["isa"].startswith("AVX2")
    assert native["sha256"] == avx2["sha256"]


def test_the_avx2_path_runs_torch_as_an_avx2_only_cpu_would(monkeypatch):
    """KVSCOPE_ISA=avx2 limits this process's ATen / oneDNN / MKL to AVX2 from `import engine` (a
    value already set wins), so torch's ops and the bench's roofs are an AVX2 CPU's; unset, nothing
    is touched."""
    # limit_runtime writes os.environ: a copy here, so nothing outlives the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in kernel_isa.AVX2_RUNTIME_ENV})
    monkeypatch.delenv("KVSCOPE_ISA", raising=False)
    assert kernel_isa.limit_runtime() == {} and not any(k in os.environ for k in kernel_isa.AVX2_RUNTIME_ENV)
    monkeypatch.setenv("KVSCOPE_ISA", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX")
    assert kernel_isa.limit_runtime() == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX",
    }
    env = {k: v for k, v in os.environ.items() if k not in kernel_isa.AVX2_RUNTIME_ENV}
    probe = "import engine, torch; print(torch.backends.cpu.get_cpu_capability())"
    for isa, want in (("avx2", {"AVX2"}), ("native", {"AVX2", "AVX512", "DEFAULT", "NO AVX"})):
        env["KVSCOPE_ISA"] = isa
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() in want, (isa, out.stdout)
