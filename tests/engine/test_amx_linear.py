"""Q4_1 Linears on AMX's bf16 tiles (engine/model/csrc/amx_linear.c), where this CPU, the build and
the OS allow them: x cut into three bf16 parts whose products with the codes are exact, summed by
the tile unit. Checked with the tiles taking every row count: exact where every sum is exact
(integer weights and inputs), within the engine's fp32-rounding bound elsewhere, a row's bits
independent of its batch, its rows' order and the thread count, the switch (KVSCOPE_AMX=0 /
`cpu_kernels.amx`) back to the AVX path's bits, and the whole C stack's logits and greedy choice on
the default model beside the AVX-512 path; and the default split, calls below 8 rows on the AVX
path (`cpu_kernels.amx_min_rows`)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.model import cpu_kernels, kernel_isa
from tests.engine.gguf_blocks import random_blocks

LIB = cpu_kernels.load()
WAS_ON = LIB is not None and cpu_kernels.amx(LIB)  # off under KVSCOPE_AMX=0: these tests still run the tiles
HAS_AMX = LIB is not None and cpu_kernels.amx(LIB, True)
MIN_ROWS = cpu_kernels.amx_min_rows(LIB) if LIB is not None else None  # as the library loaded
if LIB is not None:
    cpu_kernels.amx(LIB, WAS_ON)
pytestmark = pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles here (CPU, build or OS): the AVX paths run")
Q4_1 = 3


@pytest.fixture(autouse=True)
def amx_on():
    """Every test starts with the tiles on for every row count and leaves the process as it found it."""
    cpu_kernels.amx(LIB, True)
    cpu_kernels.amx_min_rows(LIB, 1)
    yield
    cpu_kernels.amx_min_rows(LIB, MIN_ROWS)
    cpu_kernels.amx(LIB, WAS_ON)


def packed(n: int, k: int, seed: int, **scales):
    """(panels, the fp32 weight they hold, |m| per row and block for the rounding bound)"""
    b = random_blocks(Q4_1, n, k, seed, **scales)
    panels = cpu_kernels.qpack(LIB, Q4_1, b, n, k)
    return panels, cpu_kernels.qunpack(LIB, Q4_1, panels, n, k), cpu_kernels.block_offsets(Q4_1, b)


def test_the_tiles_are_what_the_bench_names():
    assert kernel_isa.amx() and kernel_isa.summary().endswith("+ AMX for Q4_1 from 1 rows")
    cpu_kernels.amx_min_rows(LIB, 8)
    assert kernel_isa.summary().endswith("+ AMX for Q4_1 from 8 rows")
    cpu_kernels.amx(LIB, False)
    assert not kernel_isa.amx() and "AMX" not in kernel_isa.summary()
    assert kernel_isa.path() == "AVX-512"


@pytest.mark.parametrize("m_rows", [1, 3, 5, 16, 17, 40])
def test_exact_where_every_sum_is_exact(m_rows):
    """d = 1, m = 0 and integer x below 2^7: every product and partial sum is an integer far
    below 2^24, so any order of summing gives the exact product; a wrong pairing of codes with x,
    a lost part or a wrong panel shows here."""
    n, k = 40, 96
    panels, w, _ = packed(n, k, seed=m_rows, d=1.0, m=0.0)
    x = torch.randint(-100, 100, (m_rows, k), generator=torch.Generator().manual_seed(m_rows)).float()
    got = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    assert torch.equal(got, x @ w.T)


def test_all_three_parts_count():
    """x = +-(2^16 + 2^8 + 1): one bit in each of its three bf16 parts. With d = 1, m = 0 and only
    the low nibbles' weights nonzero, every sum is an integer below 2^24 (<= 240 x 65,793), exact
    in fp32 in any order: a part lost or summed twice shows as 1 or 256 per code."""
    n, k = 16, 64
    b = random_blocks(Q4_1, n, k, seed=3, d=1.0, m=0.0)
    b.reshape(-1, 20)[:, 4:] &= 0x0F
    panels = cpu_kernels.qpack(LIB, Q4_1, b, n, k)
    w = cpu_kernels.qunpack(LIB, Q4_1, panels, n, k)
    x = torch.full((2, k), float(2**16 + 2**8 + 1))
    x[0, ::2] = -x[0, ::2]
    x[1, ::3] = -x[1, ::3]
    got = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    assert torch.equal(got.double(), x.double() @ w.double().T)


@pytest.mark.parametrize("n,k", [(37, 64), (192, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("m_rows", [1, 2, 5, 16, 33, 130])
def test_within_the_fp32_rounding_bound(n, k, m_rows):
    panels, w, offsets = packed(n, k, seed=n + k)
    g = torch.Generator().manual_seed(m_rows)
    x = torch.randn(m_rows, k, generator=g) * torch.exp(torch.randn(m_rows, 1, generator=g))
    bias = torch.randn(n, generator=g)
    got = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n, bias)
    assert cpu_kernels.within_fp32_rounding(got, x, w, bias, offsets)
    # and much closer than the bound in practice: within 8 u of sum |x w| (+ |bias|)
    exact = x.double() @ w.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((got.double() - exact).abs() <= 8 * 2.0**-24 * scale).all()


def test_a_rows_bits_do_not_depend_on_its_batch_order_or_threads():
    n, k = 200, 576
    panels, _, _ = packed(n, k, seed=11)
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(11))
    full = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n, n_threads=2)
    assert torch.equal(full, cpu_kernels.qlinear(LIB, Q4_1, x, panels, n, n_threads=1))
    for i in (0, 15, 16, 44):
        assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x[i : i + 1], panels, n)[0], full[i])
    for lo, hi in ((0, 5), (3, 20), (17, 45)):
        assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x[lo:hi], panels, n), full[lo:hi])
    perm = torch.randperm(45, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x[perm], panels, n), full[perm])


def test_switching_off_gives_the_avx_paths_bits_and_back():
    n, k = 64, 576
    panels, _, _ = packed(n, k, seed=7)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    tiles = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    assert cpu_kernels.amx(LIB, False) is False and not kernel_isa.amx()
    avx = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    assert not torch.equal(tiles, avx)  # the two arithmetics round differently somewhere
    torch.testing.assert_close(tiles, avx, rtol=1e-5, atol=1e-5)
    assert cpu_kernels.amx(LIB, True) is True
    assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x, panels, n), tiles)


def test_calls_below_min_rows_take_the_avx_path():
    """By default the tiles take calls of 8 rows or more (one-row decode and verification up to
    k = 6 stay on the AVX path, faster there): below, the AVX path's bits; from 8 rows, the tiles'
    bits, a row's the same in any such call."""
    if not os.environ.get("KVSCOPE_AMX_MIN_ROWS"):
        assert MIN_ROWS == 8
    n, k = 64, 576
    panels, _, _ = packed(n, k, seed=5)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(5))
    tiles = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    cpu_kernels.amx(LIB, False)
    avx = cpu_kernels.qlinear(LIB, Q4_1, x, panels, n)
    cpu_kernels.amx(LIB, True)
    assert not torch.equal(tiles, avx)
    assert cpu_kernels.amx_min_rows(LIB, 8) == 8 and cpu_kernels.amx_min_rows(LIB) == 8
    for m in (1, 5, 7):
        assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x[:m], panels, n), avx[:m])
    for lo, hi in ((0, 8), (3, 20), (12, 20)):
        assert torch.equal(cpu_kernels.qlinear(LIB, Q4_1, x[lo:hi], panels, n), tiles[lo:hi])


def test_the_default_models_stack_on_tiles_beside_the_avx_512_path():
    """The whole C stack (Q4_1 Linears on the tiles, the Q8_0 lm_head on AVX-512) over a prefill
    and ragged decode rows: logits within fp32 noise of the AVX-512 path's, the same greedy
    choice at every row."""
    from engine.model.models import load_model
    from tests.engine.c_stack import ragged_cases, runner

    model, tok = load_model("default")
    cases = ragged_cases(tok)
    out = {}
    for on in (True, False):
        cpu_kernels.amx(LIB, on)
        r = runner(model)
        assert r.decode_backend == "c"
        out[on] = [r.forward(rows) for rows in cases]
    for a, b in zip(out[True], out[False]):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
