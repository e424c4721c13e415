"""Collective ops of tensor-parallel graphs: ``fxc::all_reduce`` and ``fxc::all_gather``.

``fxc::all_reduce(Tensor x, str group) -> Tensor``: the sum of ``x`` over the ranks of the
``torch.distributed`` process group named ``group`` (a new tensor; ``x`` is not modified).
``fxc::all_gather(Tensor x, int world, str group) -> Tensor``: the ``world`` ranks' ``x``
concatenated along dim 0 (rank order).

They are ordinary dispatcher ops, so every executor runs them (the fx backend's native
program, the Python plan, dfg); export and fake propagation see shapes only. The reference
kernels here run c10d on the named group: on CPU (gloo, also the multi-host path)
``dist.all_reduce`` / ``all_gather_single`` waited for in slices (below), on CUDA torch's
functional collectives (``_c10d_functional`` + ``wait_tensor``, NCCL). A backend may register a
faster kernel under its dispatch key: the CPU backend's shared-memory all-reduce
(``backends/cpu/comm.py``) serves groups that joined a shared-memory segment and falls back to
the functional collectives (in C++, without the slices) otherwise.

On CPU the references wait for their c10d work in slices, so that :func:`abort_collectives`
(torchrun's rank 0, once its watch declared a peer dead: ``fxcompiler/multihost.py``) ends a
wait that gloo would not end itself: its ring all-reduce can stay in a send to a killed peer's
closed connection until the process group's timeout (minutes), although gloo notices the closed
connection in most cases.
"""
from __future__ import annotations

from datetime import timedelta

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


_aborted: list[BaseException] = []  # set: every CPU collective of this process raises it
WAIT_SLICE = timedelta(seconds=0.25)


def abort_collectives(error: BaseException) -> None:
    """From now on every CPU collective of this process that waits, or starts, raises ``error``
    (its c10d work is abandoned: the job's process groups are unusable after a peer died)."""
    _aborted[:] = [error]


def clear_collectives_abort() -> None:
    """Undo :func:`abort_collectives` (a new job in this process)."""
    _aborted.clear()


def _raise_if_aborted() -> None:
    if _aborted:
        raise _aborted[0]


def wait_work(work) -> None:
    """Wait for a c10d collective's work; between slices of :data:`WAIT_SLICE`, raise the error
    given to :func:`abort_collectives` if it was called. The work's own error (a closed
    connection, gloo's timeout) is raised as it is. Not for gloo's point-to-point works: their
    timed wait is gloo's own, and the send or receive fails when it runs out."""
    while True:
        _raise_if_aborted()
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # failed, not a slice that ran out
                raise


def _group(name: str):
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(name)


def all_reduce_reference(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over the process group ``group``: c10d's all-reduce on CPU (gloo), waited for with
    :func:`wait_work`; torch's functional collectives elsewhere."""
    if x.device.type != "cpu":
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor.default(c10d.all_reduce.default(x.contiguous(), "sum", group))
    import torch.distributed as dist

    _raise_if_aborted()
    out = x.clone(memory_format=torch.contiguous_format)  # x is not modified
    wait_work(dist.all_reduce(out, op=dist.ReduceOp.SUM, group=_group(group), async_op=True))
    return out


def all_gather_reference(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Dim-0 concatenation over the process group ``group`` (as :func:`all_reduce_reference`)."""
    if x.device.type != "cpu":
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x.contiguous(), world, group))
    import torch.distributed as dist

    _raise_if_aborted()
    out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    wait_work(dist.all_gather_single(out, x.contiguous(), group=_group(group), async_op=True))
    return out


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

    if x.device.type == "cpu":
        _raise_if_aborted()
    dist.send(x.contiguous(), dst)  # not wait_work: a gloo send or recv whose timed wait runs out fails
    return x.new_empty((0,))


def pp_recv_reference(ids: torch.Tensor, hidden: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty((*ids.shape, hidden), dtype=dtype, device=ids.device)
    if out.device.type == "cpu":
        _raise_if_aborted()
    dist.recv(out, src)
    return out


_lib.impl("pp_send", pp_send_reference, "CompositeExplicitAutograd")
_lib.impl("pp_recv", pp_recv_reference, "CompositeExplicitAutograd")

pp_send = torch.ops.fxc.pp_send.default
pp_recv = torch.ops.fxc.pp_recv.default
