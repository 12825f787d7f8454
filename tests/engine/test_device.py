"""engine/model/device.py and the CUDA-only decisions, driven on the CPU: the devices the UI offers, the
KV budget from free device memory (gpu_memory_utilization) with mocked memory figures, what
attention "auto" means per device, CPU-only speed paths kept off other devices; and reduced
precision measured as agreement with transformers in the same dtype (fp32 stays exact elsewhere)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.lab.agreement import agreement, hf_greedy
from engine.model import device as dp
from engine.model.models import load_model, resolve_dtype
from engine.model.runner import ModelRunner

GiB = 2**30


def test_available_devices():
    assert dp.available_devices(False) == ["cpu"]
    assert dp.available_devices(True, 1) == ["cuda", "cpu"]
    assert dp.available_devices(True, 3) == ["cuda", "cuda:1", "cuda:2", "cpu"]
    assert dp.available_devices(True, 0) == ["cpu"]


def test_auto_attention_backend():
    assert dp.auto_attention_backend("cpu", True, True) == "cpu_kernel"
    assert dp.auto_attention_backend("cpu", False, True) == "torch"  # the C kernel is fp32 only
    assert dp.auto_attention_backend("cpu", True, False) == "torch"  # no compiler
    assert dp.auto_attention_backend("cuda", True, True) == dp.AUTO_ATTENTION["cuda"]
    assert dp.auto_attention_backend("cuda", False, True) != "cpu_kernel"


def test_gpu_kv_budget():
    # an 80 GiB device with 3 GiB in use (weights): 0.9 * 80 - 3 - 1 reserve = 68 GiB
    assert dp.gpu_kv_budget_bytes(77 * GiB, 80 * GiB, 0.9, 1 * GiB) == 68 * GiB
    # never more than is free now, less the reserve
    assert dp.gpu_kv_budget_bytes(10 * GiB, 80 * GiB, 1.0, 1 * GiB) == 9 * GiB
    # another process holds most of it: nothing left, not a negative pool
    assert dp.gpu_kv_budget_bytes(5 * GiB, 80 * GiB, 0.5, 1 * GiB) == 0
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        dp.gpu_kv_budget_bytes(1, 2, 1.5, 0)


def test_activation_reserve_grows_with_the_batch():
    a = dp.activation_reserve_bytes(512, 576, 1536, 49152, 32, 2)
    b = dp.activation_reserve_bytes(1024, 576, 1536, 49152, 32, 2)
    assert 0 < a < b
    assert a == 512 * (8 * 576 + 3 * 1536) * 2 + 4 * 32 * 49152 * 2


def test_gpu_memory_utilization_validated():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be a number in \(0, 1\], got 0$"):
        EngineConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=True)
    assert EngineConfig(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5


def test_engine_gpu_budget_from_mocked_memory():
    """The CUDA sizing the engine does (pool_sizing's gpu_budget and gpu_pool_blocks on the
    loaded model's config, dtype and block bytes) with the device's memory figures given: the
    pool gets utilization * total - in use - the activation reserve."""
    import engine.core.pool_sizing as ps

    llm = LLM(model="tiny", device="cpu", num_kv_blocks=8, gpu_memory_utilization=0.5)
    eng = llm.engine
    hf = eng.model.config

    def budget(mem, itemsize):
        return ps.gpu_budget(mem, eng.config, itemsize, hf.hidden_size, hf.intermediate_size, hf.vocab_size)

    def reserve(itemsize):
        c = eng.config
        return dp.activation_reserve_bytes(
            c.max_num_batched_tokens, hf.hidden_size, hf.intermediate_size, hf.vocab_size, c.max_num_seqs, itemsize
        )

    assert budget((30 * GiB, 40 * GiB), 2) == 20 * GiB - 10 * GiB - reserve(2)
    assert budget(None, 2) == ps.DEFAULT_KV_BYTES
    # the pool in blocks, as a CUDA engine sizes it (in the engine's dtype, float32 here)
    b4 = budget((30 * GiB, 40 * GiB), eng.dtype.itemsize)
    blocks, field = ps.gpu_pool_blocks(b4, eng.bytes_per_block, eng.config.gpu_memory_utilization)
    assert blocks == min((10 * GiB - reserve(4)) // eng.bytes_per_block, ps.MAX_BLOCKS)
    assert field == "gpu_memory_utilization=0.5"
    b0 = budget((20 * GiB, 40 * GiB), eng.dtype.itemsize)  # nothing left at 0.5
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.5 leaves 0 bytes for the KV cache"):
        ps.gpu_pool_blocks(b0, eng.bytes_per_block, eng.config.gpu_memory_utilization)


def test_cpu_only_paths_stay_off_other_devices_and_dtypes():
    model, _ = load_model("tiny", "cpu", "bfloat16")
    r = ModelRunner(model, num_blocks=8, block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert r.decode_kernel is None and r.attention_backend == "torch"
    assert r.linear_pack is None or all(m.weight.dtype == torch.float32 for m in r.linear_pack.members.keys())
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_cuda_requested_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device='cuda' requested but CUDA is not available"):
        LLM(model="tiny", device="cuda")


PROMPTS = [
    [1, 5, 7, 9, 11, 300, 400, 20],
    [1, 2, 3],
    [1] + list(range(100, 170)),
    [1, 42] * 9,
    [1] + list(range(2000, 2100, 3)),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["auto", "flex"])
def test_reduced_precision_agreement_is_measured(dtype, backend, record_property):
    """Not bit-equality: the engine and transformers round differently in 16-bit. The test reports
    the fraction of identical greedy tokens and the first divergence per request, and holds a
    loose floor (measured at this commit: 1.0 for the torch path, 0.82-1.0 for flex)."""
    model, _ = load_model("tiny", "cpu", dtype)
    ref = hf_greedy(model, PROMPTS, 24)
    llm = LLM(
        model="tiny",
        device="cpu",
        dtype=dtype,
        attention_backend=backend,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert llm.engine.info().dtype == dtype
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=24, ignore_eos=True))
    a = agreement([o.outputs[0].token_ids for o in outs], ref)
    record_property("agreement", a.as_dict())
    print(f"{dtype} {backend}: {a.identical}/{a.tokens} identical, first divergence {a.first_divergence}")
    assert a.tokens == 5 * 24
    assert a.fraction >= 0.5, a


def test_agreement_definition():
    a = agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6], [7, 8]])
    assert (a.tokens, a.identical, a.exact_requests, a.first_divergence) == (7, 5, 1, [None, 1, 1])
    assert not a.exact and a.fraction == 5 / 7
    with pytest.raises(ValueError):
        agreement([[1]], [])
