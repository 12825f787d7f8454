"""The 4-bit and 2-bit K/V pools (engine/model/kv_quant.py "int4" / "int2"): packing, the write ->
widen error bound (hypothesis over shapes and values), the bytes per token kv_layout counts and
the pool really holds, the engine end to end on the tiny model (block counts, invariants,
preemption, prefix caching), and the torch attention path reading them (the C decode kernel reads
only the formats in kv_quant.KERNEL_CODES)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams
from engine.config import KV_CACHE_DTYPES
from engine.lab import memory_math as mm
from engine.model import kv_layout, kv_quant
from engine.observe.recording import drive
from tests.engine.engines import tiny_engine, token_ids

FP32_EPS = 2.0**-23
LOW = ("int4", "int2")
QMAX = {"int4": 7, "int2": 1}
finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_subnormal=False, width=32)


@st.composite
def blocks(draw):
    """[rows, head_dim] float32 values: head_dim a multiple of 4 (kv_quant.check_head_dim), rows whose
    largest magnitude keeps the scale a normal float32."""
    n = draw(st.integers(1, 5))
    d = 4 * draw(st.integers(1, 20))
    vals = draw(st.lists(finite, min_size=n * d, max_size=n * d))
    x = torch.tensor(vals, dtype=torch.float32).reshape(n, d)
    amax = x.abs().amax(-1)
    x[(amax > 0) & (amax < 1e-30)] = 0
    return x


@pytest.mark.parametrize("bits", [4, 2])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_pack_unpack_is_the_identity(bits, data):
    d = 8 // bits * data.draw(st.integers(1, 40))
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=d, max_size=d))
    c = torch.tensor(codes, dtype=torch.uint8)[None]
    packed = kv_quant.pack(c, bits)
    assert packed.shape == (1, d * bits // 8)
    assert torch.equal(kv_quant.unpack(packed, bits), c)


def test_int4_packs_low_nibble_first_and_scales_each_group_of_32():
    # codes -7, 0, 7, 1 stored as 1, 8, 15, 9: bytes 0x81, 0x9f
    x = torch.tensor([[-7.0, 0.0, 7.0, 1.0]])
    rows = kv_quant.quantize(x, "int4")
    assert rows[0, :2].tolist() == [0x81, 0x9F]
    assert rows[0, 2:].clone(memory_format=torch.contiguous_format).view(torch.float32).item() == 1.0
    assert kv_quant.dequantize(rows, "int4").tolist() == x.tolist()
    # a row of 72: groups of 32, 32 and 8, each with its own scale after the 36 code bytes
    y = torch.cat([torch.full((32,), 7.0), torch.full((32,), 0.7), torch.full((8,), 70.0)])[None]
    rows = kv_quant.quantize(y, "int4")
    assert rows.shape == (1, 36 + 3 * 4) and kv_quant.head_dim_of("int4", 48) == 72
    assert rows[0, 36:].clone(memory_format=torch.contiguous_format).view(torch.float32).tolist() == pytest.approx(
        [1.0, 0.1, 10.0]
    )
    torch.testing.assert_close(kv_quant.dequantize(rows, "int4"), y)


@pytest.mark.parametrize("fmt", LOW)
@settings(max_examples=200, deadline=None)
@given(x=blocks())
def test_low_bit_roundtrip_error_is_at_most_half_a_step(fmt, x):
    rows = kv_quant.quantize(x, fmt)
    n, d = x.shape
    groups = -(-d // 32)  # one scale per 32 numbers, the last group shorter
    assert rows.dtype == torch.uint8 and rows.shape == (n, kv_quant.row_bytes(fmt, d))
    assert kv_quant.row_bytes(fmt, d) == d * {"int4": 4, "int2": 2}[fmt] // 8 + 4 * groups
    assert kv_quant.head_dim_of(fmt, rows.shape[-1]) == d
    s = rows[:, -4 * groups :].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [n, groups]
    padded = torch.nn.functional.pad(x.abs(), (0, 32 * groups - d))
    amax = padded.reshape(n, groups, 32).amax(-1)  # each group's largest magnitude
    assert torch.allclose(s, amax / QMAX[fmt], rtol=2 * FP32_EPS, atol=0)
    s_each = s.repeat_interleave(32, dim=-1)[:, :d]
    got = kv_quant.dequantize(rows, fmt)
    # |x - x'| <= s / 2 per element, s its group's scale (one rounding step of the code), plus fp32 rounding
    bound = s_each / 2 * (1 + 2**-16) + x.abs() * 2 * FP32_EPS
    assert bool(((x - got).abs() <= bound).all()), ((x - got).abs() - bound).max()
    amax_each = amax.repeat_interleave(32, dim=-1)[:, :d]
    assert bool((got.abs() <= amax_each * (1 + 4 * FP32_EPS)).all())  # never beyond its group's largest
    assert not got[amax_each == 0].any()  # an all-zero group reads back as zeros


@pytest.mark.parametrize("fmt", LOW)
def test_write_at_slots_widen_on_read(fmt):
    pool = kv_quant.allocate(fmt, 4, 2, 3, 8, "cpu")
    assert pool.shape == (4, 2, 3, kv_quant.row_bytes(fmt, 8))
    assert not kv_quant.widen(pool, fmt, torch.float32).any()  # zeroed pool reads as zeros
    x = torch.randn(3, 3, 8, generator=torch.Generator().manual_seed(0))
    kv_quant.write(pool, torch.tensor([5, 0, 2]), x, fmt)
    flat = kv_quant.widen(pool.view(-1, *pool.shape[2:]), fmt, torch.float32)
    assert flat.shape == (8, 3, 8)
    for i, slot in enumerate([5, 0, 2]):
        step = x[i].abs().amax(-1, keepdim=True) / QMAX[fmt]  # head_dim 8: one group per row
        assert bool(((flat[slot] - x[i]).abs() <= step / 2 + 1e-6).all())
        assert torch.equal(flat[slot], kv_quant.dequantize(kv_quant.quantize(x[i], fmt), fmt))
    assert not flat[[1, 3, 4, 6, 7]].any()
    assert kv_quant.widen(pool, fmt, torch.bfloat16).dtype == torch.bfloat16


def test_bad_names_and_head_dims():
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of .*'int4', 'int2'\), got 'int3'$"):
        EngineConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' needs head_dim to be a multiple of 4.*head_dim=6"):
        kv_quant.check_head_dim("int4", 6)
    with pytest.raises(ValueError, match=r"^dtype must be one of \(.*'int4', 'int2'\), got 'int3'$"):
        mm.config_kv_bytes_per_token({"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}, "int3")


def test_the_kv_dtype_list_has_one_home():
    from engine.bench import kvquant
    from ui.figures import memory_calc as mc

    assert kv_quant.KV_CACHE_DTYPES is KV_CACHE_DTYPES
    assert set(kvquant.DTYPES) == set(KV_CACHE_DTYPES) - {"auto"}
    # the calculator's names (fp8 for fp8_e4m3) cover every pool format, and each has a byte size
    assert set(mc.KVQUANT_NAMES.values()) == set(KV_CACHE_DTYPES) - {"auto"}
    assert set(mc.KV_DTYPES) == set(mc.KVQUANT_NAMES)
    for name in mc.KV_DTYPES:
        mm.dtype_bytes(name)


# ---------------------------------------------------------------- bytes per token


def test_bytes_per_token_for_the_low_bit_formats():
    # 2 (K and V) x layers x kv_heads x (packed codes + a 4-byte scale per 32 numbers)
    i4, i2 = kv_layout.dtype_bytes("int4"), kv_layout.dtype_bytes("int2")
    assert (i4, i2) == (0.5, 0.25)
    assert kv_layout.kv_bytes_per_token(2, 2, 16, i4, scale_bytes=4, scale_group=32) == 2 * 2 * 2 * (8 + 4)
    assert kv_layout.kv_bytes_per_token(2, 2, 16, i2, scale_bytes=4, scale_group=32) == 2 * 2 * 2 * (4 + 4)
    assert kv_layout.kv_bytes_per_token(1, 1, 128, i4, scale_bytes=4, scale_group=32) == 2 * (64 + 4 * 4)
    from ui.figures.presets import PRESETS

    s = PRESETS["SmolLM2-135M"]  # 30 layers x 3 KV heads x head_dim 64: two scales per row
    assert mm.config_kv_bytes_per_token(s, "int4") == 2 * 30 * 3 * (32 + 8) == 7_200
    assert mm.config_kv_bytes_per_token(s, "int2") == 2 * 30 * 3 * (16 + 8) == 4_320
    assert mm.kv_scale_bytes_per_token(s, "int4") == 2 * 30 * 3 * 8
    assert "x 0.5 bytes + 1,440 scale bytes" in mm.formula_factors(s, "int4")
    # MLA: one latent row of 512 + 64 numbers per layer, packed, plus 18 scales
    dsv3 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128}
    assert mm.config_kv_bytes_per_token(dsv3, "int4") == 61 * (288 + 18 * 4)
    # the other formats are unchanged by the packed arithmetic
    assert mm.config_kv_bytes_per_token(s, "int8") == 12_240 and mm.config_kv_bytes_per_token(s, "fp32") == 46_080
    blocks = {dt: (64 << 20) // (16 * mm.config_kv_bytes_per_token(s, dt)) for dt in ("fp32", "int8", "int4", "int2")}
    assert blocks == {"fp32": 91, "int8": 342, "int4": 582, "int2": 970}  # blocks of 16 tokens in 64 MiB


tiny = tiny_engine


@pytest.mark.parametrize("fmt", LOW)
def test_pool_holds_the_formulas_bytes(fmt):
    budget = 1 << 20
    fp32 = tiny(kv_cache_bytes=budget, block_size=16)
    eng = tiny(kv_cache_bytes=budget, block_size=16, kv_cache_dtype=fmt)
    # tiny: 2 layers x 2 KV heads x head_dim 16
    assert eng.bytes_per_token == 2 * 2 * 2 * ({"int4": 8, "int2": 4}[fmt] + 4)
    assert eng.num_blocks == budget // (16 * eng.bytes_per_token)
    k, v = eng.runner.kv_caches[0]
    assert k.dtype == torch.uint8 and k.shape[-1] == kv_quant.row_bytes(fmt, 16)
    assert (k.numel() + v.numel()) * eng.runner.num_layers == eng.num_blocks * eng.bytes_per_block
    assert eng.info().kv_cache_dtype == fmt and eng.info().kv_cache_bytes <= budget
    assert eng.num_blocks / fp32.num_blocks == pytest.approx(512 / eng.bytes_per_token, rel=0.01)
    # no C decode kernel for packed pools: attention widens them in torch; no fused C decode either
    assert eng.info().attention_backend == "torch" and eng.runner.decode_kernel is None
    assert eng.runner.fused is None


# ---------------------------------------------------------------- end to end on the tiny model

PROMPTS = ["hello world", "the cat sat on the mat and the cat sat on the", "1 2 3 4 5 6 7 8", "Once upon a time"]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def run(eng, prompts=PROMPTS, check=True):
    return token_ids(eng, prompts, PARAMS, check=check)


@pytest.fixture(scope="module")
def int4_plain():
    return run(tiny(kv_cache_dtype="int4"), check=False)


def test_int4_engine_runs_with_invariants_and_frees_every_block(int4_plain):
    eng = tiny(kv_cache_dtype="int4", num_kv_blocks=64, block_size=4)
    out = run(eng)
    assert out == int4_plain  # block size and pool size do not change what an int4 row stores
    assert [len(t) for t in out] == [12] * len(PROMPTS)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks == 64


def test_int4_attention_reads_what_was_written():
    """After a run, each slot of the pool widens to what encoding that token's K/V gives: the
    pool's K for a prompt equals int4(K) computed by the model outside the engine."""
    eng = tiny(kv_cache_dtype="int4", block_size=4, enable_prefix_caching=False)
    prompt = [5, 17, 29, 3, 11, 42, 7]
    eng.add_request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()  # the prefill writes the prompt's K/V into its blocks
    table = eng.bm.table("r")
    slots = [table[i // 4] * 4 + i % 4 for i in range(len(prompt))]
    k_read, _ = eng.runner.read_slots(0, slots)
    with torch.inference_mode():
        out = eng.model(torch.tensor([prompt]), use_cache=True)
    k_ref = out.past_key_values.layers[0].keys[0].transpose(0, 1)  # [T, kv_heads, D]
    want = kv_quant.dequantize(kv_quant.quantize(k_ref, "int4"), "int4")
    torch.testing.assert_close(k_read, want, atol=1e-5, rtol=1e-5)
    drive(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int4_preemption_keeps_the_plain_int4_tokens(int4_plain, mode):
    eng = tiny(kv_cache_dtype="int4", num_kv_blocks=8, block_size=4, preemption_mode=mode, swap_space_bytes=1 << 20)
    assert run(eng) == int4_plain
    assert eng.scheduler.num_preemptions > 0
    assert eng.bm.num_free_blocks == eng.bm.num_blocks and eng.bm.num_swap_used == 0


def test_int4_prefix_cache_hits_keep_the_tokens(int4_plain):
    eng = tiny(kv_cache_dtype="int4", block_size=4)
    first = run(eng, PROMPTS[1:2])
    again = run(eng, PROMPTS[1:2])
    assert first == again == int4_plain[1:2]
    assert eng.bm.prefix_hits > 0


def test_int2_engine_runs_end_to_end():
    eng = tiny(kv_cache_dtype="int2", num_kv_blocks=32, block_size=4)
    out = run(eng)
    assert [len(t) for t in out] == [12] * len(PROMPTS)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
