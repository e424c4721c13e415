"""Parameter memory: page-aligned anonymous regions that tensors are read into directly.

A cached program's parameters are read from ``params.safetensors`` into one anonymous mapping
(:func:`allocate`), each tensor starting on its own 4 KiB boundary, instead of one heap
allocation per tensor. The CPU backend then asks the kernel to back such a region with
transparent huge pages in place (``backends/cpu/huge_pages.py``) instead of copying every
weight into a second mapping. :func:`region_of` tells which region, if any, holds a tensor.

Requires: only the standard library and torch. Ensures: a region lives as long as any tensor
viewing it; its pages are 4 KiB pages until someone advises otherwise.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Region", "aligned", "allocate", "region_of"]

ALIGN = 4096  # every tensor starts on its own page (kernels load vectors unaligned anyway)


@dataclass(frozen=True)
class Region:
    """One anonymous mapping: its start address, size and the ``mmap`` that owns it."""

    address: int
    nbytes: int
    mapping: mmap.mmap


_lock = threading.Lock()
_regions: dict[int, "weakref.ref[mmap.mmap]"] = {}  # start address -> the live mapping
_sizes: dict[int, int] = {}


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
    with _lock:
        _regions[address] = weakref.ref(mapping, lambda _ref, a=address: _forget(a))
        _sizes[address] = size
    return Region(address, size, mapping), pool


def _forget(address: int) -> None:
    with _lock:
        _regions.pop(address, None)
        _sizes.pop(address, None)


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
                return Region(address, size, mapping)
    return None
