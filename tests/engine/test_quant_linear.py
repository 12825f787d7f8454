"""The quantized-weight Linear (engine/model/csrc/quant_linear.c via engine/model/linear.py): the fp32 packed
kernel's outputs on gguf-py's de-quantized weights (bitwise where the kernel sums in that order,
within fp32 rounding of the exact product where it factorizes each block), batch-invariant, and
greedy output through weight_format="gguf" equal to transformers' generate on the de-quantized
model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model import cpu_kernels, kernel_isa
from tests.engine.gguf_blocks import random_blocks

gguf = pytest.importorskip("gguf")
LIB = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason=f"C kernels not built: {cpu_kernels.status()}")
TYPES = {"Q4_1": 3, "Q8_0": 8, "F16": 1, "BF16": 30}


def dequantized(type_id: int, blocks: np.ndarray) -> torch.Tensor:
    """What transformers' GGUF loader holds: gguf-py's dequantize, as fp32."""
    if type_id == 30:  # gguf-py widens BF16 the same way (bits << 16); torch's own here
        return torch.from_numpy(blocks.copy()).view(torch.bfloat16).float().reshape(blocks.shape[0], -1)
    return torch.from_numpy(gguf.dequantize(blocks, gguf.GGMLQuantizationType(type_id)).copy()).float()


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(37, 64), (16, 32), (50, 96), (192, 576), (576, 1536)])
def test_widened_blocks_are_the_dequantized_weight(qtype, n, k):
    t = TYPES[qtype]
    b = random_blocks(t, n, k, seed=n + k)
    panels = cpu_kernels.qpack(LIB, t, b, n, k)
    # the file's bits per weight, rows padded to whole panels of 16
    assert panels.numel() == -(-n // 16) * 16 * k // 32 * {3: 20, 8: 34, 1: 64, 30: 64}[t]
    assert torch.equal(cpu_kernels.qunpack(LIB, t, panels, n, k), dequantized(t, b))


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 16, 40])
@pytest.mark.parametrize("n,k", [(37, 64), (50, 96), (192, 576), (130, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_are_the_fp32_products_values(qtype, rows, n, k, threads):
    t = TYPES[qtype]
    b = random_blocks(t, n, k, seed=rows * 7 + n)
    w = dequantized(t, b)
    panels, fp32 = cpu_kernels.qpack(LIB, t, b, n, k), cpu_kernels.pack_linear(LIB, w)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    for bias in (None, torch.randn(n, generator=g)):
        got = cpu_kernels.qlinear(LIB, t, x, panels, n, bias, threads)
        if cpu_kernels.qlinear_bitwise(LIB, t):
            assert torch.equal(got, cpu_kernels.linear(LIB, x, fp32, n, bias, threads))
        # either way the exact product up to fp32 rounding (a fixed atol / rtol against torch's
        # F.linear fails where large terms cancel: the no-AVX-512 build's Q8_0 at K = 1536 did)
        assert cpu_kernels.within_fp32_rounding(got, x, w, bias, cpu_kernels.block_offsets(t, b))


@needs_kernel
def test_only_q4_1_and_q8_0_factorize_and_only_with_a_vector_path():
    """AVX2 and AVX-512 builds both factorize Q4_1 / Q8_0 (the same arithmetic, checked by the next
    test on whichever this CPU runs); F16 / BF16, and every type without AVX2, are bitwise."""
    isa = kernel_isa.path()
    assert isa in ("AVX-512", "AVX2+FMA", "portable C (no AVX2)")
    for name, t in TYPES.items():
        assert cpu_kernels.qlinear_bitwise(LIB, t) == (name in ("F16", "BF16") or isa.startswith("portable"))
    assert LIB.kvscope_qlinear_bitwise(2) == -1  # Q4_0: no kernel


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_factorized_sum_is_per_block_d_times_codes_dot_x_plus_m_times_sum_x(qtype, avx_path):
    """One output, written out in the AVX paths' order: per block the even and odd columns' fused
    multiply-add chains, s = their sum, t = fma(m, sum x, d s) (Q4_1) or fma(d, s, total) (Q8_0).
    (Q4_1 on AMX tiles has its own test file, test_amx_linear.py.)"""
    t = TYPES[qtype]
    if cpu_kernels.qlinear_bitwise(LIB, t):
        pytest.skip("this CPU's kernel sums the widened weights in the fp32 kernel's order")
    k, n = 96, 16
    b = random_blocks(t, n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    got = cpu_kernels.qlinear(LIB, t, x, cpu_kernels.qpack(LIB, t, b, n, k), n)
    f32 = np.float32
    xs = x[0].numpy()
    for row in (0, 9, 15):
        blk = b[row].reshape(k // 32, -1)
        total = f32(0)
        for j in range(k // 32):
            d = blk[j, 0:2].view(np.float16)[0].astype(f32)
            if t == 3:
                m = blk[j, 2:4].view(np.float16)[0].astype(f32)
                codes = np.concatenate([blk[j, 4:20] & 15, blk[j, 4:20] >> 4]).astype(f32)
            else:
                codes = blk[j, 2:34].view(np.int8).astype(f32)
            xb = xs[32 * j : 32 * j + 32]
            even = odd = f32(0)
            for i in range(0, 32, 2):
                even = fma(codes[i], xb[i], even)
                odd = fma(codes[i + 1], xb[i + 1], odd)
            s = f32(even + odd)
            if t == 3:
                sx = f32(0)
                for v in xb:
                    sx = f32(sx + v)
                total = f32(total + fma(m, sx, f32(d * s)))
            else:
                total = fma(d, s, total)
        assert got[0, row].item() == float(total)


@pytest.fixture
def avx_path():
    """The AVX paths' Q4_1 kernel for one test where AMX tiles would otherwise take it."""
    was = cpu_kernels.amx(LIB)
    cpu_kernels.amx(LIB, False)
    yield
    cpu_kernels.amx(LIB, was)


def fma(a, b, c) -> np.float32:
    """fp32 fused multiply-add: the exact a * b + c (float64 holds the product of two fp32
    exactly), rounded once to fp32 (double rounding through float64 cannot change an fp32 fma's
    result here: the product is exact and the sum's error is below half a float64 ulp)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    qtype=st.sampled_from(sorted(TYPES)),
    n=st.integers(1, 70),
    kblocks=st.integers(1, 5),
    rows=st.integers(2, 20),
    seed=st.integers(0, 2**16),
)
def test_a_rows_result_does_not_depend_on_its_batch(qtype, n, kblocks, rows, seed):
    t, k = TYPES[qtype], 32 * kblocks
    b = random_blocks(t, n, k, seed)
    panels = cpu_kernels.qpack(LIB, t, b, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    batch = cpu_kernels.qlinear(LIB, t, x, panels, n)
    # with AMX tiles on, Q4_1 calls of amx_min_rows rows or more take them: a row is compared in a
    # call on the same side (one row alone, or min_rows rows holding it)
    mn = cpu_kernels.amx_min_rows(LIB)
    width = mn if qtype == "Q4_1" and cpu_kernels.amx(LIB) and rows >= mn else 1
    for r in {0, rows // 2, rows - 1}:
        lo = min(r, rows - width)
        assert torch.equal(cpu_kernels.qlinear(LIB, t, x[lo : lo + width], panels, n)[r - lo], batch[r])


NEVER = 2**31 - 1


@pytest.fixture(params=[8, NEVER], ids=["scratch-from-8-rows", "registers-always"])
def row_path(request):
    """Each of the factorized kernel's two row paths (whichever this CPU was tuned to), restored
    after the test."""
    before = cpu_kernels.ql_scratch_rows(LIB)
    if before == 0:  # one row path (no AVX2): the test runs once, on it
        if request.param == NEVER:
            pytest.skip("this build has one row path (no AVX2)")
        yield request.param
        return
    cpu_kernels.ql_scratch_rows(LIB, request.param)
    yield request.param
    cpu_kernels.ql_scratch_rows(LIB, before)


@needs_kernel
def test_the_tuned_row_path_is_one_of_the_two_and_named_rows_are_kept():
    before = cpu_kernels.ql_scratch_rows(LIB)
    try:
        if before == 0:
            assert cpu_kernels.ql_scratch_rows(LIB, 0) == 0
            return
        tuned = (8, NEVER) if kernel_isa.path().startswith("AVX-512") else (24, 32, 33)
        assert cpu_kernels.ql_scratch_rows(LIB, 0) in tuned
        assert cpu_kernels.ql_scratch_rows(LIB, 24) == 24
        assert cpu_kernels.ql_scratch_rows(LIB) == 24
    finally:
        cpu_kernels.ql_scratch_rows(LIB, before if before > 0 else 8)


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_both_row_paths_give_the_same_bits(qtype, threads):
    """The register path (codes converted per tile) and the scratch path (converted once per
    chunk) are the same chains: which one the CPU was tuned to never changes an output."""
    if cpu_kernels.ql_scratch_rows(LIB) == 0:
        pytest.skip("this build has one row path (no AVX2)")
    t, n, k = TYPES[qtype], 328, 192
    b = random_blocks(t, n, k, seed=5)
    panels = cpu_kernels.qpack(LIB, t, b, n, k)
    x = torch.randn(133, k, generator=torch.Generator().manual_seed(5))
    before = cpu_kernels.ql_scratch_rows(LIB)
    try:
        outs = []
        for rows in (8, NEVER):
            cpu_kernels.ql_scratch_rows(LIB, rows)
            outs.append(cpu_kernels.qlinear(LIB, t, x, panels, n, None, threads))
    finally:
        cpu_kernels.ql_scratch_rows(LIB, before)
    assert torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_past_the_scratch_chunk_keep_their_single_row_bits(qtype, threads, row_path, avx_path):
    """From 8 rows the AVX-512 kernel may convert a block's codes once for all rows, in chunks of
    48 rows, 1, 2 or 4 panels at a time: 100 rows over 200 outputs (13 panels, the last one half
    full) cross two chunk edges, a partial chunk and every panel grouping; on the register path
    the same rows cross its 4-row tiles and every panel width. (The AVX paths: AMX tiles would take
    the batch, not its single rows.)"""
    t, n, k = TYPES[qtype], 200, 96
    b = random_blocks(t, n, k, seed=3)
    panels = cpu_kernels.qpack(LIB, t, b, n, k)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    batch = cpu_kernels.qlinear(LIB, t, x, panels, n, bias, threads)
    for r in (0, 7, 8, 47, 48, 95, 96, 99):
        assert torch.equal(cpu_kernels.qlinear(LIB, t, x[r : r + 1], panels, n, bias, threads)[0], batch[r])
    assert cpu_kernels.within_fp32_rounding(batch, x, dequantized(t, b), bias, cpu_kernels.block_offsets(t, b))


@needs_kernel
def test_row_map_reorders_rows_and_bad_sizes_are_rejected():
    b = random_blocks(3, 48, 64, seed=3)
    perm = np.random.default_rng(0).permutation(48)
    panels = cpu_kernels.qpack(LIB, 3, b, 48, 64, row_map=perm)
    assert torch.equal(cpu_kernels.qunpack(LIB, 3, panels, 48, 64), dequantized(3, b)[torch.from_numpy(perm)])
    with pytest.raises(ValueError):
        cpu_kernels.qpack(LIB, 3, b, 48, 48)  # 48 columns: not whole blocks of 32
    with pytest.raises(ValueError):
        cpu_kernels.qpack(LIB, 3, b, 48, 64, row_map=np.full(48, 99))  # a row the tensor lacks
    with pytest.raises(ValueError):
        cpu_kernels.qpack(LIB, 2, b, 48, 64)  # Q4_0: no kernel


def test_q_and_k_row_order_inverts_llama_cpps_permutation():
    from engine.model.gguf_weights import row_order

    n, heads = 24, 3
    hf = np.arange(n * 4).reshape(n, 4)
    d = n // heads // 2  # llama.cpp's permute (convert_hf_to_gguf)
    gguf_rows = hf.reshape(heads, 2, d, 4).swapaxes(1, 2).reshape(n, 4)
    assert np.array_equal(gguf_rows[row_order("blk.0.attn_q.weight", n, heads, heads)], hf)
    assert np.array_equal(row_order("blk.0.attn_v.weight", n, heads, heads), np.arange(n))


def test_weight_format_is_validated():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="weight_format"):
        EngineConfig(model="tiny", weight_format="int4")


def test_gguf_format_needs_a_gguf_model():
    from engine import LLM

    with pytest.raises(ValueError, match="weight_format='gguf'"):
        LLM(model="tiny", weight_format="gguf", num_kv_blocks=16)
    info = LLM(model="tiny", num_kv_blocks=16).engine.info()  # auto: fp32 where no GGUF
    assert info.weight_format in ("fp32", "torch") and info.weight_bytes_per_step > 0


@pytest.mark.slow
@needs_kernel
def test_default_model_reads_its_gguf_blocks_and_greedy_equals_transformers():
    from engine import LLM, SamplingParams
    from tests.engine.exact_ref import MAX_TOKENS, reference

    ids, refs = reference()
    llm = LLM(model="default", weight_format="gguf", num_kv_blocks=128)
    info = llm.engine.info()
    pack = llm.engine.runner.linear_pack
    assert info.weight_format == "gguf"
    assert pack.formats == {"Q4_1": 210, "Q8_0": 1}  # 30 layers x 7 Linears, the tied lm_head
    # 106.2 M Q4_1 weights at 20 bytes / 32, 28.3 M Q8_0 at 34 / 32, the 61 norms in fp32
    assert pack.bytes == 30 * 3538944 * 20 // 32 + 576 * 49152 * 34 // 32
    assert info.weight_bytes_per_step == pack.bytes + 61 * 576 * 4
    fp32 = LLM(model="default", weight_format="fp32", num_kv_blocks=128).engine.info()
    assert fp32.weight_bytes_per_step == (30 * 3538944 + 576 * 49152 + 61 * 576) * 4
    idx = [0, 4, 5]
    outs = llm.generate([ids[i] for i in idx], SamplingParams(max_tokens=MAX_TOKENS))
    for o, i in zip(outs, idx):
        assert o.outputs[0].token_ids == refs[i], f"prompt {i}"


def _bf16_exact_tiny():
    """A 2-layer random Llama whose fp32 weights are all exactly bf16 values (as a bf16
    checkpoint loaded in fp32 is)."""
    from transformers import LlamaForCausalLM

    from engine.model.models import tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=512)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@needs_kernel
def test_weights_that_are_exactly_bf16_are_read_at_16_bits_with_the_same_logits():
    from engine.model import linear
    from engine.model.runner import weight_pack

    model = _bf16_exact_tiny()
    assert linear.half_exact(model, "bf16") and not linear.half_exact(model, "fp16")
    half = weight_pack(model, "auto")
    fp32 = linear.pack_model(model)
    assert half.weight_format == "bf16" and half.formats == {"BF16": model.config.num_hidden_layers * 7 + 1}
    assert half.bytes * 2 == fp32.bytes
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with linear.packed_linears(half):
            a = model(ids).logits
        with linear.packed_linears(fp32):
            b = model(ids).logits
    assert torch.equal(a, b)
    fp16 = weight_pack(model, "fp16")  # asked for: the Linears whose weights are exactly fp16 values
    assert fp16.weight_format == "fp16" and set(fp16.formats) <= {"F16", "fp32"}
    with torch.inference_mode(), linear.packed_linears(fp16):
        assert torch.equal(model(ids).logits, b)
    from transformers import LlamaForCausalLM

    from engine.model.models import tiny_config

    plain = LlamaForCausalLM(tiny_config(vocab_size=512)).eval()  # random fp32: not 16-bit values
    assert weight_pack(plain, "auto").weight_format == "fp32"
    with pytest.raises(ValueError, match="weight_format='bf16'"):
        weight_pack(plain, "bf16")


def test_the_gguf_tensor_table_equals_gguf_pys_reader(tmp_path):
    """gguf_weights.tensor_table reads the header itself (skipping the metadata values); on the
    default model's GGUF and on a small file gguf-py writes with every metadata value type and a
    non-default alignment, every tensor's name, type, dims and bytes are gguf-py's."""
    import gguf

    from engine.model.gguf_weights import tensor_table
    from engine.model.models import default_gguf_path

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "dddd"])
    w.add_array("a.ints", [1, 2, 3])
    w.add_float64("a.f64", 0.5)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "x" * 100)
    rng = np.random.default_rng(0)
    w.add_tensor("t.f32", rng.standard_normal((3, 5)).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("t.q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in (default_gguf_path(), str(tmp_path / "t.gguf")):
        ref = gguf.GGUFReader(path, "r").tensors
        got = tensor_table(path)
        assert list(got) == [t.name for t in ref]
        for t in ref:
            tname, dims, data = got[t.name]
            assert (tname, dims) == (t.tensor_type.name, tuple(int(d) for d in t.shape))
            assert np.asarray(data).tobytes() == np.ascontiguousarray(t.data).view(np.uint8).tobytes()
