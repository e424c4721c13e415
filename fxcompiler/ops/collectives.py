"""Collective ops of tensor-parallel graphs: ``fxc::all_reduce`` and ``fxc::all_gather``.

``fxc::all_reduce(Tensor x, str group) -> Tensor``: the sum of ``x`` over the ranks of the
``torch.distributed`` process group named ``group`` (a new tensor; ``x`` is not modified).
``fxc::all_gather(Tensor x, int world, str group) -> Tensor``: the ``world`` ranks' ``x``
concatenated along dim 0 (rank order).

They are ordinary dispatcher ops, so every executor runs them (the fx backend's native
program, the Python plan, dfg); export and fake propagation see shapes only. The reference
kernel here (every device) is torch's functional collectives (``_c10d_functional.all_reduce``
/ ``all_gather_into_tensor`` + ``wait_tensor``) on the named group: gloo on CPU, NCCL on CUDA,
which is also the multi-host path. A backend may register a faster kernel under its dispatch
key: the CPU backend's shared-memory all-reduce (``backends/cpu/comm.py``) serves groups that
joined a shared-memory segment and falls back to the same functional collectives otherwise.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("all_reduce(Tensor x, str group) -> Tensor")
_lib.define("all_gather(Tensor x, int world, str group) -> Tensor")


@torch.library.register_fake("fxc::all_reduce", lib=_lib)
def _all_reduce_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fxc::all_gather", lib=_lib)
def _all_gather_fake(x, world, group):
    return x.new_empty((x.shape[0] * world, *x.shape[1:]))


def all_reduce_reference(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the process group ``group`` through torch's functional collectives (c10d)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor.default(c10d.all_reduce.default(x.contiguous(), "sum", group))


def all_gather_reference(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Dim-0 concatenation over the process group ``group`` (functional collectives)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x.contiguous(), world, group))


_lib.impl("all_reduce", all_reduce_reference, "CompositeExplicitAutograd")
_lib.impl("all_gather", all_gather_reference, "CompositeExplicitAutograd")

all_reduce = torch.ops.fxc.all_reduce.default
all_gather = torch.ops.fxc.all_gather.default


# -- pipeline parallel: hidden states sent rank to rank ------------------------------------------------
# ``fxc::pp_send(Tensor x, int dst) -> Tensor``: send ``x`` to global rank ``dst`` of the default
# process group; returns an empty tensor (the stage's graph output). ``fxc::pp_recv(Tensor ids, int
# hidden, ScalarType dtype, int src) -> Tensor``: receive a ``[*ids.shape, hidden]`` tensor from ``src``
# (``ids`` only gives the step's batch and token counts). Point-to-point c10d (gloo on CPU).
_lib.define("pp_send(Tensor x, int dst) -> Tensor")
_lib.define("pp_recv(Tensor ids, int hidden, ScalarType dtype, int src) -> Tensor")


@torch.library.register_fake("fxc::pp_send", lib=_lib)
def _pp_send_fake(x, dst):
    return x.new_empty((0,))


@torch.library.register_fake("fxc::pp_recv", lib=_lib)
def _pp_recv_fake(ids, hidden, dtype, src):
    return ids.new_empty((*ids.shape, hidden), dtype=dtype)


def pp_send_reference(x: torch.Tensor, dst: int) -> torch.Tensor:
    import torch.distributed as dist

    dist.send(x.contiguous(), dst)
    return x.new_empty((0,))


def pp_recv_reference(ids: torch.Tensor, hidden: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty((*ids.shape, hidden), dtype=dtype, device=ids.device)
    dist.recv(out, src)
    return out


_lib.impl("pp_send", pp_send_reference, "CompositeExplicitAutograd")
_lib.impl("pp_recv", pp_recv_reference, "CompositeExplicitAutograd")

pp_send = torch.ops.fxc.pp_send.default
pp_recv = torch.ops.fxc.pp_recv.default
