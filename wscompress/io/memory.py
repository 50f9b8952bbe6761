"""Handing memory back to the operating system: mapped checkpoint pages once read, and freed
large allocations, on huge pages; and idle BLAS threads that give their cores back.
``setup_process`` does the last three for the ``wscompress`` command's process (a library import
changes nothing process-wide)."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_PAGEOUT = 21  # reclaim: clean file pages are dropped (read again if needed), nothing is lost


def page_out(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the whole pages under ``t`` (a no-op where it cannot)."""
    page = mmap.PAGESIZE
    storage = t.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    lo, hi = -(-begin // page) * page, end // page * page
    if hi > lo:
        _libc.madvise(lo, hi - lo, MADV_PAGEOUT)


def file_backed(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a mapping of a file (a memory-mapped checkpoint), from
    /proc/self/maps; False where that cannot be read. Paging out anonymous memory would send it
    to swap, so only file pages are handed back."""
    address = t.untyped_storage().data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= address < hi:
                    return fields[4] != "0" and len(fields) > 5  # an inode and a path
    except OSError:
        pass
    return False


def return_large_frees(threshold: int = 4 << 20) -> None:
    """Make glibc serve allocations of ``threshold`` bytes or more from their own mappings, which
    go back to the system when freed. By default glibc raises that threshold to 32 MB after the
    first large free, so later tensors up to 32 MB live on a heap that fragments as layers come
    and go: a 1B model's calibration grew 0.3 GB that way (peak 6.13 -> 5.81 GB with this).
    A no-op where the C library is not glibc or the user set ``MALLOC_MMAP_THRESHOLD_``."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(-3, threshold)  # M_MMAP_THRESHOLD (also turns the dynamic threshold off)


def tensors_on_huge_pages() -> None:
    """Have torch back CPU tensors of 2 MB or more with transparent huge pages (torch's
    ``THP_MEM_ALLOC_ENABLE``, read at its first CPU allocation, so call this before any tensor is made).
    Every large tensor is a fresh mapping (see :func:`return_large_frees`) whose pages fault in
    on first touch: 4 KB pages cost a 135M model's calibration 43 M faults and 80 s of system
    time, 2 MB pages a seventh of the faults (calibrate 248 -> 232 s, compress 377 -> 332 s,
    no higher peak memory, same output bits). Huge pages are only advised: where the kernel has
    none (THP ``never``), nothing changes. The user's own setting wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def idle_blas_threads() -> None:
    """Have OpenBLAS's threads (scipy's, which forms the Gram matrices where
    ``kernels/products.cpp`` does not apply) sleep as soon as a call
    ends instead of spinning for 2^28 cycles (~0.1 s) first: between two Gram updates torch runs
    the next layer on the same cores, and the spinning threads halved its speed (SmolLM2's
    up and down projections between Gram updates: 73.8 ms, 36.6 ms with this;
    ``scripts/experiments/bench_blas_threads.py``).
    Read when OpenBLAS loads, so call this before scipy does. The user's own setting wins."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def setup_process() -> None:
    """Set a process that runs wscompress's steps up for them: large frees returned, tensors on
    huge pages, BLAS threads that sleep. The ``wscompress`` command's process does it as the
    package loads; a program's ``import wscompress`` does not, so importing never changes a
    program's process. A program of one's own calls it before importing transformers (whose
    import loads scipy's BLAS, which reads its setting then) and before making a tensor."""
    return_large_frees()
    tensors_on_huge_pages()
    idle_blas_threads()
