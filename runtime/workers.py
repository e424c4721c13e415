"""Rank worker processes and the model runner that drives them (tensor parallelism).

The ``LLM`` process keeps the scheduler, the block manager and the sampler; every step it
sends the step's inputs (NumPy arrays, pending copy-on-write block copies) to each rank over a
pipe, every rank runs its shard of the graph on its own KV cache (its heads only) and the
collectives inside the graph join the ranks; rank 0 sends the logits back.

Faults: the driver waits on the pipes *and* the processes' sentinels, so a rank that dies
(signal, exit, exception) is reported with its rank and exit code/signal within a poll
interval, and every other worker is torn down (terminate, then kill) before the error is
raised. :meth:`WorkerGroup.shutdown` reaps every worker; it is idempotent and also runs at
interpreter exit.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import threading
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable

import numpy as np
import torch

from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch


class WorkerError(RuntimeError):
    """A rank worker died or raised; the message names the rank and the signal or exit code."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_LIVE_GROUPS: "weakref.WeakSet[WorkerGroup]" = weakref.WeakSet()


@atexit.register
def _reap_all() -> None:  # interpreter exit: no orphan workers
    for group in list(_LIVE_GROUPS):
        group.shutdown()


class WorkerGroup:
    """``world`` spawned processes running ``target(rank, conn, *args[rank])``; messages are
    pickled tuples over one duplex pipe per rank."""

    def __init__(self, target: Callable, per_rank_args: list[tuple], *, start_timeout: float = 600.0):
        ctx = mp.get_context("spawn")
        self.world = len(per_rank_args)
        self.conns = []
        self.procs = []
        self._closed = False
        self._lock = threading.Lock()
        self._early: list[list] = [[] for _ in per_rank_args]  # messages read while waiting on another rank
        for rank, args in enumerate(per_rank_args):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=target, args=(rank, child, *args), name=f"fxcompiler-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        _LIVE_GROUPS.add(self)
        self.start_timeout = start_timeout

    # -- messaging ----------------------------------------------------------------------------------
    def send_all(self, msg: Any) -> None:
        for rank, c in enumerate(self.conns):
            try:
                c.send(msg)
            except (BrokenPipeError, OSError):
                self._fail(rank)

    def recv(self, rank: int, timeout: float | None = None) -> Any:
        """The next message of ``rank``; raises :class:`WorkerError` (after tearing every worker
        down) as soon as any rank dies or reports an error, or after ``timeout`` seconds."""
        if self._early[rank]:
            return self._early[rank].pop(0)
        conn = self.conns[rank]
        watched = [conn, *(p.sentinel for p in self.procs), *(c for i, c in enumerate(self.conns) if i != rank)]
        while True:
            ready = wait(watched, timeout)
            if not ready:
                self.shutdown()
                raise WorkerError(f"rank {rank} did not answer within {timeout:.0f} s")
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank)
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    self.shutdown(timeout=0.2)
                    raise WorkerError(f"rank {rank} raised: {msg[1]}")
                return msg
            for r, p in enumerate(self.procs):
                if p.sentinel in ready:
                    p.join(0.1)
                    self._fail(r)
            for r, c in enumerate(self.conns):
                if r != rank and c in ready:
                    try:
                        other = c.recv()
                    except (EOFError, OSError):
                        self._fail(r)
                    if isinstance(other, tuple) and other and other[0] == "error":
                        self.shutdown(timeout=0.2)
                        raise WorkerError(f"rank {r} raised: {other[1]}")
                    self._early[r].append(other)  # e.g. another rank's start-up report
                    watched.remove(c)

    def recv_all(self, timeout: float | None = None) -> list[Any]:
        return [self.recv(r, timeout) for r in range(self.world)]

    def _fail(self, rank: int):
        code = self.procs[rank].exitcode
        self.shutdown(timeout=0.2)  # peers may be spinning in a collective with the dead rank
        raise WorkerError(f"rank {rank} worker (pid {self.procs[rank].pid}) {_describe_exit(code)}; "
                          "every other rank was shut down")

    # -- teardown -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask every worker to exit, then terminate and kill what is left; joins them all."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for c in self.conns:
            try:
                c.send(("exit",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout if p.is_alive() else 0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(2.0)
        for c in self.conns:
            c.close()
        _LIVE_GROUPS.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


class WorkerGroups:
    """The worker groups of a plan's data-parallel replicas (one group each), reaped together."""

    def __init__(self):
        self.groups: list[WorkerGroup] = []

    def append(self, group: WorkerGroup) -> None:
        self.groups.append(group)

    def shutdown(self, timeout: float = 5.0) -> None:
        for g in self.groups:
            g.shutdown(timeout)

    def pids(self) -> list[int]:
        return [p for g in self.groups for p in g.pids()]


class LocalStepRunner(ModelRunner):
    """:class:`ModelRunner` whose step is a function of ``(bucket, arrays, copies)`` (torchrun's rank 0:
    broadcast to the other ranks, then run its own shard)."""

    steps_concurrently = True  # a replica's step waits on its own ranks: the router steps replicas at once

    def __init__(self, step: Callable, blocks: BlockManager, micro_batches: int = 1):
        super().__init__({}, RemoteKVCache(blocks.num_blocks, blocks.block_size), blocks, torch.device("cpu"))
        self.step_fn = step
        self.micro_batches = micro_batches  # as ParallelModelRunner's

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.kv.copy_blocks(self.blocks.take_pending_copies())
        inputs = self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch)
        return self.run(batch.bucket, inputs)

    def run(self, bucket, inputs: tuple) -> torch.Tensor:
        copies, self.kv.pending = self.kv.pending, []
        return self.step_fn(bucket, [t.numpy() for t in inputs], copies, self.micro_batches)


class RemoteKVCache:
    """Stands in for :class:`~runtime.block_manager.PagedKVCache` in the ``LLM`` process: the
    caches live in the rank workers, so the step inputs carry no cache tensors and the
    copy-on-write block copies are forwarded with the next step."""

    def __init__(self, num_blocks: int, block_size: int):
        self.k: list = []
        self.v: list = []
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pending: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.pending.extend(pairs)


def micro_batch_rows(num_rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """``min(micro_batches, num_rows)`` contiguous row ranges of near-equal size covering ``num_rows``."""
    m = max(1, min(int(micro_batches), num_rows))
    base, extra = divmod(num_rows, m)
    bounds, r0 = [], 0
    for i in range(m):
        r1 = r0 + base + (i < extra)
        bounds.append((r0, r1))
        r0 = r1
    return bounds


def split_step_arrays(arrays: list[np.ndarray], micro_batches: int) -> list[list[np.ndarray]]:
    """A step's ``(ids, pos, table, slots, seq_lens, logits_idx)`` cut into micro-batches of whole rows.

    ``logits_idx`` holds flat ``row * T + token`` indices in row order, so each micro-batch keeps the
    indices of its rows (shifted to its own first row) and the micro-batches' logits, concatenated
    in order, are the whole step's."""
    ids, pos, table, slots, seq_lens, logits_idx = arrays
    T = ids.shape[1]
    parts = []
    for r0, r1 in micro_batch_rows(ids.shape[0], micro_batches):
        keep = (logits_idx >= r0 * T) & (logits_idx < r1 * T)
        parts.append([ids[r0:r1], pos[r0:r1], table[r0:r1], slots[r0:r1], seq_lens[r0:r1], logits_idx[keep] - r0 * T])
    return parts


class ParallelModelRunner(ModelRunner):
    """:class:`ModelRunner` whose step runs in the rank workers (inputs broadcast, logits from rank 0).

    ``micro_batches`` (default: the number of pipeline stages) cuts each step into that many
    micro-batches of rows, which the stages work on one after the other: while stage s + 1 runs
    micro-batch i, stage s runs i + 1, so the stages overlap instead of waiting for each other.
    1 runs a step as one batch."""

    def __init__(self, workers: WorkerGroup, blocks: BlockManager, step_timeout: float = 600.0, logits_rank: int = 0,
                 micro_batches: int = 1):
        super().__init__({}, RemoteKVCache(blocks.num_blocks, blocks.block_size), blocks, torch.device("cpu"))
        self.workers = workers
        self.step_timeout = step_timeout
        self.logits_rank = logits_rank  # TP rank 0 of the last pipeline stage
        self.micro_batches = micro_batches

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.kv.copy_blocks(self.blocks.take_pending_copies())
        inputs = self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch)
        return self.run(batch.bucket, inputs)

    def run(self, bucket, inputs: tuple) -> torch.Tensor:
        """Broadcast the step's arrays (and the pending block copies) to the ranks; the logits come back."""
        copies, self.kv.pending = self.kv.pending, []
        arrays = [t.numpy() for t in inputs]
        self.workers.send_all(("step", bucket, arrays, copies, self.micro_batches))
        msg = self.workers.recv(self.logits_rank, self.step_timeout)
        return torch.from_numpy(msg[1])


def die_with_parent() -> None:
    """In a worker: be killed when the ``LLM`` process dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``),
    so that no rank outlives it spinning in a collective."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the driver's atexit reaping remains
        pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def serve_steps(conn, run_step: Callable[..., torch.Tensor | None], rank: int,
                sends_logits: bool | None = None) -> None:
    """A worker's loop: run each ``("step", bucket, arrays, copies, micro_batches)``; the logits rank
    (default rank 0) answers with the logits. Exceptions are reported to the driver as
    ``("error", text)`` before exiting."""
    sends_logits = rank == 0 if sends_logits is None else sends_logits
    import traceback

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "exit":
            return
        try:
            if msg[0] != "step":
                raise ValueError(f"unknown message {msg[0]!r}")
            out = run_step(*msg[1:])
            if sends_logits:
                conn.send(("logits", out.numpy()))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
            return
