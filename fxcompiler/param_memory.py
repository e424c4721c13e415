"""Parameter memory: page-aligned anonymous regions that tensors are read into directly.

Parameters read from a safetensors file go into one anonymous mapping (:func:`allocate`), each
tensor starting on its own 4 KiB boundary, instead of one heap allocation per tensor. The CPU
backend then asks the kernel to back such a region with transparent huge pages in place
(``backends/cpu/huge_pages.py``) instead of copying every weight into a second mapping.
:func:`region_of` tells which region, if any, holds a tensor.

A cached program's ``params.safetensors`` (verified before use) is instead mapped copy-on-write
(:func:`map_file`): a warm start then reads nothing before its first step (reading 757 MB into fresh
anonymous pages cost SmolLM2's warm start ~0.4 s of CPU), and the first step maps page-cache pages.
:func:`make_anonymous` later moves the bytes into private anonymous memory at the same addresses, a
piece at a time (copy, then ``mremap`` onto the piece), so the region no longer depends on the file
and can be collapsed into huge pages; the CPU backend does it in its background huge-page thread.

Requires: only the standard library and torch. Ensures: a region lives as long as any tensor
viewing it; its pages are 4 KiB pages until someone advises otherwise; tensor addresses never move.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Region", "aligned", "allocate", "make_anonymous", "map_file", "region_of", "trim_heap", "HeapTrimmer"]

ALIGN = 4096  # every tensor starts on its own page (kernels load vectors unaligned anyway)


@dataclass(frozen=True)
class Region:
    """One mapping: its start address, size and the ``mmap`` that owns it; ``file_backed``: a private
    mapping of a file (:func:`map_file`) not yet moved into anonymous memory (:func:`make_anonymous`)."""

    address: int
    nbytes: int
    mapping: mmap.mmap
    file_backed: bool = False


_lock = threading.Lock()
_regions: dict[int, "weakref.ref[mmap.mmap]"] = {}  # start address -> the live mapping
_sizes: dict[int, int] = {}
_file_backed: set[int] = set()  # start addresses of regions still mapping their file


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def allocate(nbytes: int) -> tuple[Region, torch.Tensor]:
    """A fresh private anonymous mapping of at least ``nbytes`` and a ``uint8`` tensor over it.

    The tensor (and every view of it) keeps the mapping alive."""
    size = max(ALIGN, aligned(nbytes))
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(mapping, dtype=torch.uint8)
    address = pool.data_ptr()
    _register(address, size, mapping)
    return Region(address, size, mapping), pool


def map_file(path: str | os.PathLike) -> tuple[Region, torch.Tensor]:
    """A private copy-on-write mapping of the whole file ``path`` and a ``uint8`` tensor over it.

    Nothing is read until touched (page-cache pages are mapped then); writes stay private. The caller
    must have verified the file (its checksum) first: the mapping shows the file's bytes until
    :func:`make_anonymous` moves them into anonymous memory."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{os.fspath(path)}: empty file")
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pool = torch.frombuffer(mapping, dtype=torch.uint8)
    address = pool.data_ptr()
    _register(address, size, mapping, file_backed=True)
    return Region(address, size, mapping, file_backed=True), pool


def _register(address: int, size: int, mapping: mmap.mmap, file_backed: bool = False) -> None:
    with _lock:
        _regions[address] = weakref.ref(mapping, lambda _ref, a=address: _forget(a))
        _sizes[address] = size
        if file_backed:
            _file_backed.add(address)


def _forget(address: int) -> None:
    with _lock:
        _regions.pop(address, None)
        _sizes.pop(address, None)
        _file_backed.discard(address)


_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_PIECE = 32 << 20  # bytes moved per step: at most this much is resident twice at a time


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mremap.restype = ctypes.c_void_p
    return libc


def make_anonymous(region: Region) -> bool:
    """Move a file-backed region's bytes into private anonymous memory at the same addresses.

    Piece by piece (32 MiB, on 2 MiB boundaries like the huge-page collapse): a fresh anonymous
    mapping gets a copy of the piece, then ``mremap`` puts it in the piece's place, which unmaps the
    file pages there in the same step (a thread touching the piece meanwhile waits for the kernel and
    sees the same bytes). Tensors keep their addresses and values; the region no longer reads the
    file. Returns True when the whole region is anonymous (also when it already was), False where
    this platform cannot (the region then stays a file mapping, still correct)."""
    with _moving:  # one mover at a time (in-process data-parallel engines share one region)
        return _make_anonymous(region)


_moving = threading.Lock()


def _make_anonymous(region: Region) -> bool:
    if region.address not in _file_backed:
        return True
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return False
    huge = 2 << 20
    end = region.address + region.nbytes
    cuts = [region.address, *range(-(-region.address // huge) * huge + _PIECE, end, _PIECE), end]
    for start, stop in zip(cuts, cuts[1:]):
        n = stop - start
        if n <= 0:
            continue
        tmp = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if tmp is None or tmp == ctypes.c_void_p(-1).value:
            return False
        ctypes.memmove(tmp, start, n)
        moved = libc.mremap(tmp, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
        if moved != start:
            libc.munmap(tmp, n)  # the piece still maps the file: correct, only not anonymous
            return False
    with _lock:
        _file_backed.discard(region.address)
    return True


def region_of(t: torch.Tensor) -> Region | None:
    """The live region that holds all of ``t``'s bytes, or None (heap memory, other mappings)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return None
    start = t.untyped_storage().data_ptr()
    with _lock:
        for address, ref in _regions.items():
            size = _sizes[address]
            if address <= start < address + size:
                mapping = ref()
                if mapping is None:
                    return None
                return Region(address, size, mapping, file_backed=address in _file_backed)
    return None


_malloc_trim = None


def trim_heap() -> None:
    """Hand the heap pages freed so far back to the OS (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    glibc keeps freed chunks below its adaptive mmap threshold mapped, so weights a build replaced
    (transposed, fused, repacked) stay resident beside their replacements until a trim: a few ms."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


class HeapTrimmer:
    """:func:`trim_heap` each time ``every`` bytes of weights have been replaced: a pass that swaps weights
    one by one (transposed, repacked) then keeps its high-water near one copy of them instead of two."""

    def __init__(self, every: int = 32 << 20):
        self.every, self._pending = every, 0

    def replaced(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending >= self.every:
            trim_heap()
            self._pending = 0
