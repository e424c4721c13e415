"""Parameters in transparent huge pages: the decode step streams every weight once per token.

A batch-1 decode step reads all of the model's weights (269 MB for SmolLM2-135M in bf16) from
DRAM; on 4 KiB pages that is one TLB miss and page walk every 4 KiB of the stream.  Linux gives
anonymous memory 2 MiB pages when the region is advised ``MADV_HUGEPAGE`` (the kernel default
``transparent_hugepage=madvise`` gives them to nobody else), and torch's allocator advises only
when the process starts with ``THP_MEM_ALLOC_ENABLE=1``.  So the engine puts the large CPU
parameters into page-aligned anonymous mappings and has the kernel back those with huge pages.

Measured on the dev VM (2 threads, the 121 linears of one SmolLM2 decode step, both pools in one
process, 40-60 interleaved rounds): bf16 9.00 → 8.52 ms and 8.54 → 8.28 ms, fp32 16.15 → 15.82 ms
(3-5 %).

Start-up: faulting 2 MiB pages in is where the time goes (the kernel compacts memory to find
them: 1.46 s for SmolLM2's fp32 weights on a busy host, versus 0.15 s for the copy itself).  On
kernels with ``MADV_COLLAPSE`` (Linux 6.1+) nothing waits for it: the weights are placed on
4 KiB pages (a cached program's parameters are already read into such a mapping,
:mod:`fxcompiler.param_memory`, so they are not even copied) and a background thread collapses
the mappings into huge pages in place while the engine already serves (:func:`wait` blocks until
it is done).  Older kernels keep the former path: a mapping advised before the copy, faulted in
2 MiB pages synchronously.

``FXCOMPILER_HUGE_PAGES=0`` switches it off, ``=sync`` forces the synchronous path.  Where the
kernel has no transparent huge pages (``never``, or no ``madvise``) nothing is copied.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path

import torch

from fxcompiler import param_memory

__all__ = ["available", "place_in_huge_pages", "wait"]

_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """True where anonymous memory advised ``MADV_HUGEPAGE`` can get transparent huge pages."""
    if os.environ.get("FXCOMPILER_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _collapse_supported() -> bool:
    """Whether ``madvise(MADV_COLLAPSE)`` exists (Linux 6.1+) and the synchronous path is not forced."""
    if os.environ.get("FXCOMPILER_HUGE_PAGES", "1") == "sync":
        return False
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except (ValueError, AttributeError):
        return False
    return (major, minor) >= (6, 1)


def place_in_huge_pages(params: dict[str, torch.Tensor], min_bytes: int = 1 << 20) -> int:
    """Put the contiguous CPU tensors of ``params`` of at least ``min_bytes`` into huge-page mappings.

    Tensors already in a :mod:`fxcompiler.param_memory` region stay where they are (their region is
    collapsed in place); the others are copied into one new region, and the dict is updated in place
    (every holder of it sees the new tensors; the old ones are freed when nothing else holds them);
    values, dtypes, shapes and strides are unchanged.  Entries that are the same tensor (tied
    weights) stay one tensor.  Returns the bytes copied (0 when huge pages are not available or
    nothing qualifies).  With ``MADV_COLLAPSE`` the huge pages arrive in the background: :func:`wait`.

    A cached program's parameters come as a private mapping of their (verified) file
    (:func:`fxcompiler.param_memory.map_file`): the background thread first moves each such region into
    anonymous memory in place (:func:`fxcompiler.param_memory.make_anonymous`), also where nothing is
    collapsed (huge pages off or unavailable, only small tensors), so no engine keeps reading its file."""
    mapped = {r.address: r for t in params.values()
              if isinstance(t, torch.Tensor) and (r := param_memory.region_of(t)) is not None and r.file_backed}
    if not available():
        if mapped:
            _start_collapse(list(mapped.values()), collapse=False)
        return 0
    collapse = _collapse_supported()
    chosen: dict[tuple, list[str]] = {}
    resident: dict[int, param_memory.Region] = {}
    for name, t in params.items():
        if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
                and t.numel() * t.element_size() >= min_bytes):
            region = param_memory.region_of(t) if collapse else None
            if region is not None:
                resident[region.address] = region
                continue
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            chosen.setdefault(key, []).append(name)
    offset = 0
    if chosen:
        sizes = [params[names[0]].numel() * params[names[0]].element_size() for names in chosen.values()]
        region, pool = param_memory.allocate(sum(param_memory.aligned(s) for s in sizes))
        if not collapse:
            region.mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies fault 2 MiB pages in
        for names, size in zip(chosen.values(), sizes):
            src = params[names[0]]
            dst = pool[offset:offset + size].view(src.dtype).view(src.shape)
            dst.copy_(src)
            for name in names:
                params[name] = dst
            offset += param_memory.aligned(size)
        if collapse:
            resident[region.address] = region
        _release_freed_heap()
    if collapse and resident:
        _start_collapse(list(resident.values()))
    rest = [r for a, r in mapped.items() if not (collapse and a in resident)]
    if rest:  # mapped regions of small tensors only, or the synchronous path (big tensors copied above)
        _start_collapse(rest, collapse=False)
    return offset


_MADV_COLLAPSE = 25  # linux/mman.h (Python 3.11's mmap module does not name it)
_HUGE = 2 << 20
# Collapse in pieces on huge-page boundaries (the engine's threads keep running in between). Pieces that
# started at the region's 4 KiB-aligned address lost the huge page across every piece boundary, and
# 2 MiB pieces laid that way collapsed nothing at all.
_CHUNK = 32 << 20
# The background threads still running: each removes itself when done. A list that kept every thread
# until someone called wait() grew by one stopped Thread (~16 objects) per LLM, since a cached program's
# mapped parameters start a thread for every engine and nothing in serving calls wait().
_threads: list[threading.Thread] = []
_threads_lock = threading.Lock()


def _start_collapse(regions: list[param_memory.Region], collapse: bool = True) -> None:
    thread = threading.Thread(target=_run, args=(regions, collapse), name="fxcompiler-huge-pages", daemon=True)
    with _threads_lock:
        _threads.append(thread)
    thread.start()


def _run(regions: list[param_memory.Region], collapse: bool) -> None:
    try:
        _collapse(regions, collapse)
    finally:
        with _threads_lock:
            _threads.remove(threading.current_thread())


def _collapse(regions: list[param_memory.Region], collapse: bool = True) -> None:
    """Advise each region ``MADV_HUGEPAGE`` and collapse it into huge pages (holds the mappings meanwhile);
    a file-backed region is made anonymous first (only that, with ``collapse=False``)."""
    if not collapse:
        for region in regions:
            param_memory.make_anonymous(region)
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for region in regions:
        if region.file_backed and not param_memory.make_anonymous(region):  # a cached program's mapped file
            continue  # no mremap here: it stays a file mapping (4 KiB pages)
        libc.madvise(region.address, region.nbytes, mmap.MADV_HUGEPAGE)  # later faults / khugepaged: huge too
        first = -(-region.address // _HUGE) * _HUGE  # pieces on huge-page boundaries: a piece that holds no
        end = region.address + region.nbytes        # whole aligned 2 MiB page collapses nothing
        for start in range(first, end - _HUGE + 1, _CHUNK):
            n = min(_CHUNK, (end - start) // _HUGE * _HUGE)
            if libc.madvise(start, n, _MADV_COLLAPSE) != 0 and ctypes.get_errno() == 22:
                return  # EINVAL: this kernel has no MADV_COLLAPSE (khugepaged still may collapse later)
            # other errors (EAGAIN, ENOMEM: no huge page free right now) leave that piece on 4 KiB pages


def wait(timeout: float | None = None) -> bool:
    """Block until the background collapses started so far are done; False on timeout."""
    with _threads_lock:
        running = list(_threads)
    for thread in running:
        thread.join(timeout)
        if thread.is_alive():
            return False
    return True


def _release_freed_heap() -> None:
    """Give the heap pages of the replaced tensors back to the OS (glibc keeps freed heap memory mapped)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is reused by later allocations instead
        pass
