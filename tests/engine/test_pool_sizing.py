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
