"""The KV pool's size in blocks, from the config and the memory figures the engine reads: plain
numbers in, block counts or a ValueError naming the field out. No torch: engine/core/engine.py reads
the device's free memory and hands the figures here.

Which field sizes the pool: `num_kv_blocks` if set; else `gpu_memory_utilization` on CUDA when
`kv_cache_bytes` is unset; else `kv_cache_bytes` (default DEFAULT_KV_BYTES, capped at
MAX_DEFAULT_BLOCKS). A pool (or swap space) may take at most MEMORY_FRACTION of the memory
available, checked before anything is allocated (zero-filling a too-big pool tensor by tensor would
end in the OOM killer, taking the server down).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.model.device import activation_reserve_bytes, gpu_kv_budget_bytes
from engine.model.kv_layout import cdiv

DEFAULT_KV_BYTES = 256 * 1024 * 1024
MAX_DEFAULT_BLOCKS = 4096
MAX_BLOCKS = 1_000_000  # same cap as EngineConfig.num_kv_blocks, also for kv_cache_bytes
MEMORY_FRACTION = 0.9  # of the available memory a KV pool (or swap space) may take


def gpu_budget(
    mem: tuple[int, int] | None,
    config: EngineConfig,
    itemsize: int,
    hidden_size: int,
    intermediate_size: int | None,
    vocab_size: int,
) -> int:
    """KV bytes on CUDA from (free, total) device memory read after the weights loaded
    (DEFAULT_KV_BYTES where it could not be read), less one step's activation reserve."""
    if mem is None:
        return DEFAULT_KV_BYTES
    hidden = hidden_size or 0
    inter = intermediate_size or 4 * hidden
    reserve = activation_reserve_bytes(
        config.max_num_batched_tokens, hidden, inter, vocab_size, config.max_num_seqs, itemsize
    )
    return gpu_kv_budget_bytes(mem[0], mem[1], config.gpu_memory_utilization, reserve)


def gpu_pool_blocks(budget: int, bytes_per_block: int, utilization: float) -> tuple[int, str]:
    """(blocks, the field that sized them) for a CUDA pool sized by gpu_memory_utilization."""
    num_blocks = min(budget // bytes_per_block, MAX_BLOCKS)
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves {budget} bytes for "
            f"the KV cache, less than one block ({bytes_per_block} bytes)"
        )
    return num_blocks, f"gpu_memory_utilization={utilization}"


def pool_blocks(
    config: EngineConfig, bytes_per_block: int, device_type: str, gpu_blocks: Callable[[], tuple[int, str]]
) -> tuple[int, str]:
    """(blocks, the field that sized them, as "name=value"); `gpu_blocks` is called only for a
    CUDA pool sized by gpu_memory_utilization."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, f"num_kv_blocks={config.num_kv_blocks}"
    if config.kv_cache_bytes is None and device_type == "cuda":
        return gpu_blocks()
    budget = config.kv_cache_bytes or DEFAULT_KV_BYTES
    num_blocks = budget // bytes_per_block
    if config.kv_cache_bytes is None:
        num_blocks = min(num_blocks, MAX_DEFAULT_BLOCKS)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={budget} is smaller than one block "
            f"({bytes_per_block} bytes at block_size {config.block_size})"
        )
    return num_blocks, f"kv_cache_bytes={budget}"


def check_pool(
    config: EngineConfig,
    num_blocks: int,
    field_name: str,
    bytes_per_block: int,
    device_type: str,
    avail: int | None,
) -> None:
    """Refuse a pool the machine cannot hold (`avail`: bytes available on its device, None where
    unknown or already accounted for), over MAX_BLOCKS, or without room for one contiguous slab."""
    pool_bytes = num_blocks * bytes_per_block
    if avail is not None and pool_bytes > MEMORY_FRACTION * avail:
        raise ValueError(
            f"{field_name} needs {pool_bytes / 2**30:.1f} GiB of KV cache ({bytes_per_block} "
            f"bytes per block); the {device_type} has {avail / 2**30:.1f} GiB available and "
            f"the pool may use at most {MEMORY_FRACTION:.0%} of it"
        )
    if num_blocks > MAX_BLOCKS:
        raise ValueError(
            f"{field_name} gives {num_blocks} blocks; the limit is {MAX_BLOCKS} (raise block_size for a bigger pool)"
        )
    slab_blocks = cdiv(config.max_model_len, config.block_size)
    if config.allocator == "contiguous" and slab_blocks > num_blocks:
        raise ValueError(
            f"allocator='contiguous' needs at least one max_model_len slab "
            f"({slab_blocks} blocks); the pool has {num_blocks}"
        )


def swap_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """CPU swap blocks: swap_space_bytes in whole blocks under preemption_mode='swap', else 0."""
    return config.swap_space_bytes // bytes_per_block if config.preemption_mode == "swap" else 0


def check_swap(config: EngineConfig, num_swap: int, bytes_per_block: int, cpu_avail: int | None) -> None:
    """Refuse a swap space over MEMORY_FRACTION of `cpu_avail` (CPU bytes available, less a CPU
    pool's own bytes; None where unknown)."""
    if cpu_avail is not None and num_swap * bytes_per_block > MEMORY_FRACTION * cpu_avail:
        raise ValueError(
            f"swap_space_bytes={config.swap_space_bytes} needs "
            f"{num_swap * bytes_per_block / 2**30:.1f} GiB of CPU swap space; "
            f"{cpu_avail / 2**30:.1f} GiB of memory is available and the swap space may "
            f"use at most {MEMORY_FRACTION:.0%} of it"
        )
