"""Which instruction-set path the engine's C kernels (engine/model/cpu_kernels.py) run here: the one
home for it. `path()` is the loaded library's own answer (kvscope_isa() in csrc/quant_linear.c,
which selects its paths by the ISA macros: AVX-512 F/DQ/BW/VL, else AVX2 + FMA + F16C, else
portable C); `describe()` adds the features the compiler's flags (cpu_kernels.CFLAGS, -march=native,
plus KVSCOPE_ISA's, e.g. -mno-avx512f) define. `bench` prints it beside every figure."""

from __future__ import annotations

import functools
import os
import subprocess

# What an AVX2-only CPU leaves a torch program: ATen's, oneDNN's and MKL's kernels pick their ISA at
# run time, so on an AVX-512 CPU they would run AVX-512 beside kvscope's AVX2 build. Under
# KVSCOPE_ISA=avx2 both this process (limit_runtime, from `import engine`) and the bench's vLLM peer
# (engine/bench/peers.vllm_isa_env) run with these limits; values already in the environment win.
# Without them the bench's roofs on the AVX2 path were AVX-512 rates: torch's fp32 matmul, 512 x 576
# x 3072, 170 / 330 GFLOP/s at 1 / 2 threads against 112 / 215 limited (a Xeon with AVX-512).
AVX2_RUNTIME_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def runtime_limits() -> dict[str, str]:
    """Under KVSCOPE_ISA=avx2, AVX2_RUNTIME_ENV with the values already in the environment winning;
    {} otherwise. Reads only. KVSCOPE_ISA is read here as cpu_kernels.isa_flags reads it, without
    importing that module (it imports torch, and this runs before torch may)."""
    if (os.environ.get("KVSCOPE_ISA") or "native").strip().lower() != "avx2":
        return {}
    return {k: os.environ.get(k, v) for k, v in AVX2_RUNTIME_ENV.items()}


def limit_runtime() -> dict[str, str]:
    """Set runtime_limits() in this process's environment and return them. Read by ATen, oneDNN
    and MKL when they first pick a kernel, so it runs at `import engine`, before any torch op."""
    limits = runtime_limits()
    os.environ.update(limits)
    return limits


# macro -> name, in the order they are reported
_MACROS = (
    ("__AVX512F__", "AVX512F"),
    ("__AVX512DQ__", "AVX512DQ"),
    ("__AVX512BW__", "AVX512BW"),
    ("__AVX512VL__", "AVX512VL"),
    ("__AVX512VNNI__", "AVX512VNNI"),
    ("__AVX2__", "AVX2"),
    ("__FMA__", "FMA"),
    ("__F16C__", "F16C"),
)


def path_of(macros: set[str]) -> str:
    """The kernels' path for a set of predefined macro names (quant_linear.c's rule)."""
    if {"__AVX2__", "__FMA__", "__F16C__"} <= macros:
        if {"__AVX512F__", "__AVX512DQ__", "__AVX512BW__", "__AVX512VL__"} <= macros:
            return "AVX-512"
        return "AVX2+FMA"
    return "portable C (no AVX2)"


# the library's kvscope_isa() -> the names path_of gives
_LIB_NAMES = {"AVX-512": "AVX-512", "AVX2": "AVX2+FMA", "scalar": "portable C (no AVX2)"}


def path() -> str:
    """The vector path the loaded kernels run: "AVX-512", "AVX2+FMA", "portable C (no AVX2)", or
    the torch reference where the kernels are not built."""
    from engine.model import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None:
        return "torch reference (C kernels not built)"
    name = lib.kvscope_isa().decode()
    return _LIB_NAMES.get(name, name)


def _compiler_macros(cc: str, flags: list[str]) -> set[str]:
    keep = [f for f in flags if f.startswith(("-m", "-O"))]  # the ISA-relevant flags only
    out = subprocess.run([cc, *keep, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True, timeout=30)
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}


def build_path(isa: str = "native") -> str:
    """The path a build with KVSCOPE_ISA=isa would run on this machine (its compiler's macros under
    path_of's rule), without building or loading it."""
    from engine.model import cpu_kernels

    cc = cpu_kernels.compiler()
    return path_of(_compiler_macros(cc, [*cpu_kernels.CFLAGS, *cpu_kernels.ISA_FLAGS[isa]]) if cc else set())


@functools.lru_cache(maxsize=1)
def describe() -> dict:
    """{"path": "AVX-512" | "AVX2+FMA" | ..., "features": [...], "kernels": cpu_kernels.status()}.
    Where the kernels are not built, the path names the torch reference instead."""
    from engine.model import cpu_kernels

    status = cpu_kernels.status()
    if cpu_kernels.load() is None:
        return {"path": path(), "features": [], "kernels": status}
    cc = cpu_kernels.compiler()
    try:
        macros = _compiler_macros(cc, [*cpu_kernels.CFLAGS, *cpu_kernels.isa_flags()]) if cc else set()
    except (OSError, subprocess.SubprocessError):
        macros = set()
    return {"path": path(), "features": [n for m, n in _MACROS if m in macros], "kernels": status}


AMX_NOTE = "+ AMX for Q4_1"  # what summary() appends while the tiles run (figures look for it)


def amx() -> bool:
    """Whether this process's Q4_1 Linears of cpu_kernels.amx_min_rows rows or more run on AMX's bf16
    tiles (csrc/amx_linear.c): on where the CPU, the build and the OS allow it, unless KVSCOPE_AMX=0."""
    from engine.model import cpu_kernels

    lib = cpu_kernels.load()
    return lib is not None and cpu_kernels.amx(lib)


def summary() -> str:
    """One line: 'AVX2+FMA (AVX2 FMA F16C)', 'AVX-512 (...) + AMX for Q4_1 from 8 rows' where the
    tiles run (calls of fewer rows take the AVX path)."""
    d = describe()
    line = f"{d['path']} ({' '.join(d['features'])})" if d["features"] else d["path"]
    if not amx():
        return line
    from engine.model import cpu_kernels

    return f"{line} {AMX_NOTE} from {cpu_kernels.amx_min_rows(cpu_kernels.load())} rows"
