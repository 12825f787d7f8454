"""Packed and merged linear layers for the engine's forward pass on CPU.

The HF model's nn.Linear modules keep their weights and their place in the model's own layer
code; inside the engine's forward (and only there) each one computes with a copy of its weight
packed once for a faster kernel, and sibling projections that read the same input run as one
matmul, as vLLM merges them: q/k/v -> "qkv", gate/up -> "gate_up". Everyone else calling the
same model object (transformers' `generate`, a benchmark peer, a deep copy) gets plain `F.linear`.

Kernels, in order of preference:
- "cpu_kernel": engine/model/csrc/linear.c (16-column panels, register-tiled; engine/model/cpu_kernels.py
  builds it). Each output is summed in the same order whatever the row count, so a request's
  logits do not depend on what it is batched with.
- "onednn": `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, where the C kernel
  cannot be built.
Their measured times are in docs/BENCHMARKS.md.

With weight_format="gguf" (a model loaded from a GGUF file), each Linear whose GGUF tensor is
Q4_1 or Q8_0 computes from the file's own blocks instead (engine/model/csrc/quant_linear.c, blocks from
engine/model/gguf_weights.py): 5 / 8.5 bits read per weight instead of 32, the same outputs as the fp32
packed kernel on the de-quantized weight (which transformers holds) bitwise, or, where the kernel
sums each block factorized (Q4_1 / Q8_0 with AVX2 or AVX-512), within fp32 rounding of the exact product.
That is checked when the pack is made (the widened blocks equal the HF weight; the outputs at 1, 3
and 7 rows equal the fp32 kernel's, or are within the rounding bound; the last row alone gives the
same bits as in its batch); a group that fails it keeps fp32 panels. weight_format="bf16" /
"fp16" does the same for fp32 weights that are exactly 16-bit values (a bf16 checkpoint loaded in
fp32): held at 16 bits, widened exactly, half the bytes read.

A pack is made per (model object, weight format) and shared by every engine on it; it is checked
against `F.linear` on a random input when made, and not used when that check fails.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref

import torch
import torch.nn.functional as F

from engine.config import WEIGHT_FORMATS as CONFIG_WEIGHT_FORMATS
from engine.model import cpu_kernels

MERGED_GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")))
ONEDNN_ROWS_HINT = 16  # the row count oneDNN's blocked layout is tuned for (decode batches)
_tls = threading.local()
_packs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {weight_format: ModelPack}
_pack_lock = threading.Lock()


def onednn_ops():
    try:
        ops = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return ops if torch.backends.mkldnn.is_available() else None


def best_kernel() -> str | None:
    """The fastest packed-Linear kernel this process can run: "cpu_kernel", "onednn" or None."""
    if cpu_kernels.load() is not None:
        return "cpu_kernel"
    return "onednn" if onednn_ops() is not None else None


def matmul_for(weights: list[torch.Tensor], bias: torch.Tensor | None = None, kernel: str | None = None):
    """x -> x [W_1; W_2; ...]^T (+ bias) with the weights stacked along the output dimension and
    packed for `kernel` (default: best_kernel()). The engine's merged Linears are made with this;
    so is the benchmark's measurement of them."""
    kernel = kernel or best_kernel()
    w = torch.cat([x.detach() for x in weights], dim=0) if len(weights) > 1 else weights[0].detach()
    if kernel == "cpu_kernel":
        lib = cpu_kernels.load()
        panels = cpu_kernels.pack_linear(lib, w)
        n, k = w.shape
        if bias is not None and (bias.numel() != n or bias.dtype != torch.float32):
            raise ValueError(f"bias of {bias.numel()} values for {n} outputs")
        bias = bias.contiguous() if bias is not None else None

        def matmul(x):
            if x.shape[-1] != k:
                raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
            return cpu_kernels.linear_unchecked(lib, x, panels, n, bias)

        matmul.raw = (-1, panels, n, k, bias)  # what engine/model/fused_decode.py hands the C layer
        return matmul
    if kernel == "onednn":
        reorder, apply = onednn_ops()
        packed = reorder(w.contiguous(), ONEDNN_ROWS_HINT)
        return lambda x: apply(x, packed, bias, "none", [], "")
    raise ValueError(f"no packed-Linear kernel {kernel!r} here")


class _Group:
    """One matmul over several sibling Linears' weights stacked along the output dimension."""

    __slots__ = ("name", "matmul", "splits", "__weakref__")

    def __init__(self, name: str, matmul, splits: list[int]):
        self.name = name
        self.matmul = matmul
        self.splits = splits


class ModelPack:
    """The packed weights of one model: module -> (group, index of its slice)."""

    def __init__(self, kernel: str, weight_format: str = "fp32"):
        self.kernel = kernel
        self.weight_format = weight_format
        self.members: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.num_linears = 0
        self.num_merged = 0
        self.bytes = 0  # weight bytes the packed Linears read per forward pass
        self.formats: dict[str, int] = {}  # "Q4_1" / "Q8_0" / "fp32" -> Linears computing from it


WEIGHT_FORMATS = tuple(f for f in CONFIG_WEIGHT_FORMATS if f != "auto")  # what "auto" resolves among
HALF_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class _HalfTensor:
    """A Linear's fp32 weight held as exact 16-bit values, in the shape of a GGUF QuantTensor."""

    type_name: str
    type_id: int
    blocks: object
    rows: object
    shape: tuple


def _half_tensor(weight: torch.Tensor, fmt: str):
    import numpy as np

    dtype = HALF_FORMATS[fmt]
    if weight.shape[1] % 32:
        return None
    blocks = cpu_kernels.half_blocks(weight, dtype)
    if blocks is None:
        return None
    return _HalfTensor(
        {"bf16": "BF16", "fp16": "F16"}[fmt],
        cpu_kernels.HALF_TYPES[dtype],
        blocks,
        np.arange(weight.shape[0]),
        tuple(weight.shape),
    )


def half_exact(model, fmt: str) -> bool:
    """Every packable Linear weight of `model` is exactly a `fmt` ("bf16"/"fp16") value (as a
    bf16 checkpoint loaded in fp32 is), with whole blocks of 32 columns."""
    mods = [m for m in model.modules() if _eligible(m)]
    dtype = HALF_FORMATS[fmt]
    return bool(mods) and all(
        m.weight.shape[1] % 32 == 0 and torch.equal(m.weight.detach().to(dtype).float(), m.weight.detach())
        for m in mods
    )


def _quant_matmul(lib, qtype: int, panels: torch.Tensor, n: int, k: int, bias):
    def matmul(x):
        if x.shape[-1] != k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {k}")
        return cpu_kernels.qlinear(lib, qtype, x, panels, n, bias)

    matmul.raw = (qtype, panels, n, k, bias)  # what engine/model/fused_decode.py hands the C layer
    return matmul


def _quant_group(name: str, mods: list, qts: list, bias):
    """A _Group computing from the GGUF blocks of `mods`, or None where they do not reproduce the
    HF weights bit for bit, or the kernel's outputs are not the fp32 kernel's (bitwise, where the
    kernel sums in its order) or within fp32 rounding of the exact product (where it factorizes
    by block), or a row's result depends on its batch."""
    import numpy as np

    lib = cpu_kernels.load()
    qtype = qts[0].type_id
    if lib is None or len({q.type_id for q in qts}) != 1:
        return None, 0
    n = sum(q.shape[0] for q in qts)
    k = qts[0].shape[1]
    blocks = np.concatenate([q.blocks[q.rows] for q in qts]) if len(qts) > 1 else qts[0].blocks[qts[0].rows]
    panels = cpu_kernels.qpack(lib, qtype, blocks, n, k)
    w = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
    if not torch.equal(cpu_kernels.qunpack(lib, qtype, panels, n, k), w):
        return None, 0
    matmul = _quant_matmul(lib, qtype, panels, n, k, bias)
    g = torch.Generator().manual_seed(0)
    bitwise = cpu_kernels.qlinear_bitwise(lib, qtype)
    fp32 = cpu_kernels.pack_linear(lib, w) if bitwise else None
    offsets = None if bitwise else cpu_kernels.block_offsets(qtype, blocks)

    def agrees(x, y):
        if bitwise:
            return torch.equal(y, cpu_kernels.linear(lib, x, fp32, n, bias))
        return cpu_kernels.within_fp32_rounding(y, x, w, bias, offsets)

    xs, ys = [], []
    for rows in (1, 3, 7):
        x = torch.randn(rows, k, generator=g)
        y = matmul(x)
        if not torch.equal(matmul(x[-1:])[0], y[-1]):
            return None, 0
        xs.append(x)
        ys.append(y)
    if not agrees(torch.cat(xs), torch.cat(ys)):  # one check of all 11 rows: the weight widened to float64 once
        return None, 0
    return _Group(name, matmul, [m.weight.shape[0] for m in mods]), panels.numel()


def _eligible(m) -> bool:
    return (
        type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and m.weight.dim() == 2
    )


def _check(group: _Group, weights: list[torch.Tensor], biases: list) -> bool:
    """The packed matmul must agree with F.linear (the same values up to fp32 rounding)."""
    k = weights[0].shape[1]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    got = group.matmul(x)
    ref = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    tol = 1e-4 * (1 + ref.abs().max().item())
    return got.shape == ref.shape and bool(torch.isfinite(got).all()) and (got - ref).abs().max().item() <= tol


def pack_model(
    model, kernel: str | None = None, weight_format: str = "fp32", gguf_path: str | None = None
) -> ModelPack | None:
    """Packs (once per model object and weight format) every plain fp32 CPU nn.Linear of `model`,
    merging q/k/v and gate/up where a module has them. weight_format="gguf": the Linears whose
    tensors in the GGUF file `gguf_path` are Q4_1 / Q8_0 / F16 / BF16 compute from those blocks;
    "bf16" / "fp16": the Linears whose fp32 weights are exactly such values are held and read at
    16 bits (the C kernel only). Returns None where no packed kernel runs here."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    kernel = kernel or best_kernel()
    if kernel is None:
        return None
    if weight_format != "fp32" and (kernel != "cpu_kernel" or (weight_format == "gguf" and not gguf_path)):
        return None
    with _pack_lock:
        per_model = _packs.setdefault(model, {})
        if weight_format in per_model:
            return per_model[weight_format]
        pack = ModelPack(kernel, weight_format)
        try:
            quant = {}
            names = {m: n for n, m in model.named_modules()}
            if weight_format == "gguf":
                from engine.model.gguf_weights import read_quant_tensors

                quant = read_quant_tensors(gguf_path, model, cpu_kernels.QUANT_TYPES)
            elif weight_format in HALF_FORMATS:
                quant = {names[m]: _half_tensor(m.weight, weight_format) for m in model.modules() if _eligible(m)}
            with torch.inference_mode():
                done = set()
                for parent in model.modules():
                    for name, members in MERGED_GROUPS:
                        mods = [getattr(parent, a, None) for a in members]
                        if not all(_eligible(m) for m in mods):
                            continue
                        if len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
                            continue
                        _add(pack, name, mods, [quant.get(names[m]) for m in mods])
                        done.update(id(m) for m in mods)
                        pack.num_merged += 1
                for m in model.modules():
                    if _eligible(m) and id(m) not in done:
                        _add(pack, type(m).__name__, [m], [quant.get(names[m])])
        except Exception:  # an op this build lacks, or a failed self-check: plain F.linear
            if not any(p is not pack for p in per_model.values()):
                _unpatch(pack)
            return None
        per_model[weight_format] = pack
        return pack


def _add(pack: ModelPack, name: str, mods: list, qts: list) -> None:
    ws = [m.weight for m in mods]
    bs = [m.bias for m in mods]
    bias = None if bs[0] is None else torch.cat([b.detach() for b in bs]).contiguous()
    group, nbytes = None, 0
    if qts and all(q is not None for q in qts):
        group, nbytes = _quant_group(name, mods, qts, bias)
    if group is not None:
        pack.formats[qts[0].type_name] = pack.formats.get(qts[0].type_name, 0) + len(mods)
    else:
        group = _Group(name, matmul_for(ws, bias, pack.kernel), [w.shape[0] for w in ws])
        if not _check(group, ws, bs):
            raise RuntimeError(f"packed {name} disagrees with F.linear")
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        pack.formats["fp32"] = pack.formats.get("fp32", 0) + len(mods)
    for i, m in enumerate(mods):
        pack.members[m] = (group, i)
        m.forward = types.MethodType(_forward, m)  # bound: a deep copy rebinds to the copy
    pack.num_linears += len(mods)
    pack.bytes += nbytes


def _unpatch(pack: ModelPack) -> None:
    for m in list(pack.members.keys()):
        m.__dict__.pop("forward", None)


def _forward(self, x):
    pack = getattr(_tls, "pack", None)
    entry = pack.members.get(self) if pack is not None else None
    if entry is None or x.dtype != torch.float32:  # not inside an engine forward (or a copy)
        return F.linear(x, self.weight, self.bias)
    group, i = entry
    if len(group.splits) == 1:
        return group.matmul(x)
    stash = _tls.stash
    hit = stash.get(group)
    if hit is None or hit[0] is not x:
        hit = [x, group.matmul(x).split(group.splits, dim=-1), len(group.splits)]
        stash[group] = hit
    hit[2] -= 1
    if hit[2] == 0:
        del stash[group]
    return hit[1][i]


class packed_linears:
    """Within the block (this thread only), the packed model's Linears use their packed weights."""

    def __init__(self, pack: ModelPack | None):
        self.pack = pack

    def __enter__(self):
        self.prev = (getattr(_tls, "pack", None), getattr(_tls, "stash", None))
        _tls.pack = self.pack
        _tls.stash = {}
        return self.pack

    def __exit__(self, *exc):
        _tls.pack, _tls.stash = self.prev
