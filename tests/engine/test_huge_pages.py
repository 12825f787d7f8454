"""engine/model/huge_pages.py: the memory the packed weights and the KV pools live in."""

import gc
import os

import pytest
import torch

from engine.model import huge_pages, kv_quant


def _vmflags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr (Linux /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.int8])
def test_empty_is_zeroed_aligned_and_of_its_size(dtype):
    t = huge_pages.empty(1000, dtype)
    assert t.shape == (1000,) and t.dtype == dtype and t.device.type == "cpu"
    assert t.data_ptr() % huge_pages.ALIGN == 0
    assert not t.view(torch.uint8).any()


def test_requests_never_overlap_and_the_first_of_a_mapping_starts_on_2_mib():
    ts = [huge_pages.empty(n, torch.uint8) for n in (1, 63, 64, 65, 4096, 100_000, 3_000_000)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in ts)
    assert all(a_end <= b_lo for (_, a_end), (b_lo, _) in zip(spans, spans[1:]))
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    assert [int(t[0]) for t in ts] == list(range(1, len(ts) + 1))
    big = huge_pages.empty(huge_pages.CHUNK, torch.uint8)  # its own mapping
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="a Linux kernel with transparent huge pages"
)
def test_the_memory_asked_for_huge_pages():
    """MADV_HUGEPAGE shows as "hg" in the mapping's VmFlags, for a weight panel and a KV pool."""
    w = huge_pages.empty(5000, torch.float32)
    pool = kv_quant.allocate("fp32", 64, 16, 3, 64, "cpu")
    for t in (w, pool):
        assert "hg" in _vmflags(t.data_ptr())


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_a_cpu_kv_pool_is_zeroed_in_its_storage_format(fmt):
    pool = kv_quant.allocate(fmt, 10, 16, 3, 64, "cpu")
    last = kv_quant.row_bytes(fmt, 64) if kv_quant.is_quantized(fmt) else 64
    assert pool.shape == (10, 16, 3, last) and pool.dtype == kv_quant.storage_dtype(fmt)
    assert pool.is_contiguous() and not pool.view(-1).view(torch.uint8).any()


def test_a_mapping_lives_while_a_tensor_cut_from_it_does():
    big = huge_pages.empty(huge_pages.CHUNK, torch.uint8)
    view = big[10:20]
    addr = big.data_ptr()
    del big
    view.fill_(7)  # still mapped: the view holds it
    assert _mapped(addr) and int(view.sum()) == 70
    del view
    gc.collect()
    assert not _mapped(addr)
