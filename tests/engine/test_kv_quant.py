"""engine/model/kv_quant.py and the quantized K/V pool: write -> read error within the scale formula
(hypothesis), the C decode kernel equal to the torch path on every pool format, the byte budget's
capacity from memory_math's formula, and int8 runs through preemption (recompute, swap), prefix
caching and speculation that keep the invariants and give the same tokens as a plain int8 run
(every stored byte is a function of its own token's K/V, whatever the schedule).

No exactness against transformers is claimed for quantized pools (bench kvquant measures the
agreement); fp32 pools stay exact (tests/test_exactness.py).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams
from engine.lab import memory_math as mm
from engine.model import cpu_kernels, kv_quant
from tests.engine.engines import tiny_engine, token_ids

FP32_EPS = 2.0**-23
finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_subnormal=False, width=32)
# rows whose largest magnitude keeps the scale a normal float32 (K/V rows of ~1e-30 do not occur;
# below that the scale itself loses precision)
rows = st.lists(finite, min_size=4, max_size=64).filter(
    lambda v: len(v) % 4 == 0 and (max(map(abs, v)) == 0 or max(map(abs, v)) >= 1e-30)
)


def roundtrip(values, fmt):
    x = torch.tensor(values, dtype=torch.float32)[None]
    packed = kv_quant.quantize(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (1, len(values) + kv_quant.SCALE_BYTES)
    s = packed[0, len(values) :].contiguous().view(torch.float32).item()
    return x[0], kv_quant.dequantize(packed, fmt)[0], s


@settings(max_examples=300, deadline=None)
@given(rows)
def test_int8_roundtrip_error_is_at_most_half_a_step(values):
    x, got, s = roundtrip(values, "int8")
    amax = x.abs().max().item()
    assert s == pytest.approx(amax / 127, rel=2 * FP32_EPS, abs=0)
    bound = s / 2 * (1 + 2**-16) + x.abs() * 2 * FP32_EPS
    assert bool(((x - got).abs() <= bound).all()), ((x - got).abs() - bound).max()
    if amax == 0:
        assert not got.any()


@settings(max_examples=300, deadline=None)
@given(rows)
def test_fp8_roundtrip_error_is_within_three_mantissa_bits(values):
    x, got, s = roundtrip(values, "fp8_e4m3")
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 in the normal range; below it (|x/s| < 2^-6)
    # subnormal spacing 2^-9, so absolute error <= 2^-10 * s
    bound = x.abs() * (2**-4 + 4 * FP32_EPS) + s * 2**-10
    assert bool(((x - got).abs() <= bound).all()), ((x - got).abs() - bound).max()
    assert got.abs().max() <= x.abs().max() * (1 + 4 * FP32_EPS)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8", "fp8_e4m3"])
def test_write_then_read_at_slots_and_zeros_read_as_zeros(fmt):
    pool = kv_quant.allocate(fmt, 4, 2, 3, 8, "cpu")
    assert not kv_quant.widen(pool, fmt, torch.float32).any()
    x = torch.randn(3, 3, 8, generator=torch.Generator().manual_seed(0))
    kv_quant.write(pool, torch.tensor([5, 0, 2]), x, fmt)
    flat = kv_quant.widen(pool.view(-1, *pool.shape[2:]), fmt, torch.float32)
    tol = {"fp32": 0, "bf16": 2**-8, "fp16": 2**-11, "int8": 1 / 127, "fp8_e4m3": 2**-4}[fmt]
    for i, slot in enumerate([5, 0, 2]):
        assert torch.allclose(flat[slot], x[i], atol=tol * x[i].abs().max().item(), rtol=0)
    assert not flat[[1, 3, 4, 6, 7]].any()


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(
        ValueError,
        match=r"^kv_cache_dtype must be one of \('auto', 'fp32', 'bf16', 'fp16', "
        r"'fp8_e4m3', 'int8', 'int4', 'int2'\), got 'int3'$",
    ):
        EngineConfig(kv_cache_dtype="int3")


# ---------------------------------------------------------------- the C decode kernel on every format


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8", "fp8_e4m3"])
def test_kernel_equals_torch_path_on_pool(fmt):
    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip(f"CPU kernel not built: {cpu_kernels.status()}")
    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, h, d = 24, 4, 2, 6, 16
    k_pool = kv_quant.allocate(fmt, nb, bs, hkv, d, "cpu")
    v_pool = kv_quant.allocate(fmt, nb, bs, hkv, d, "cpu")
    slots = torch.arange(nb * bs)
    kv_quant.write(k_pool, slots, torch.randn(nb * bs, hkv, d, generator=g) * 3, fmt)
    kv_quant.write(v_pool, slots, torch.randn(nb * bs, hkv, d, generator=g), fmt)
    lens = [1, 7, 13, 20]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, off = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[off : off + m] + [perm[off]] * (5 - m))
        off += m
    q = torch.randn(len(lens), h, d, generator=g)
    out = torch.zeros_like(q)
    cpu_kernels.paged_decode_attention(
        lib,
        out,
        q,
        k_pool,
        v_pool,
        torch.arange(len(lens), dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        0.25,
        max(lens),
        2,
        kv_format=kv_quant.KERNEL_CODES[fmt],
    )
    for s, n in enumerate(lens):
        blocks = torch.tensor(tables[s])
        k = kv_quant.widen(k_pool[blocks], fmt, torch.float32).reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        v = kv_quant.widen(v_pool[blocks], fmt, torch.float32).reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[s][None, :, None], k, v, scale=0.25, enable_gqa=True)
        assert torch.allclose(out[s], ref[0, :, 0], atol=1e-5, rtol=1e-5)


PROMPTS = [
    "hello world",
    "the cat sat on the mat and the cat sat on the",
    "1 2 3 4 5 6 7 8",
    "Once upon a time",
    "a b a b a b a b a b",
    "Paris is the capital of",
    "x",
    "zzz zzz zzz zzz",
]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def run(eng, prompts=PROMPTS, params=PARAMS, check=True):
    return token_ids(eng, prompts, params, check=check)


tiny = tiny_engine


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "bf16"])
def test_engine_kernel_and_torch_attention_give_the_same_tokens(fmt):
    a = run(tiny(kv_cache_dtype=fmt), check=False)
    eng = tiny(kv_cache_dtype=fmt, attention_backend="torch")
    assert eng.info().attention_backend == "torch"
    assert run(eng, check=False) == a


# ---------------------------------------------------------------- capacity


def test_byte_budget_holds_the_formulas_tokens():
    budget = 1 << 20
    fp32 = tiny(kv_cache_bytes=budget, block_size=16)
    i8 = tiny(kv_cache_bytes=budget, block_size=16, kv_cache_dtype="int8")
    f8 = tiny(kv_cache_bytes=budget, block_size=16, kv_cache_dtype="fp8_e4m3")
    bf = tiny(kv_cache_bytes=budget, block_size=16, kv_cache_dtype="bf16")
    # tiny model: 2 layers x 2 KV heads x head_dim 16; int8 rows are 16 codes + a 4-byte scale
    assert fp32.bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert i8.bytes_per_token == f8.bytes_per_token == 2 * 2 * 2 * (16 + 4) == 160
    assert bf.bytes_per_token == 256
    for e in (fp32, i8, f8, bf):
        assert e.num_blocks == budget // (16 * e.bytes_per_token)
        assert e.info().kv_cache_bytes <= budget
        k, v = e.runner.kv_caches[0]
        assert (
            k.numel() * k.element_size() + v.numel() * v.element_size()
        ) * e.runner.num_layers == e.num_blocks * e.bytes_per_block
    assert i8.info().kv_cache_dtype == "int8" and fp32.info().kv_cache_dtype == "fp32"
    assert i8.num_blocks / fp32.num_blocks == pytest.approx(512 / 160, rel=0.01)
    assert bf.num_blocks == 2 * fp32.num_blocks
    # the default model (head_dim 64): 4 bytes of scale per 64 codes -> 3.76x the fp32 tokens
    from ui.figures.presets import PRESETS

    s = PRESETS["SmolLM2-135M"]
    assert mm.config_kv_bytes_per_token(s, "int8") == 2 * 30 * 3 * (64 + 4) == 12_240
    assert mm.config_kv_bytes_per_token(s, "fp32") / mm.config_kv_bytes_per_token(s, "int8") == pytest.approx(
        3.765, abs=1e-3
    )
    blocks = {dt: (64 << 20) // (16 * mm.config_kv_bytes_per_token(s, dt)) for dt in ("fp32", "bf16", "int8")}
    assert blocks == {"fp32": 91, "bf16": 182, "int8": 342}  # blocks of 16 tokens in 64 MiB


# ---------------------------------------------------------------- memory policies and speculation on int8


@pytest.fixture(scope="module")
def int8_plain():
    return run(tiny(kv_cache_dtype="int8"), check=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_preemption_keeps_the_plain_int8_tokens(int8_plain, mode):
    eng = tiny(kv_cache_dtype="int8", num_kv_blocks=10, block_size=4, preemption_mode=mode, swap_space_bytes=1 << 20)
    assert run(eng) == int8_plain
    assert eng.scheduler.num_preemptions > 0
    if mode == "swap":
        assert eng.scheduler.num_swaps > 0
    assert eng.bm.num_free_blocks == eng.bm.num_blocks and eng.bm.num_swap_used == 0


def test_int8_prefix_cache_hits_keep_the_tokens(int8_plain):
    eng = tiny(kv_cache_dtype="int8", block_size=4)
    first = run(eng, PROMPTS[1:2])
    again = run(eng, PROMPTS[1:2])
    assert first == again == int8_plain[1:2]
    assert eng.bm.prefix_hits > 0


@pytest.mark.parametrize("spec", [dict(method="ngram"), dict(method="self_draft", draft_layers=1)])
def test_int8_speculation_keeps_the_plain_int8_tokens(int8_plain, spec):
    from engine import SpeculativeConfig

    eng = tiny(
        kv_cache_dtype="int8", speculative=SpeculativeConfig(num_speculative_tokens=4, enable_fallback=False, **spec)
    )
    assert run(eng) == int8_plain
    assert eng.spec.metrics().num_drafts > 0
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_teacher_forcing_runs_in_blocks_the_block_manager_lends():
    from engine.bench.kvquant import teacher_forced_logprobs

    eng = tiny(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    order = eng.bm.free_block_ids()
    toks = [(7 * i) % 500 + 3 for i in range(21)]
    lp = teacher_forced_logprobs(eng, toks, 5)
    with torch.inference_mode():
        ref = F.log_softmax(eng.model(torch.tensor([toks[:-1]])).logits[0, 4:].float(), dim=-1)
    assert lp.shape == ref.shape == (16, eng.vocab_size)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    assert eng.bm.is_empty and eng.bm.free_block_ids() == order
    eng.check_invariants()
