"""The C decode/verify path: every decoder layer of a Llama-family model in kvscope's own C
(engine/model/csrc/layer.c), one call per step for the whole stack, and the final norm, no
transformers module between the embedding and the lm_head.

Per step Python does only: the embedding lookup (`kvscope_gather_rows`), cos / sin for these
positions (rows of a table the model's own rotary module computed once, so its inv_freq and rope
scaling are the model's; the module itself each step where its RoPE type changes with the length),
the per-row block tables, one `kvscope_stack_forward` call, `kvscope_rmsnorm_rows` (the layers'
RMSNorm) on the rows whose logits are needed, then the lm_head on them. A step of up to BUF_ROWS
rows makes no torch op before the lm_head (its buffers are kept across steps, its integer inputs
are ctypes arrays): after the stack's weight stream each torch op cost 10-40 us, 0.35 ms of a
3.9 ms batch-1 step at 2 threads on a 2-core Xeon, now 0.17-0.18. Each layer in C: RMSNorm, the
merged q/k/v Linear (engine/model/linear.py's packed panels: fp32, or the GGUF's Q4_1 / Q8_0 blocks
read in place), rotary, K/V written to the fp32 pool at
the slot mapping, paged attention read in place (every token is a query row over its sequence up
to itself: decode, speculative verification and prefill chunks alike), o_proj + residual,
RMSNorm, gate/up, SiLU-mul, down + residual.

`EngineConfig.decode_backend`: "c" requires this path (a clear error says why it cannot run),
"transformers" never uses it, "auto" uses it where `unsupported_reason` is None. The transformers
layer code stays the reference (tests/engine/test_fused_decode.py compares logits).
Set KVSCOPE_LAYER_PROFILE=1 to accumulate per-op seconds in `FusedStack.prof`.
"""

from __future__ import annotations

import ctypes
import itertools
import os

import torch

from engine.config import DECODE_BACKENDS  # noqa: F401 (the one list, engine/config.py; runner.py checks it)
from engine.model import cpu_kernels

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
PROF_OPS = ("norm1", "qkv", "rope+kv_write", "attention", "o_proj", "res+norm2", "gate_up+silu", "down+res")
LINEAR_OPS = ("qkv", "o_proj", "gate_up+silu", "down+res")  # the PROF_OPS that are the layer's Linears
BUF_ROWS = 64  # steps of up to this many rows reuse FusedStack.buf's buffers


def _c_struct(name: str, fields: list[tuple[str, type]]) -> type[ctypes.Structure]:
    """A ctypes Structure laid out as engine/model/csrc/layer.c's struct of the same role: `fields` are
    (names, ctype) in the C order, names sharing one ctype written space-separated."""
    return type(name, (ctypes.Structure,), {"_fields_": [(n, ct) for names, ct in fields for n in names.split()]})


_P, _I = ctypes.c_void_p, ctypes.c_int
_Lin = _c_struct("_Lin", [("type n k", _I), ("panels bias", _P)])  # one packed Linear group
_Layer = _c_struct(
    "_Layer",
    [
        ("norm1 norm2", _P),
        ("eps", ctypes.c_float),
        ("hidden H Hkv D inter", _I),
        ("qkv o gate_up down", _Lin),
        ("k_pool v_pool", _P),
    ],
)


def _linear_groups(layer) -> tuple[tuple[str, str, list], ...]:
    """(descriptor field, name in messages, modules) of the four packed Linear groups of a layer."""
    att, mlp = layer.self_attn, layer.mlp
    return (
        ("qkv", "qkv", [att.q_proj, att.k_proj, att.v_proj]),
        ("o", "o_proj", [att.o_proj]),
        ("gate_up", "gate_up", [mlp.gate_proj, mlp.up_proj]),
        ("down", "down_proj", [mlp.down_proj]),
    )


def _raw(pack, mods: list):
    """(type, panels, n, k, bias) of the one packed group computing exactly `mods`, or None."""
    entries = [pack.members.get(m) for m in mods]
    if any(e is None for e in entries) or len({id(e[0]) for e in entries}) != 1:
        return None
    group = entries[0][0]
    if [e[1] for e in entries] != list(range(len(mods))) or len(group.splits) != len(mods):
        return None
    return getattr(group.matmul, "raw", None)


def _lin(raw) -> _Lin:
    qtype, panels, n, k, bias = raw
    return _Lin(qtype, n, k, panels.data_ptr(), bias.data_ptr() if bias is not None else None)


def unsupported_reason(runner) -> str | None:
    """Why this runner's model / pool cannot take the C path (None: it can)."""
    model = runner.model
    cfg = model.config
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return "the C decode path runs on CPU in float32 only"
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES or not runner.fast:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {SUPPORTED_TYPES}"
    if runner.kv_format != "fp32":
        return f"kv_cache_dtype {runner.kv_format!r}: the C decode path reads an fp32 pool only"
    if runner.linear_pack is None or runner.linear_pack.kernel != "cpu_kernel":
        return f"the packed C Linears are not in use ({cpu_kernels.status()})"
    if runner.attention_backend != "cpu_kernel":
        return f"attention_backend is {runner.attention_backend!r}, not the CPU paged kernel"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (cfg.model_type != "qwen2" or getattr(cfg, "use_sliding_window", False)):
        return "sliding-window attention is not in the C decode path"
    if not cpu_kernels.supports(cfg.num_attention_heads, runner.num_kv_heads, runner.head_dim):
        return "head shapes outside the paged-attention kernel's"
    for layer in model.model.layers[: runner.num_layers]:
        if any(hasattr(layer.self_attn, a) for a in ("q_norm", "k_norm")):
            return "per-head q/k norms are not in the C decode path"
        for _, name, mods in _linear_groups(layer):
            if _raw(runner.linear_pack, mods) is None:
                return f"{name} is not one packed C group"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or norm.weight.dtype != torch.float32:
                return "a layer norm is not an fp32 RMSNorm"
    final = model.model.norm
    if not hasattr(final, "variance_epsilon") or final.weight.dtype != torch.float32:
        return "the final norm is not an fp32 RMSNorm"
    return None


class FusedStack:
    """The C descriptors of one runner's layers (pointers into its packs and pools)."""

    def __init__(self, runner):
        self.runner = runner
        self.lib = cpu_kernels.load()
        cfg = runner.model.config
        layers = runner.model.model.layers[: runner.num_layers]
        pack = runner.linear_pack
        self.descs = (_Layer * len(layers))()
        self.keep = []
        for i, layer in enumerate(layers):
            n1 = layer.input_layernorm.weight.detach().contiguous()
            n2 = layer.post_attention_layernorm.weight.detach().contiguous()
            k_pool, v_pool = runner.kv_caches[i]
            self.keep += [n1, n2]
            d = self.descs[i]
            d.norm1, d.norm2 = n1.data_ptr(), n2.data_ptr()
            d.eps = float(layer.input_layernorm.variance_epsilon)
            d.hidden = cfg.hidden_size
            d.H, d.Hkv, d.D = cfg.num_attention_heads, runner.num_kv_heads, runner.head_dim
            d.inter = layer.mlp.gate_proj.out_features
            for field, _, mods in _linear_groups(layer):
                setattr(d, field, _lin(_raw(pack, mods)))
            d.k_pool, d.v_pool = k_pool.data_ptr(), v_pool.data_ptr()
        final = runner.model.model.norm
        self.norm_w, self.norm_eps = final.weight.detach().contiguous(), float(final.variance_epsilon)
        self.scale = float(layers[0].self_attn.scaling)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        emb = runner.model.model.embed_tokens
        plain = type(emb) is torch.nn.Embedding and emb.weight.dtype == torch.float32 and emb.weight.is_contiguous()
        self.embed_w = emb.weight.detach() if plain else None  # rows gathered in C (else the module)
        self.bufs: dict = {}  # buffers of small steps (BUF_ROWS): storage by name, views by (name, rows, cols)
        rope_type = str(getattr(runner.model.model.rotary_emb, "rope_type", "default"))
        self.rope_static = "dynamic" not in rope_type and rope_type != "longrope"
        self.prof = torch.zeros(len(PROF_OPS), dtype=torch.float64)
        self.profile = os.environ.get("KVSCOPE_LAYER_PROFILE", "0") == "1"

    def profile_start(self) -> None:
        """The per-op timer on, from zero (seconds accumulate in `prof`, one pair of clock reads per
        op and layer)."""
        self.profile = True
        self.prof.zero_()

    def profile_stop(self) -> dict[str, float]:
        """The timer off; seconds per op (PROF_OPS) since profile_start."""
        self.profile = False
        return dict(zip(PROF_OPS, self.prof.tolist()))

    def buf(self, name: str, t: int, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols] fp32 buffer for a step of t rows: for steps of up to BUF_ROWS rows
        (decode, verification, a batch of decodes) a view kept across steps (one storage per name,
        grown as needed), so such a step makes no torch allocation (each torch op after the stack's
        weight stream costs 10-40 us here); else a fresh one. `run` returns none of them."""
        if t > BUF_ROWS:
            return torch.empty(rows, cols, dtype=torch.float32)
        view = self.bufs.get((name, rows, cols))
        if view is None:
            store = self.bufs.get(name)
            if store is None or store.numel() < rows * cols:
                store = self.bufs[name] = torch.empty(rows * cols, dtype=torch.float32)
                self.bufs = {k: v for k, v in self.bufs.items() if not (isinstance(k, tuple) and k[0] == name)}
            view = self.bufs[(name, rows, cols)] = store[: rows * cols].view(rows, cols)
        return view

    def rope(self, h: torch.Tensor, pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] fp32 of these positions, computed by the model's rotary module: once for
        a table of positions 0..n-1 (grown to a power of two past the largest asked) whose rows are
        picked here (kvscope_gather_rows), where its RoPE type is static (each position's row is the
        same elementwise arithmetic either way, so the same bits: tests/engine/test_fused_decode.py);
        else the module on these positions each step. The table saves its ~6 torch ops a step
        (0.05-0.1 ms on a 2-core Zen 5, the step's weight stream having left them cold)."""
        rotary = self.runner.model.model.rotary_emb
        if not self.rope_static:
            cos, sin = rotary(h.unsqueeze(0), position_ids=torch.tensor(pos).unsqueeze(0))
            return cos[0].float().contiguous(), sin[0].float().contiguous()
        top = max(pos) + 1
        if self.rope_table is None or self.rope_table[0].shape[0] < top:
            n = 1 << max(top - 1, 1023).bit_length()
            cos, sin = rotary(h[:1].unsqueeze(0), position_ids=torch.arange(n).unsqueeze(0))
            self.rope_table = (cos[0].float().contiguous(), sin[0].float().contiguous())
        t, d = len(pos), self.rope_table[0].shape[1]
        idx = (ctypes.c_int32 * t)(*pos)
        cos, sin = self.buf("cos", t, t, d), self.buf("sin", t, t, d)
        for table, out in zip(self.rope_table, (cos, sin)):
            self.gather(table, idx, t, out, "position")
        return cos, sin

    def gather(self, src: torch.Tensor, idx, n: int, out: torch.Tensor, what: str) -> None:
        """out[i] = src[idx[i]] (kvscope_gather_rows); an index outside src's rows is a clear error,
        never a read past the table."""
        rc = self.lib.kvscope_gather_rows(src.data_ptr(), src.shape[0], src.shape[1], idx, n, out.data_ptr())
        if rc:
            raise ValueError(f"{what} {idx[-1 - rc]} is outside [0, {src.shape[0]})")

    def run(self, flat, tables: list[list[int]], num_layers: int | None = None) -> torch.Tensor:
        """One forward of a flattened batch (runner.FlatBatch: token ids, positions, logit rows and
        the slot mapping where each token's K/V is written); `tables[i]` is token i's block table
        up to itself, padded to one width (runner.query_tables / padded_tables)."""
        r = self.runner
        bs = r.block_size
        ids, pos, logit_rows = flat.ids, flat.positions, flat.logit_rows
        t = len(ids)
        mb = len(tables[0])
        # the stack's integer inputs: in a step of up to BUF_ROWS rows ctypes arrays, so that with
        # its float buffers kept across steps it makes no torch op before the lm_head (0.045 ms a
        # batch-1 step here); a prefill chunk's long lists build into tensors twice as fast as into
        # ctypes arrays (11 against 22 ms for a 512 x 500 block table), kept alive in `keep`
        if t <= BUF_ROWS:
            tab32 = (ctypes.c_int32 * (t * mb))(*itertools.chain.from_iterable(tables))
            lens32 = (ctypes.c_int32 * t)(*[p + 1 for p in pos])
            rows32 = (ctypes.c_int32 * t)(*range(t))
            slots64 = (ctypes.c_int64 * t)(*flat.slots)
        else:
            keep = (
                torch.tensor(tables, dtype=torch.int32),
                torch.tensor([p + 1 for p in pos], dtype=torch.int32),
                torch.arange(t, dtype=torch.int32),
                torch.tensor(flat.slots, dtype=torch.int64),
            )
            tab32, lens32, rows32, slots64 = (x.data_ptr() for x in keep)
        inner = r.model.model
        d0 = self.descs[0]
        if self.embed_w is not None:
            h = self.buf("h", t, t, d0.hidden)
            self.gather(self.embed_w, (ctypes.c_int32 * t)(*ids), t, h, "token id")
        else:
            h = inner.embed_tokens(torch.tensor(ids)).contiguous()  # [T, hidden], a fresh tensor
        cos, sin = self.rope(h, pos)
        n_scratch = self.lib.kvscope_layer_scratch_floats(t, d0.hidden, d0.H, d0.Hkv, d0.D, d0.inter)
        scratch = self.buf("scratch", t, 1, n_scratch)
        n_layers = min(num_layers or len(self.descs), len(self.descs))
        rc = self.lib.kvscope_stack_forward(
            self.descs,
            n_layers,
            h.data_ptr(),
            t,
            cos.data_ptr(),
            sin.data_ptr(),
            slots64,
            rows32,
            lens32,
            tab32,
            t,
            mb,
            bs,
            self.scale,
            max(pos) + 1,
            torch.get_num_threads(),
            scratch.data_ptr(),
            self.prof.data_ptr() if self.profile else None,
        )
        if rc != 0:
            raise RuntimeError(f"kvscope_stack_forward failed with code {rc}")
        # the final norm of the logit rows in C (the layers' RMSNorm), then the lm_head
        hn = self.buf("hn", t, len(logit_rows), h.shape[1])
        rows = (ctypes.c_int32 * len(logit_rows))(*logit_rows)
        self.lib.kvscope_rmsnorm_rows(
            h.data_ptr(), rows, len(logit_rows), self.norm_w.data_ptr(), self.norm_eps, h.shape[1], hn.data_ptr()
        )
        return r.model.lm_head(hn).float()
