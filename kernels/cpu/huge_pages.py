"""Transparent huge pages for the large, long-lived CPU buffers the kernels stream: the paged KV
cache and the packed linear weights.

A decode step on the CPU reads every weight once and the whole KV cache in use once (for
SmolLM2-135M and 32 sequences of ~140 tokens, ~540 MB and ~200 MB a step), from memory. In
4 KiB pages each 4 KiB of those streams costs a TLB miss, and the hardware prefetchers stop at
every page boundary; in 2 MiB pages neither happens (decode attention 9.9 -> 8.8 ms a step,
the offline workload ~3% faster on one core; docs/benchmarks.md).

Linux backs an anonymous range with transparent huge pages (THP) when the range is advised
with ``madvise(MADV_HUGEPAGE)`` before it is first touched and
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the common default) or
``always``. Only the whole 2 MiB pages inside a buffer can be huge, so :func:`advise` advises
that interior and leaves the partial pages at either end as they are. Where THP is ``never``,
off Linux, or when the kernel finds no free huge page, the memory is the same, in 4 KiB pages:
this never changes a value, only how fast it is read. PyTorch's own switch for every large
allocation, ``THP_MEM_ALLOC_ENABLE=1``, is read once per process at its first allocation, so it
cannot be turned on from a library; this module advises just the buffers that matter.

The first huge pages a process takes can be slow to come by: on a virtual machine whose host
backs guest memory lazily, fresh 2 MiB pages were cleared at ~0.5 GB/s here (a 1.5 GB KV cache:
3.3 s the first time, 0.09 s once the pages had been used, against 0.5 s in 4 KiB pages every
time). ``KVPILOT_HUGE_PAGES=0`` (or ``false``/``off``/``no``) turns the advice off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from kvpilot.kernels.cpu import extension

ENV_VAR = "KVPILOT_HUGE_PAGES"
HUGE_PAGE = 2 * 1024 * 1024
"""Bytes of an x86-64 / arm64 transparent huge page (a PMD)."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice asking for transparent huge pages."""

logger = logging.getLogger(__name__)


def interior(address: int, nbytes: int, page: int = HUGE_PAGE) -> tuple[int, int]:
    """The whole ``page``-aligned pages inside ``[address, address + nbytes)``.

    Returns:
        ``(start, length)`` in bytes; ``length`` is 0 when no whole page fits.
    """
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise(tensor: torch.Tensor) -> int:
    """Ask for huge pages under ``tensor``'s memory (a CPU tensor not yet written: pages already
    touched stay 4 KiB until the kernel's background ``khugepaged`` merges them).

    Returns:
        Bytes advised: the whole 2 MiB pages inside the tensor; 0 on a non-CPU tensor, off
        Linux, with ``$KVPILOT_HUGE_PAGES`` off, or where ``madvise`` refuses (logged at debug
        level; the memory is unchanged).
    """
    if tensor.device.type != "cpu" or not extension.env_enabled(ENV_VAR):
        return 0
    start, length = interior(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    madvise = _madvise()
    if length == 0 or madvise is None:
        return 0
    if madvise(start, length, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return length


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, advised for huge pages (:func:`advise`);
    to be filled by the caller."""
    tensor = torch.empty(shape, dtype=dtype)
    advise(tensor)
    return tensor


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, its interior in huge pages where the
    system gives them (see :func:`advise`): allocated empty, advised, then zeroed."""
    return empty(shape, dtype).zero_()
