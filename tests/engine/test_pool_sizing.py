"""engine/core/pool_sizing.py: the KV pool's block count from the config and memory figures, plain
numbers in, exact block counts or a ValueError naming the field out."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import pool_sizing as ps
from engine.model.device import activation_reserve_bytes

GiB = 2**30
BPB = 4096  # bytes per block


def _never():
    raise AssertionError("gpu sizing called off CUDA")


def test_num_kv_blocks_wins():
    c = EngineConfig(model="tiny", num_kv_blocks=37, kv_cache_bytes=10 * BPB)
    assert ps.pool_blocks(c, BPB, "cuda", _never) == (37, "num_kv_blocks=37")


def test_kv_cache_bytes_in_whole_blocks():
    c = EngineConfig(model="tiny", kv_cache_bytes=10 * BPB + BPB - 1)
    assert ps.pool_blocks(c, BPB, "cuda", _never) == (10, f"kv_cache_bytes={10 * BPB + BPB - 1}")


def test_default_budget_is_capped():
    c = EngineConfig(model="tiny")
    # 256 MiB / 4 KiB = 65536 blocks, capped at MAX_DEFAULT_BLOCKS
    assert ps.pool_blocks(c, BPB, "cpu", _never) == (4096, f"kv_cache_bytes={256 * 2**20}")
    assert ps.pool_blocks(c, 2**20, "cpu", _never) == (256, f"kv_cache_bytes={256 * 2**20}")


def test_cuda_without_budget_asks_the_gpu():
    c = EngineConfig(model="tiny")
    assert ps.pool_blocks(c, BPB, "cuda", lambda: (5, "gpu_memory_utilization=0.9")) == (
        5,
        "gpu_memory_utilization=0.9",
    )


def test_budget_under_one_block_names_the_field():
    c = EngineConfig(model="tiny", kv_cache_bytes=BPB - 1)
    with pytest.raises(ValueError, match=rf"^kv_cache_bytes={BPB - 1} is smaller than one block \({BPB} bytes"):
        ps.pool_blocks(c, BPB, "cpu", _never)


def test_gpu_budget_and_blocks():
    c = EngineConfig(model="tiny", gpu_memory_utilization=0.5)
    reserve = activation_reserve_bytes(c.max_num_batched_tokens, 64, 256, 1000, c.max_num_seqs, 4)
    assert ps.gpu_budget((30 * GiB, 40 * GiB), c, 4, 64, 256, 1000) == 10 * GiB - reserve
    assert ps.gpu_budget(None, c, 4, 64, 256, 1000) == ps.DEFAULT_KV_BYTES
    # no intermediate_size: 4 * hidden
    assert ps.gpu_budget((30 * GiB, 40 * GiB), c, 4, 64, None, 1000) == 10 * GiB - reserve
    assert ps.gpu_pool_blocks(10 * BPB + 5, BPB, 0.5) == (10, "gpu_memory_utilization=0.5")
    assert ps.gpu_pool_blocks(10**15, 1, 0.5) == (ps.MAX_BLOCKS, "gpu_memory_utilization=0.5")
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.5 leaves 100 bytes for the KV cache"):
        ps.gpu_pool_blocks(100, BPB, 0.5)


def test_check_pool_memory_limit():
    c = EngineConfig(model="tiny", num_kv_blocks=90)
    ps.check_pool(c, 90, "num_kv_blocks=90", BPB, "cpu", 100 * BPB)  # exactly 90%
    ps.check_pool(c, 90, "num_kv_blocks=90", BPB, "cpu", None)  # unknown: no check
    with pytest.raises(ValueError, match=r"^num_kv_blocks=91 needs .* GiB of KV cache \(4096 bytes per block\)"):
        ps.check_pool(c, 91, "num_kv_blocks=91", BPB, "cpu", 100 * BPB)


def test_check_pool_block_cap_and_slab():
    c = EngineConfig(model="tiny")
    with pytest.raises(ValueError, match=rf"^kv_cache_bytes=x gives {ps.MAX_BLOCKS + 1} blocks; the limit is"):
        ps.check_pool(c, ps.MAX_BLOCKS + 1, "kv_cache_bytes=x", 1, "cpu", None)
    c = EngineConfig(model="tiny", allocator="contiguous", max_model_len=256, block_size=16)
    ps.check_pool(c, 16, "num_kv_blocks=16", BPB, "cpu", None)
    with pytest.raises(ValueError, match=r"^allocator=.contiguous. needs at least one max_model_len slab \(16 b"):
        ps.check_pool(c, 15, "num_kv_blocks=15", BPB, "cpu", None)


def test_swap_blocks_and_check():
    c = EngineConfig(model="tiny", preemption_mode="swap", swap_space_bytes=10 * BPB + 7)
    assert ps.swap_blocks(c, BPB) == 10
    assert ps.swap_blocks(c.replace(preemption_mode="recompute"), BPB) == 0
    ps.check_swap(c, 9, BPB, 10 * BPB)
    ps.check_swap(c, 10, BPB, None)
    with pytest.raises(ValueError, match=rf"^swap_space_bytes={10 * BPB + 7} needs .* GiB of CPU swap space"):
        ps.check_swap(c, 10, BPB, 10 * BPB)


def test_no_torch_import():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(ps.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(n.split(".")[0] == "torch" for n in names)


# ---------------------------------------------------------------- max_model_len: the model's limit, memory permitting
BPT = 46_080  # the default model's fp32 K/V bytes per token (30 layers x 2 x 3 heads x 64 x 4 B)


def test_default_pool_grows_to_one_model_length_sequence_where_memory_permits():
    c = EngineConfig(model="tiny")  # max_model_len unset
    bpb = BPT * 16
    # 256 MiB hold 364 blocks = 5824 tokens, short of 8192: the default pool grows to 512 blocks
    assert ps.pool_blocks(c, bpb, "cpu", _never, want_tokens=8192, avail=8 * GiB) == (512, "max_model_len=8192")
    # memory does not permit (512 blocks = 360 MiB > 90 % of 390 MiB): the 256 MiB default stays
    assert ps.pool_blocks(c, bpb, "cpu", _never, want_tokens=8192, avail=390 * 2**20) == (
        364,
        f"kv_cache_bytes={256 * 2**20}",
    )
    assert ps.pool_blocks(c, bpb, "cpu", _never, want_tokens=8192, avail=None)[0] == 364  # unknown: no growth
    # a pool the user sized never grows
    assert ps.pool_blocks(c.replace(num_kv_blocks=8), bpb, "cpu", _never, want_tokens=8192, avail=8 * GiB) == (
        8,
        "num_kv_blocks=8",
    )
    k = c.replace(kv_cache_bytes=100 * bpb)
    assert ps.pool_blocks(k, bpb, "cpu", _never, want_tokens=8192, avail=8 * GiB) == (
        100,
        f"kv_cache_bytes={100 * bpb}",
    )


def test_unset_max_model_len_is_the_model_limit():
    c = EngineConfig(model="tiny")
    assert c.max_model_len is None
    assert ps.resolve_max_model_len(c, 8192, 512, "max_model_len=8192", BPT * 16) == (8192, None)
    assert ps.resolve_max_model_len(c.replace(max_model_len=2048), 8192, 512, "x", BPT * 16) == (2048, None)


def test_unset_max_model_len_drops_to_the_pool_with_a_message():
    c = EngineConfig(model="tiny")
    n, note = ps.resolve_max_model_len(c, 8192, 364, f"kv_cache_bytes={256 * 2**20}", BPT * 16)
    assert n == 364 * 16 == 5824
    assert note == (
        "one sequence of max_model_len=8192 tokens needs 360.0 MiB of KV cache; the pool "
        f"(kv_cache_bytes={256 * 2**20}) holds 5824 tokens (255.9 MiB); max_model_len is 5824 (the model's "
        "limit is 8192: give the pool more memory with kv_cache_bytes for the full length)"
    )


def test_explicit_max_model_len_the_pool_cannot_hold_is_refused():
    c = EngineConfig(model="tiny", max_model_len=8192)
    with pytest.raises(ValueError) as e:
        ps.resolve_max_model_len(c, 8192, 364, "gpu_memory_utilization=0.9", BPT * 16)
    assert str(e.value) == (
        "one sequence of max_model_len=8192 tokens needs 360.0 MiB of KV cache; the pool "
        "(gpu_memory_utilization=0.9) holds 5824 tokens (255.9 MiB). Lower max_model_len to at most 5824, "
        "or give the pool more memory (kv_cache_bytes, num_kv_blocks or gpu_memory_utilization)"
    )
    with pytest.raises(ValueError, match=r"^max_model_len=8193 exceeds the model's max_position_embeddings=8192$"):
        ps.resolve_max_model_len(c.replace(max_model_len=8193), 8192, 10**6, "x", BPT * 16)


def test_a_pool_the_user_sized_keeps_max_model_len_with_a_message():
    for c in (
        EngineConfig(model="tiny", num_kv_blocks=8),
        EngineConfig(model="tiny", num_kv_blocks=8, max_model_len=512),
    ):
        n, note = ps.resolve_max_model_len(c, 8192, 8, "num_kv_blocks=8", 4096)
        assert n == (c.max_model_len or 8192)
        assert note.startswith(f"one sequence of max_model_len={n} tokens needs ")
        assert note.endswith(
            "the pool (num_kv_blocks=8) holds 128 tokens (0.0 MiB); a request longer than 128 tokens is refused"
        )
