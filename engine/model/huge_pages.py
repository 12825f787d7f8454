"""CPU memory that the C kernels stream through every step, asked for in 2 MiB pages.

A decode step reads every packed weight once (the default model's Q4_1 panels: 97 MB with the
lm_head, over 23,000 pages of 4 KiB). Linux gives transparent huge pages only to regions that ask
for them where THP is in its common "madvise" mode, and neither torch's allocator nor a tensor of a
few hundred KB asks; so every 4 KiB of a weight stream was a TLB miss and a page walk. Here the
panels are carved out of anonymous mappings that ask (MADV_HUGEPAGE), each one's huge-page part
aligned to 2 MiB. Where the OS has no huge pages, or says no, this is ordinary zeroed memory.

`empty(numel, dtype)` is a 1-D tensor (64-byte aligned; contents zero, as mmap leaves them): many
small requests share one mapping, which lives as long as any tensor cut from it does.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20  # bytes per shared mapping (a larger request gets a mapping of its own)
ALIGN = 64

_lock = threading.Lock()
# the shared mapping small requests are cut from: (its tensor, next free offset, end); at most one
# such mapping (CHUNK bytes, of which only the pages touched are memory) outlives its tensors
_current: list = [None, 0, 0]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _mapping(nbytes: int) -> tuple[torch.Tensor, int]:
    """A uint8 tensor over a fresh anonymous mapping of at least nbytes from a 2 MiB boundary, and
    that boundary's offset in it."""
    size = _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # THP off, or not this kernel's: 4 KiB pages, the same bytes
            pass
    t = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping while any view of it lives
    return t, (-t.data_ptr()) % HUGE_PAGE


def empty(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements of `dtype` in memory that asked for huge pages."""
    nbytes = max(1, int(numel) * dtype.itemsize)
    with _lock:
        chunk, off, end = _current
        if chunk is None or off + nbytes > end:
            if nbytes > CHUNK // 2:
                big, start = _mapping(nbytes)
                return big[start : start + nbytes].view(dtype)
            chunk, off = _mapping(CHUNK)
            end = off + CHUNK
        _current[:] = [chunk, _round_up(off + nbytes, ALIGN), end]
    return chunk[off : off + nbytes].view(dtype)
