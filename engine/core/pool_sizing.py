"""The KV pool's size in blocks, from the config and the memory figures the engine reads: plain
numbers in, block counts or a ValueError naming the field out. No torch: engine/core/engine.py reads
the device's free memory and hands the figures here.

Which field sizes the pool: `num_kv_blocks` if set; else `gpu_memory_utilization` on CUDA when
`kv_cache_bytes` is unset; else `kv_cache_bytes` (default DEFAULT_KV_BYTES, capped at
MAX_DEFAULT_BLOCKS). A pool (or swap space) may take at most MEMORY_FRACTION of the memory
available, checked before anything is allocated (zero-filling a too-big pool tensor by tensor would
end in the OOM killer, taking the server down).

max_model_len (resolve_max_model_len): unset (None), it is the model's own limit (its HF config's
max_position_embeddings), as in vLLM. The default pool (no num_kv_blocks, no kv_cache_bytes, off
CUDA) grows past DEFAULT_KV_BYTES to hold one sequence of that length where memory permits
(MEMORY_FRACTION of the available memory). When the pool still cannot hold one such sequence:
- the user sized the pool (num_kv_blocks / kv_cache_bytes): max_model_len stays, with a warning:
  small pools are kvscope's way to watch preemption, and a request longer than the pool is refused
  on its own (engine/core/inputs.py);
- max_model_len was set explicitly: a ValueError at startup naming max_model_len, the KV bytes one
  such sequence needs, what the pool holds and the longest max_model_len that fits (vLLM raises
  the same way);
- max_model_len was unset: it drops to the tokens the pool holds, with a warning naming the field
  and the model's limit ("memory permitting").
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
FALLBACK_MAX_MODEL_LEN = 2048  # the model's limit where its config has no max_position_embeddings


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
    config: EngineConfig,
    bytes_per_block: int,
    device_type: str,
    gpu_blocks: Callable[[], tuple[int, str]],
    want_tokens: int | None = None,
    avail: int | None = None,
) -> tuple[int, str]:
    """(blocks, the field that sized them, as "name=value"); `gpu_blocks` is called only for a
    CUDA pool sized by gpu_memory_utilization. `want_tokens`: the max_model_len wanted (explicit or
    the model's limit); a default-sized pool grows to hold one sequence of it where that takes at
    most MEMORY_FRACTION of `avail` (bytes available; None: unknown, no growth)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, f"num_kv_blocks={config.num_kv_blocks}"
    if config.kv_cache_bytes is None and device_type == "cuda":
        return gpu_blocks()
    budget = config.kv_cache_bytes or DEFAULT_KV_BYTES
    num_blocks = budget // bytes_per_block
    if config.kv_cache_bytes is None:
        num_blocks = min(num_blocks, MAX_DEFAULT_BLOCKS)
        need = cdiv(want_tokens, config.block_size) if want_tokens else 0
        if num_blocks < need <= MAX_BLOCKS and avail is not None and need * bytes_per_block <= MEMORY_FRACTION * avail:
            return need, f"max_model_len={want_tokens}"
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
    # the engine checks its resolved config (max_model_len a number)
    slab_blocks = cdiv(config.max_model_len or 0, config.block_size)
    if config.allocator == "contiguous" and slab_blocks > num_blocks:
        raise ValueError(
            f"allocator='contiguous' needs at least one max_model_len slab "
            f"({slab_blocks} blocks); the pool has {num_blocks}"
        )


def resolve_max_model_len(
    config: EngineConfig, model_limit: int, num_blocks: int, field_name: str, bytes_per_block: int
) -> tuple[int, str | None]:
    """(max_model_len, a warning or None) for a pool of `num_blocks` sized by `field_name`, and the
    model's own limit (max_position_embeddings); see the module docstring for the three cases.
    ValueError naming max_model_len where it exceeds the model's limit, or was set explicitly and
    one such sequence does not fit a pool sized by memory."""
    explicit = config.max_model_len
    if explicit is not None and explicit > model_limit:
        raise ValueError(f"max_model_len={explicit} exceeds the model's max_position_embeddings={model_limit}")
    want = model_limit if explicit is None else explicit
    pool_tokens = num_blocks * config.block_size
    if pool_tokens >= want:
        return want, None
    need = cdiv(want, config.block_size) * bytes_per_block
    what = (
        f"one sequence of max_model_len={want} tokens needs {need / 2**20:.1f} MiB of KV cache; "
        f"the pool ({field_name}) holds {pool_tokens} tokens ({num_blocks * bytes_per_block / 2**20:.1f} MiB)"
    )
    if config.num_kv_blocks is not None or config.kv_cache_bytes is not None:
        return want, what + f"; a request longer than {pool_tokens} tokens is refused"
    if explicit is not None:
        raise ValueError(
            what + f". Lower max_model_len to at most {pool_tokens}, or give the pool more memory "
            "(kv_cache_bytes, num_kv_blocks or gpu_memory_utilization)"
        )
    if pool_tokens < 2:
        raise ValueError(what + "; max_model_len needs at least 2 tokens: give the pool more memory")
    return pool_tokens, (
        what + f"; max_model_len is {pool_tokens} (the model's limit is {model_limit}: "
        "give the pool more memory with kv_cache_bytes for the full length)"
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
