"""The engine's own CPU kernels (engine/model/csrc/*.c), built with the host's C compiler on first use
and called through ctypes on tensors' memory.

- `paged_decode_attention` (csrc/paged_attention.c): decode attention read in place from the
  paged K/V pool. The torch reference in engine/model/attention.py gathers every running request's
  blocks into a dense, padded copy each layer and step and then runs SDPA over it; this kernel
  reads each key and value once from its block (timings: docs/BENCHMARKS.md).
- `qlinear` (csrc/quant_linear.c): the same product with the weight held as a GGUF's Q4_1 / Q8_0
  blocks (interleaved 16 rows to a panel, same bytes) or as exact F16 / BF16 values, reading
  5 / 8.5 / 16 bits per weight, not 32. F16 / BF16 (and Q4_1 / Q8_0 without AVX2) are widened
  to fp32 in registers with the dequantizer's arithmetic and summed in linear.c's order: bitwise
  the fp32 kernel's result on the de-quantized weight. Q4_1 / Q8_0 with AVX2 or AVX-512 sum each
  block factorized, d * sum(q x) + m * sum(x) (the same chains on both ISAs, so the same bits):
  the same value up to fp32 rounding
  (`qlinear_bitwise` says which; `within_fp32_rounding` is the bound the engine checks). On a CPU
  with AMX (Intel Sapphire Rapids and later) every Q4_1 call of `amx_min_rows` (8) rows or more
  runs on its bf16 tiles instead (csrc/amx_linear.c, `amx`): x cut into three exact bf16 parts, so
  each product is exact, summed by the tile unit; its own bits, within the same bound, independent
  of the batch among such calls (fewer rows: the AVX path, faster there).
- `kvscope_stack_forward` (csrc/layer.c): a whole Llama-family decoder stack in one call (RMSNorm,
  the packed Linears above, rotary, K/V written to the pool, the paged attention, SiLU-mul,
  residuals); engine/model/fused_decode.py drives it.
- `linear` (csrc/linear.c): y = x W^T on weights packed once into 16-column panels, for every
  row count (decode's 1-16 rows and prefill's 512). Each output is summed in the same order
  whatever the row count, so results do not depend on the batch.

The library is compiled once per (source, compiler, CPU, ISA) into the kvscope cache directory
(`-O3 -march=native`, about a second) and reused by every later process. KVSCOPE_ISA=avx2 builds
the AVX2 path on an AVX-512 CPU (`-mno-avx512f`), so both paths can be measured on one machine;
engine/model/kernel_isa.py names the path the loaded library runs (`python -m engine bench` prints
it). Where there is no compiler or the build fails, `load()` returns None with the reason in `status()` and the engine
uses the torch reference; nothing else changes. Set KVSCOPE_CPU_KERNELS=0 to never build or use it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading

import torch

from engine.model import huge_pages, kv_layout

_CSRC = ("paged_attention.c", "linear.c", "quant_linear.c", "amx_linear.c", "layer.c")
SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", f) for f in _CSRC]
HEADER = os.path.join(os.path.dirname(__file__), "csrc", "kvscope.h")  # shared by the sources: in the build key
ABI_VERSION = 5
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
MIN_PARALLEL_KEYS = 4096  # below this many (key position x KV head) pairs one thread is faster
_lock = threading.Lock()
_state: dict = {}


def compiler() -> str | None:
    """The C compiler the kernels build with: $CC, else gcc, cc, clang (first found)."""
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    for name in ("gcc", "cc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}  # KVSCOPE_ISA -> flags after -march=native


def isa_flags() -> list[str]:
    """The extra compiler flags KVSCOPE_ISA names (unset: native, every extension this CPU has)."""
    name = (os.environ.get("KVSCOPE_ISA") or "native").strip().lower()
    if name not in ISA_FLAGS:
        raise ValueError(f"KVSCOPE_ISA={name!r}: expected one of {', '.join(ISA_FLAGS)}")
    return ISA_FLAGS[name]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _build(cc: str) -> str:
    from engine.model.models import cache_dir

    src = b""
    for path in (*SOURCES, HEADER):
        with open(path, "rb") as f:
            src += f.read()
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        ver = cc
    flags = CFLAGS + isa_flags()
    key = hashlib.sha256(src + " ".join(flags).encode() + ver.encode() + _cpu_signature().encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, f"kvscope_cpu_{key}.so")
    if os.path.exists(lib):
        return lib
    tmp = f"{lib}.tmp{os.getpid()}.{threading.get_ident()}"
    proc = subprocess.run([cc, *flags, "-o", tmp, *SOURCES], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise RuntimeError(f"{os.path.basename(cc)} failed: {(proc.stderr or proc.stdout).strip()[:400]}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def load():
    """The loaded library, or None (the reason is in status())."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, why = None, None
        if os.environ.get("KVSCOPE_CPU_KERNELS", "1") == "0":
            why = "disabled by KVSCOPE_CPU_KERNELS=0"
        else:
            cc = compiler()
            if cc is None:
                why = "no C compiler (gcc, cc or clang) on PATH"
            else:
                try:
                    path = _build(cc)
                    lib = ctypes.CDLL(path)
                    if lib.kvscope_abi_version() != ABI_VERSION:
                        raise RuntimeError(f"{path}: ABI version {lib.kvscope_abi_version()} != {ABI_VERSION}")
                    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
                    f = lib.kvscope_paged_decode
                    f.argtypes = [P, P, P, P, P, P, P, I, I, I, I, I, I, ctypes.c_float, I, I]
                    f.restype = I
                    lib.kvscope_paged_decode_kv.argtypes = [*f.argtypes, I]
                    lib.kvscope_paged_decode_kv.restype = I
                    lib.kvscope_paged_prefill.argtypes = [P, P, P, P, I, I, I, P, I, I, I, I, ctypes.c_float, I]
                    lib.kvscope_paged_prefill.restype = I
                    lib.kvscope_paged_attention_rows.argtypes = [*f.argtypes, I]
                    lib.kvscope_paged_attention_rows.restype = I
                    lib.kvscope_linear.argtypes = [P, I, I, P, I, P, P, I]
                    lib.kvscope_linear.restype = I
                    lib.kvscope_linear_pack.argtypes = [P, I, I, P]
                    lib.kvscope_linear_pack.restype = None
                    lib.kvscope_linear_packed_floats.argtypes = [I, I]
                    lib.kvscope_linear_packed_floats.restype = ctypes.c_longlong
                    lib.kvscope_qpanel_bytes.argtypes = [I, I, I]
                    lib.kvscope_qpanel_bytes.restype = ctypes.c_longlong
                    lib.kvscope_qpack.argtypes = [I, P, ctypes.c_longlong, P, I, I, P]
                    lib.kvscope_qpack.restype = I
                    lib.kvscope_qunpack.argtypes = [I, P, I, I, P]
                    lib.kvscope_qunpack.restype = I
                    lib.kvscope_qlinear.argtypes = [I, P, I, I, P, I, P, P, I]
                    lib.kvscope_qlinear.restype = I
                    lib.kvscope_qlinear_bitwise.argtypes = [I]
                    lib.kvscope_qlinear_bitwise.restype = I
                    lib.kvscope_layer_scratch_floats.argtypes = [I, I, I, I, I, I]
                    lib.kvscope_layer_scratch_floats.restype = ctypes.c_longlong
                    lib.kvscope_stack_forward.argtypes = [P, I, P, I, P, P, P, P, P, P, I, I, I, F, I, I, P, P]
                    lib.kvscope_rmsnorm_rows.argtypes = [P, P, I, P, F, I, P]  # these return int (the default)
                    lib.kvscope_gather_rows.argtypes = [P, I, I, P, I, P]
                    lib.kvscope_isa.argtypes = []
                    lib.kvscope_isa.restype = ctypes.c_char_p
                    lib.kvscope_qlinear_scratch_rows.argtypes = [I]
                    lib.kvscope_qlinear_scratch_rows.restype = I
                    lib.kvscope_kv_side_step.argtypes = [I]
                    lib.kvscope_kv_side_step.restype = I
                    lib.kvscope_amx.argtypes = [I]
                    lib.kvscope_amx.restype = I
                    lib.kvscope_amx_min_rows.argtypes = [I]
                    lib.kvscope_amx_min_rows.restype = I
                    _self_test(lib)
                    _self_test_linear(lib)
                    tune_row_path(lib)
                    env_switches(lib)
                except Exception as e:  # build or self-test failed: the torch path stays
                    lib, why = None, f"{type(e).__name__}: {str(e)[:400]}"
        _state["lib"] = lib
        _state["why"] = why
        return lib


def status() -> str:
    load()
    return "built" if _state.get("lib") is not None else f"not used ({_state.get('why')})"


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Head shapes the kernel handles (fp32 tensors on CPU are the caller's check): head_dim a
    multiple of 8 up to 256, up to 256 query heads, a whole number of them per KV head."""
    return (
        head_dim % 8 == 0
        and 0 < head_dim <= 256
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads <= 256
    )


def paged_decode_attention(
    lib,
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    q_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    max_ctx: int,
    n_threads: int | None = None,
    kv_format: int = 0,
) -> None:
    """out[q_rows[s]] = softmax(q[q_rows[s]] . K_s^T * scale) V_s for every decode sequence s,
    K_s/V_s being positions 0..ctx_lens[s]-1 of the blocks tables[s]. q, out: [T, H, D];
    pools: [num_blocks, block_size, Hkv, D]; q_rows, ctx_lens: [S] int32; tables: [S, max_blocks]
    int32. The caller guarantees block ids < num_blocks and ctx_lens[s] <= max_blocks * block_size.
    kv_format: engine/kv_quant.KERNEL_CODES (0 fp32; int8 / fp8 pools are uint8 rows of D codes
    + a float32 scale, bf16 / fp16 pools their own dtype), widened to fp32 as read."""
    for t in (q, out, k_pool, v_pool, q_rows, ctx_lens, tables):
        assert t.is_contiguous() and t.device.type == "cpu"
    n_seqs, max_blocks = tables.shape
    _, bs, hkv, _ = k_pool.shape
    d = q.shape[2]
    if n_threads is None:
        n_threads = torch.get_num_threads()
    if max_ctx * hkv * n_seqs < MIN_PARALLEL_KEYS:
        n_threads = 1
    rc = lib.kvscope_paged_decode_kv(
        q.data_ptr(),
        out.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        q_rows.data_ptr(),
        ctx_lens.data_ptr(),
        tables.data_ptr(),
        n_seqs,
        max_blocks,
        bs,
        q.shape[1],
        hkv,
        d,
        float(scale),
        max_ctx,
        n_threads,
        kv_format,
    )
    if rc != 0:
        raise RuntimeError(f"kvscope_paged_decode failed with code {rc}")


def paged_prefill_attention(
    lib,
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    q_row0: int,
    n_rows: int,
    start: int,
    table: torch.Tensor,
    scale: float,
    n_threads: int | None = None,
) -> None:
    """Causal attention of one sequence's run of query rows q[q_row0 : q_row0 + n_rows] at
    positions start .. start + n_rows - 1 over its context 0 .. start + n_rows - 1, read from the
    blocks `table` (int32) of fp32 pools, tiled (csrc/paged_attention.c, kvscope_paged_prefill):
    what a prefill chunk's attention costs in the C stack. Head dim 64 or 128."""
    for t in (q, out, k_pool, v_pool, table):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert q.dtype == k_pool.dtype == v_pool.dtype == torch.float32 and table.dtype == torch.int32
    _, bs, hkv, d = k_pool.shape
    assert 0 <= q_row0 and q_row0 + n_rows <= q.shape[0] and table.numel() * bs >= start + n_rows
    rc = lib.kvscope_paged_prefill(
        q.data_ptr(),
        out.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        q_row0,
        n_rows,
        start,
        table.data_ptr(),
        bs,
        q.shape[1],
        hkv,
        d,
        float(scale),
        n_threads or torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"kvscope_paged_prefill failed with code {rc}")


def paged_attention_rows(lib, out, q, k_pool, v_pool, q_rows, ctx_lens, tables, scale, max_ctx, n_threads=None):
    """What the C stack calls per layer (fp32 pools): paged_decode_attention's arguments, but a
    run of rows that is one sequence's prefill chunk goes through the tiled prefill kernel."""
    for t in (q, out, k_pool, v_pool, q_rows, ctx_lens, tables):
        assert t.is_contiguous() and t.device.type == "cpu"
    n_threads = n_threads or torch.get_num_threads()
    n_seqs, max_blocks = tables.shape
    _, bs, hkv, d = k_pool.shape
    rc = lib.kvscope_paged_attention_rows(
        *(t.data_ptr() for t in (q, out, k_pool, v_pool, q_rows, ctx_lens, tables)),
        n_seqs,
        max_blocks,
        bs,
        q.shape[1],
        hkv,
        d,
        float(scale),
        max_ctx,
        n_threads,
        n_threads,
    )
    if rc != 0:
        raise RuntimeError(f"kvscope_paged_attention_rows failed with code {rc}")


def pack_linear(lib, weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 -> the panel layout `linear` reads (a new tensor; W is not kept)."""
    w = weight.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError("pack_linear needs a 2-D float32 CPU weight")
    w = w.contiguous()
    n, k = w.shape
    panels = huge_pages.empty(lib.kvscope_linear_packed_floats(n, k), torch.float32)
    lib.kvscope_linear_pack(w.data_ptr(), n, k, panels.data_ptr())
    return panels


def linear(
    lib,
    x: torch.Tensor,
    panels: torch.Tensor,
    n_out: int,
    bias: torch.Tensor | None = None,
    n_threads: int | None = None,
) -> torch.Tensor:
    """x [..., K] fp32 -> x W^T (+ bias) [..., n_out], W packed by pack_linear."""
    k = x.shape[-1]
    if panels.numel() != lib.kvscope_linear_packed_floats(n_out, k):
        raise ValueError(f"packed weight holds {panels.numel()} floats, not a [{n_out}, {k}] weight")
    if bias is not None and (bias.numel() != n_out or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor of {n_out} values")
    return linear_unchecked(lib, x, panels, n_out, bias, n_threads)


def linear_unchecked(
    lib,
    x: torch.Tensor,
    panels: torch.Tensor,
    n_out: int,
    bias: torch.Tensor | None = None,
    n_threads: int | None = None,
) -> torch.Tensor:
    """linear() without the size checks, for callers that made `panels` from a [n_out, K]
    weight themselves (engine/model/linear.py, once per step and layer)."""
    return _run_linear(lib.kvscope_linear, "kvscope_linear", (), x, panels, n_out, bias, n_threads)


def _run_linear(fn, name: str, lead: tuple, x, panels, n_out: int, bias, n_threads) -> torch.Tensor:
    """One call of a packed-Linear C entry point (fp32 or quantized panels): `lead` are the
    arguments before x (the ggml type id for the quantized kernel)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("the linear kernel needs float32 CPU input")
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    y = torch.empty((*x.shape[:-1], n_out), dtype=torch.float32)
    rc = fn(
        *lead,
        x.data_ptr(),
        x.numel() // k if k else 0,
        k,
        panels.data_ptr(),
        n_out,
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        n_threads if n_threads is not None else torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc}")
    return y


QUANT_TYPES = {"Q4_1": 3, "Q8_0": 8, "F16": 1, "BF16": 30}  # ggml type ids the quantized kernel reads
QUANT_BLOCK = {3: (32, 20), 8: (32, 34), 1: (32, 64), 30: (32, 64)}  # type id -> (weights, bytes) per block
HALF_TYPES = {torch.bfloat16: 30, torch.float16: 1}


def half_blocks(weight: torch.Tensor, dtype: torch.dtype):
    """An fp32 weight [N, K] as rows of 16-bit `dtype` values (uint8 [N, 2K]) for qpack, or None
    where some value is not exactly a `dtype` value (widening back would change the weight)."""
    w = weight.detach()
    h = w.to(dtype)
    if not torch.equal(h.to(torch.float32), w):
        return None
    return h.contiguous().view(torch.int16).numpy().view("uint8").reshape(w.shape[0], -1)


def qpack(lib, qtype: int, blocks, n_out: int, k: int, row_map=None) -> torch.Tensor:
    """GGUF blocks (uint8 tensor or array of n_src rows x k/32 blocks) -> the panel layout
    `qlinear` reads (uint8). Output n takes GGUF row row_map[n] (default n)."""
    import numpy as np

    src = np.ascontiguousarray(np.asarray(blocks, dtype=np.uint8))
    per_block = QUANT_BLOCK.get(qtype, (0, 0))
    if not per_block[0] or k % per_block[0]:
        raise ValueError(f"no quantized kernel for ggml type {qtype} at {k} columns")
    n_src = src.size // (k // per_block[0] * per_block[1])
    if src.size != n_src * (k // per_block[0]) * per_block[1]:
        raise ValueError(f"{src.size} bytes are not whole rows of {k} columns")
    rm = np.ascontiguousarray(np.arange(n_out) if row_map is None else np.asarray(row_map), dtype=np.int32)
    if rm.shape != (n_out,):
        raise ValueError(f"row_map needs {n_out} entries")
    out = huge_pages.empty(lib.kvscope_qpanel_bytes(qtype, n_out, k), torch.uint8)
    rc = lib.kvscope_qpack(qtype, src.ctypes.data, n_src, rm.ctypes.data, n_out, k, out.data_ptr())
    if rc != 0:
        raise ValueError(f"kvscope_qpack failed with code {rc}")
    return out


def qunpack(lib, qtype: int, panels: torch.Tensor, n_out: int, k: int) -> torch.Tensor:
    """The fp32 weight [n_out, k] that `qlinear` computes with."""
    w = torch.empty(n_out, k, dtype=torch.float32)
    if lib.kvscope_qunpack(qtype, panels.data_ptr(), n_out, k, w.data_ptr()) != 0:
        raise ValueError("kvscope_qunpack: bad type or sizes")
    return w


def qlinear(
    lib,
    qtype: int,
    x: torch.Tensor,
    panels: torch.Tensor,
    n_out: int,
    bias: torch.Tensor | None = None,
    n_threads: int | None = None,
) -> torch.Tensor:
    """x [..., K] fp32 -> x W^T (+ bias) with W the quantized panels made by qpack."""
    return _run_linear(lib.kvscope_qlinear, "kvscope_qlinear", (qtype,), x, panels, n_out, bias, n_threads)


def tune_row_path(lib) -> int:
    """The faster of the factorized kernel's two bitwise-equal row paths on this CPU, measured (or
    the one KVSCOPE_QL_SCRATCH_ROWS=N names): what the library does when it loads, and what a
    kernel A/B of another build (scripts/qlinear_ab.py) does so that it times the same path."""
    return lib.kvscope_qlinear_scratch_rows(int(os.environ.get("KVSCOPE_QL_SCRATCH_ROWS", "0") or 0))


def ql_scratch_rows(lib, rows: int = -1) -> int:
    """From how many rows the factorized Q4_1 / Q8_0 kernel converts a block's codes once into a
    scratch buffer for every row tile (both paths give the same bits; the library picks the
    faster one when it loads, KVSCOPE_QL_SCRATCH_ROWS=N names one): rows > 0 sets it, 0 measures
    again, -1 reads it. Returns the setting (2**31 - 1: never; 0: no such choice in this build)."""
    return lib.kvscope_qlinear_scratch_rows(rows)


def env_switches(lib) -> None:
    """KVSCOPE_AMX(=0: off), KVSCOPE_AMX_MIN_ROWS, KVSCOPE_KV_SIDE_STEP applied to a library: when it
    loads, and by scripts/qlinear_ab.py to its builds (a switch an older build lacks is skipped)."""
    if hasattr(lib, "kvscope_amx"):
        amx(lib, os.environ.get("KVSCOPE_AMX", "1") != "0")
    if os.environ.get("KVSCOPE_AMX_MIN_ROWS") and hasattr(lib, "kvscope_amx_min_rows"):
        amx_min_rows(lib, int(os.environ["KVSCOPE_AMX_MIN_ROWS"]))
    if os.environ.get("KVSCOPE_KV_SIDE_STEP") and hasattr(lib, "kvscope_kv_side_step"):
        kv_side_step(lib, int(os.environ["KVSCOPE_KV_SIDE_STEP"]))


def amx(lib, on: bool | None = None) -> bool:
    """Whether the process's Q4_1 Linears of amx_min_rows rows or more run on AMX's bf16 tiles
    (csrc/amx_linear.c: x cut into three exact bf16 parts, so each product is exact; the tile
    unit's sums, so not the AVX paths' bits, but a row's result does not depend on its batch among
    those calls; fewer rows take the AVX path). on=True turns it on where the build and the CPU can
    (probed in a child process first; what the library does when it loads, unless KVSCOPE_AMX=0),
    False off, None only reads. Switch it only between forward passes."""
    return bool(lib.kvscope_amx(-1 if on is None else int(on)))


def amx_min_rows(lib, rows: int = -1) -> int:
    """From how many rows a Q4_1 call takes the tiles while amx() is on (8 by default: below ~7 rows
    the AVX path is faster, the tile unit costing about as much for one row as for sixteen;
    KVSCOPE_AMX_MIN_ROWS=N sets it when the library loads): rows > 0 sets it, -1 reads it."""
    return lib.kvscope_amx_min_rows(rows)


def kv_side_step(lib, step: int = -1) -> int:
    """Lines of the next layer's K/V that the stack's Linears prefetch per weight block in decode
    steps of 8 rows or more (csrc/layer.c, kv_side_plan; 0: none; KVSCOPE_KV_SIDE_STEP=N sets it
    when the library loads): step >= 0 sets it, -1 reads it. Returns the setting. Prefetches change
    no arithmetic, so any setting gives the same bits."""
    return lib.kvscope_kv_side_step(step)


def qlinear_bitwise(lib, qtype: int) -> bool:
    """Whether `qlinear` on `qtype` is bitwise the fp32 kernel's result on the de-quantized weight
    (else it sums each block factorized: the same value up to fp32 rounding)."""
    return lib.kvscope_qlinear_bitwise(qtype) == 1


def block_offsets(qtype: int, blocks) -> torch.Tensor | None:
    """|m| per row and block of 32 weights [rows, K / 32] from a GGUF tensor's Q4_1 blocks (w =
    d q + m), the term `within_fp32_rounding` needs for them; None for types without an offset."""
    import numpy as np

    if qtype != 3:
        return None
    b = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1, 20)
    return torch.from_numpy(np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)).abs()


def within_fp32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, offsets=None) -> bool:
    """`got` [M, N] is x w^T (+ bias) up to the rounding of fp32 sums of K products in any order:
    |got - exact| <= (K + 4) u S per output, u = 2^-24, exact taken in float64, S the sum of the
    magnitudes of the terms summed: sum_k |x_k w_k| (+ |bias|), and for a block-factorized sum
    (w = d q + m per block of 32, `offsets` = |m| [N, K / 32]) each block's d * sum(q x) and
    m * sum(x) are summed instead, |d q_k| <= |w_k| + |m|, so 2 |m| sum_k |x_k| is added per block.
    (The classical bound on a recursively summed dot product, with slack for the factorized form's
    extra roundings.)"""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T
    scale = xd.abs() @ wd.abs().T
    if offsets is not None:
        xsum = xd.abs().reshape(x.shape[0], -1, 32).sum(-1)  # [M, K / 32]
        scale = scale + 2 * xsum @ offsets.double().T
    if bias is not None:
        exact = exact + bias.double()
        scale = scale + bias.double().abs()
    bound = (x.shape[-1] + 4) * 2.0**-24 * scale
    return bool(((got.double() - exact).abs() <= bound).all())


def _self_test_linear(lib) -> None:
    """The packed matmul against F.linear at several row counts, with and without bias, on a
    weight whose row count is not a multiple of the panel width."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 70, generator=g)
    b = torch.randn(37, generator=g)
    panels = pack_linear(lib, w)
    for m in (1, 5, 6, 13):
        x = torch.randn(m, 70, generator=g)
        for bias in (None, b):
            got = linear(lib, x, panels, 37, bias, 2)
            if not torch.allclose(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5):
                raise RuntimeError("self-test: packed linear disagrees with F.linear")


def _self_test(lib) -> None:
    """Compares the kernel with SDPA on random blocks (GQA, ragged lengths, shuffled tables)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, h, d = 24, 4, 2, 6, 16
    k_pool = torch.randn(nb, bs, hkv, d, generator=g)
    v_pool = torch.randn(nb, bs, hkv, d, generator=g)
    lens = [1, 7, 13, 20]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, off = [], 0
    for n in lens:
        m = kv_layout.cdiv(n, bs)
        tables.append(perm[off : off + m] + [perm[off]] * (5 - m))
        off += m
    q = torch.randn(len(lens) + 1, h, d, generator=g)
    out = torch.zeros_like(q)
    rows = torch.tensor([4, 0, 2, 1], dtype=torch.int32)
    paged_decode_attention(
        lib,
        out,
        q,
        k_pool,
        v_pool,
        rows,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        0.25,
        max(lens),
        2,
    )
    for s, n in enumerate(lens):
        blocks = torch.tensor(tables[s])
        k = k_pool[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        v = v_pool[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[rows[s]][None, :, None], k, v, scale=0.25, enable_gqa=True)
        if not torch.allclose(out[rows[s]], ref[0, :, 0], atol=1e-5, rtol=1e-5):
            raise RuntimeError("self-test: kernel disagrees with SDPA")
    if out[3].abs().sum() != 0:
        raise RuntimeError("self-test: kernel wrote a row it was not given")
