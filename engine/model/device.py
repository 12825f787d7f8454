"""Device decisions in one place, as pure functions the CPU test suite can drive with any numbers:
which devices the UI offers, how big the default KV pool is on a GPU, and what "auto" means for
the attention backend on each device type.

- KV budget on CUDA (vLLM's gpu_memory_utilization): the engine may hold `utilization` of the
  device's total memory; the weights and everything else already allocated count against it,
  a reserve for one step's activations is kept back, and the KV pool gets the rest.
- attention "auto": CPU in fp32 -> the C decode kernel where it builds (engine/model/csrc), else the
  torch reference; CUDA -> the torch reference (gather + SDPA) until scripts/gpu_check.sh has
  measured the FlexAttention path ("flex", engine/model/paged_flex.py) exact and faster on a GPU; it
  is selectable explicitly meanwhile.
- free memory (`available_bytes`, `cuda_memory`): the only two functions here that read the
  machine; the engine sizes its pool from them (engine/core/pool_sizing.py does the arithmetic).
"""

from __future__ import annotations

AUTO_ATTENTION = {"cpu": "cpu_kernel", "cuda": "torch"}


def available_devices(cuda_available: bool, cuda_count: int = 1) -> list[str]:
    """Device choices for the UI, the default first: every CUDA device when present, then CPU."""
    if not cuda_available or cuda_count < 1:
        return ["cpu"]
    return ["cuda"] + [f"cuda:{i}" for i in range(1, cuda_count)] + ["cpu"]


def detect_devices() -> list[str]:
    """available_devices() for this machine (imports torch)."""
    import torch

    ok = torch.cuda.is_available()
    return available_devices(ok, torch.cuda.device_count() if ok else 0)


def auto_attention_backend(device_type: str, dtype_is_fp32: bool, kernel_available: bool) -> str:
    """What attention_backend="auto" runs: "cpu_kernel", "flex" or "torch"."""
    choice = AUTO_ATTENTION.get(device_type, "torch")
    if choice == "cpu_kernel" and not (dtype_is_fp32 and kernel_available):
        return "torch"
    return choice


def activation_reserve_bytes(
    max_num_batched_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    max_num_seqs: int,
    itemsize: int,
) -> int:
    """A generous bound on one step's transient memory: a handful of [tokens, hidden] and
    [tokens, intermediate] activations, plus fp32 logits for every sequence's sampled row."""
    t = max_num_batched_tokens
    return int(t * (8 * hidden_size + 3 * intermediate_size) * itemsize + 4 * max_num_seqs * vocab_size * 2)


def gpu_kv_budget_bytes(free_bytes: int, total_bytes: int, utilization: float, reserve_bytes: int) -> int:
    """KV pool bytes on a GPU: utilization * total, less what is already in use (total - free),
    less the activation reserve; never more than is free now. 0 when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    in_use = max(0, total_bytes - free_bytes)
    budget = int(utilization * total_bytes) - in_use - reserve_bytes
    return max(0, min(budget, free_bytes - reserve_bytes))


def available_bytes(device) -> int | None:
    """Free memory a pool on `device` (a torch.device) would come from (CUDA: free device memory;
    CPU: MemAvailable), or None where it cannot be read."""
    if device.type == "cuda":
        got = cuda_memory(device)
        return got[0] if got else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cuda_memory(device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, or None where it cannot be read."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    except (RuntimeError, AssertionError, AttributeError):
        return None
