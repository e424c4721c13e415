"""Shared-memory collectives for the ranks of one host (the CPU kernels of ``fxc::all_reduce`` /
``fxc::all_gather``; C++ in ``csrc/shm_comm.cpp``).

gloo costs ~2 ms per small all-reduce on this machine; a tensor-parallel decode step of SmolLM2
has 62 of them. The shared-memory path copies each rank's tensor into its slot of one segment,
publishes a sequence number and sums the slots in rank order (vLLM's CPU communicator and
DeepSpeed's shm all-reduce do the same). gloo stays the reference, the set-up channel and the
multi-host path: a group name that did not join a segment is served by torch's functional
collectives.

:func:`join_shm_group` is collective over an initialised ``torch.distributed`` group: rank 0
creates the segment in ``/dev/shm``, every rank maps it, and rank 0 unlinks the file once all
have mapped it (no file outlives the ranks, even when they are killed).
"""
from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import torch

import fxcompiler.ops  # noqa: F401  (defines the fxc::all_reduce / all_gather schemas the kernels implement)

from . import _build

_SOURCE = Path(__file__).resolve().parent / "csrc" / "shm_comm.cpp"
_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "error": None}
DEFAULT_SLOT_BYTES = 1 << 20  # per rank and parity; larger tensors go through in chunks
_LINE = 64


def _load():
    flags = ["-O2"]
    name = f"fxc_shm_comm_{_build.source_digest([_SOURCE], flags)}"
    return _build.load_extension(name, [_SOURCE], flags)


def kernel_module():
    """The compiled module (its load registers the CPU kernels), or None with one warning."""
    return _build.load_once(_state, _lock, _load, "shared-memory all-reduce unavailable, using gloo")


def join_shm_group(group_name: str, *, slot_bytes: int = DEFAULT_SLOT_BYTES, pg=None) -> bool:
    """Make ``fxc::all_reduce``/``all_gather`` on ``group_name`` run through shared memory in every
    rank of ``pg`` (default: the world group). Collective: every rank must call it. Returns False
    (and the group keeps gloo) when the C++ module cannot be built here."""
    import torch.distributed as dist

    if slot_bytes <= 0 or slot_bytes % _LINE:
        raise ValueError(f"slot_bytes must be a positive multiple of {_LINE}, got {slot_bytes}")
    mod = kernel_module()
    ok = [mod is not None]
    oks: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(oks, ok[0], group=pg)
    if not all(oks):
        return False
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    path = [None]
    if rank == 0:
        path[0] = f"/dev/shm/fxc_shm_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        size = world * _LINE + world * 2 * slot_bytes
        fd = os.open(path[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    dist.broadcast_object_list(path, src=dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
    try:
        mod.join(group_name, path[0], rank, world, slot_bytes)
    finally:
        dist.barrier(group=pg)
        if rank == 0:
            os.unlink(path[0])
    return True


def leave_shm_group(group_name: str) -> None:
    mod = _state["module"]
    if mod is not None:
        mod.leave(group_name)


def is_shm_group(group_name: str) -> bool:
    mod = _state["module"]
    return bool(mod is not None and mod.joined(group_name))


__all__ = ["join_shm_group", "leave_shm_group", "is_shm_group", "kernel_module"]
