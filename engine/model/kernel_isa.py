"""Which instruction-set path the engine's C kernels (engine/model/cpu_kernels.py) were built for
here: the compiler is asked which ISA macros its flags (cpu_kernels.CFLAGS, -march=native) define,
the same macros engine/model/csrc/quant_linear.c selects its paths by (AVX-512 F/DQ/BW/VL, else
AVX2 + FMA + F16C, else portable C). `bench` prints it beside every figure."""

from __future__ import annotations

import functools
import subprocess

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


def _compiler_macros(cc: str, flags: list[str]) -> set[str]:
    keep = [f for f in flags if f.startswith(("-m", "-O"))]  # the ISA-relevant flags only
    out = subprocess.run([cc, *keep, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True, timeout=30)
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define ")}


@functools.lru_cache(maxsize=1)
def describe() -> dict:
    """{"path": "AVX-512" | "AVX2+FMA" | ..., "features": [...], "kernels": cpu_kernels.status()}.
    Where the kernels are not built, the path names the torch reference instead."""
    from engine.model import cpu_kernels

    status = cpu_kernels.status()
    if cpu_kernels.load() is None:
        return {"path": "torch reference (C kernels not built)", "features": [], "kernels": status}
    cc = cpu_kernels.compiler()
    try:
        macros = _compiler_macros(cc, list(cpu_kernels.CFLAGS)) if cc else set()
    except (OSError, subprocess.SubprocessError):
        macros = set()
    if not macros:
        return {"path": "unknown (compiler not asked)", "features": [], "kernels": status}
    return {"path": path_of(macros), "features": [n for m, n in _MACROS if m in macros], "kernels": status}


def summary() -> str:
    """One line: 'AVX2+FMA (AVX2 FMA F16C)'."""
    d = describe()
    return f"{d['path']} ({' '.join(d['features'])})" if d["features"] else d["path"]
