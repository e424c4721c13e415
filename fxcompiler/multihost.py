"""Several hosts: the same program under ``torchrun`` (env:// rendezvous), one rank a process.

Every host runs the same script, e.g. on two hosts with one rank each::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 app.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 app.py

where ``app.py`` builds ``LLM(model, tensor_parallel_size=2)``: torchrun's world size must be
``data_parallel_size × pipeline_parallel_size × tensor_parallel_size``. Ranks are laid out
``[dp][pp][tp]`` (tp fastest): replica ``d`` is ranks ``[d·R, (d+1)·R)`` with ``R = tp·pp``, each
replica a full engine. Every rank joins the default process group (gloo: the ranks may be on
different hosts, so no shared memory) and builds its shard with the ``mppp`` pass; the
tensor-parallel collectives of each (replica, stage) run on its own ``dist.new_group``, the
pipeline sends and receives on the default group between global ranks.

Control plane: torchrun's TCPStore (``MASTER_ADDR:MASTER_PORT``), not collectives, so that an
idle job never hits a collective timeout and a dead rank is noticed while the others wait.
Rank 0's ``LLM`` holds one engine per replica behind the router (``runtime/router.py``); a step
of replica ``d`` is a pickled message under ``r{d}/s{n}`` that the replica's ranks wait for,
and the replica's logits rank (TP rank 0 of its last stage) answers under ``r{d}/l{n}`` unless
that is rank 0 itself. The router steps the replicas at once (a thread each, a store client
each), since a replica's step only waits on its own ranks. On every other rank ``LLM(...)`` serves steps and ends the process
(``SystemExit(0)``) when rank 0's ``LLM`` shuts down, so only rank 0 runs the code after it.

Faults: every rank bumps a heartbeat counter ``hb/{rank}`` every ``HEARTBEAT_S``. Rank 0
watches every counter (a background thread, also while idle); a rank whose counter stands still
for ``DEAD_AFTER_S`` died (killed, crashed, or its host is gone). A rank whose step raised
reports the error under ``failed/{rank}`` and exits (closing its sockets, so its peers' gloo
calls fail at once instead of waiting). Rank 0 then names the rank (a silent death first, else
the first report), publishes ``abort``, and every step raises that
:class:`runtime.workers.WorkerError`; the other ranks' own watch threads exit their processes
on ``abort``, and exit as well when rank 0's counter stands still or the store is gone (rank 0
or its host died). A collective with a silently vanished host (no TCP reset) waits at most
``COLLECTIVE_TIMEOUT_S``.
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable

import torch

from .mppp import ParallelPlan, PlanError
from .ops.collectives import abort_collectives, clear_collectives_abort

HEARTBEAT_S = float(os.environ.get("FXCOMPILER_HEARTBEAT_INTERVAL", "0.5"))
DEAD_AFTER_S = float(os.environ.get("FXCOMPILER_HEARTBEAT_TIMEOUT", "4"))
COLLECTIVE_TIMEOUT_S = float(os.environ.get("FXCOMPILER_COLLECTIVE_TIMEOUT", "300"))


def torchrun_env() -> dict[str, int] | None:
    """``{"rank", "world"}`` when this process is one rank of a torchrun job of several ranks."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_ADDR" not in os.environ:
        return None
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    return {"rank": rank, "world": world} if world > 1 else None


def check_world(plan: ParallelPlan, world: int) -> None:
    """Refuse a plan whose dp × pp × tp is not torchrun's world size, naming the numbers."""
    need = plan.tp * plan.pp * plan.dp
    if need == world:
        return
    hint = ""
    if world % (plan.tp * plan.pp) == 0:
        hint = f"; with these tp and pp pass data_parallel_size={world // (plan.tp * plan.pp)}"
    raise PlanError(f"torchrun started {world} ranks but tensor_parallel_size={plan.tp} × pipeline_parallel_size="
                    f"{plan.pp} × data_parallel_size={plan.dp} needs {need}{hint}")


def replica_logits_rank(plan: ParallelPlan, d: int) -> int:
    """The global rank that computes replica ``d``'s logits: TP rank 0 of its last stage."""
    return d * plan.tp * plan.pp + (plan.pp - 1) * plan.tp


def store_client(timeout_s: float) -> Any:
    """A client of the rendezvous TCPStore, keys under this job's prefix (a restart gets fresh keys)."""
    import torch.distributed as dist

    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'env')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"fxcompiler/{run}/", tcp)


def _is_wait_timeout(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()


def _die(rank: int, why: str, code: int = 1) -> None:
    """A rank other than 0 leaves at once: its peers may be blocked in a collective with the dead rank."""
    try:
        sys.stderr.write(f"fxcompiler: torchrun rank {rank}: {why}; exiting\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


class _Heartbeat:
    """Bump this rank's ``hb/{rank}`` counter every ``HEARTBEAT_S`` on a store client of its own and
    call ``watch(store)`` after each beat (a thread; daemon)."""

    def __init__(self, rank: int, watch: Callable[[Any], None], on_store_error: Callable[[BaseException], None]):
        self.rank, self.watch, self.on_store_error = rank, watch, on_store_error
        self.store = store_client(max(DEAD_AFTER_S, 1.0))
        self.stopped = threading.Event()
        self._ok = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"fxcompiler-heartbeat{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(f"hb/{self.rank}", 1)
                self.watch(self.store)
                self._ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the store (rank 0's host) is unreachable
                if self.stopped.is_set():
                    return
                if time.monotonic() - self._ok > DEAD_AFTER_S:
                    self.on_store_error(exc)
            self.stopped.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self.stopped.set()


class _Staleness:
    """Per rank: the last heartbeat value seen and the local time it last changed."""

    def __init__(self, ranks: list[int]):
        now = time.monotonic()
        self.seen = {r: (None, now) for r in ranks}

    def update(self, values: dict[int, bytes]) -> dict[int, float]:
        """Feed the current values; returns ``{rank: seconds unchanged}``."""
        now = time.monotonic()
        ages = {}
        for r, v in values.items():
            last, t = self.seen[r]
            if v != last:
                self.seen[r] = (v, now)
                t = now
            ages[r] = now - t
        return ages


class TorchrunPeers:
    """Rank 0's handle on the other torchrun ranks: one step function per replica, the watch
    over every rank's heartbeat, and ``shutdown()`` (tells them to exit)."""

    def __init__(self, shard, plan: ParallelPlan, run_step, infos: list[str]):
        from runtime.workers import WorkerError

        self._WorkerError = WorkerError
        self.shard = shard  # rank 0's own shard (an LLM built with the mppp pass)
        self.plan = plan
        self.world = plan.tp * plan.pp * plan.dp
        self.infos = infos  # "host pid N" of every rank
        self.run_step = run_step
        self.closed = False
        self.failure: BaseException | None = None
        self.seq = [0] * plan.dp
        self.ctls = [store_client(60.0) for _ in range(plan.dp)]  # a client per replica: the replicas step at once
        self.alarm = store_client(10.0)  # _diagnose's own client: a replica's may be blocked in a wait
        self._awaiting: set[tuple[int, str]] = set()  # (replica, key) a step waits for; woken on failure
        self._lock = threading.Lock()
        self._stale = _Staleness(list(range(1, self.world)))
        self._reports: dict[int, tuple[int, str]] = {}
        self._first_report: float | None = None
        self.heartbeat = _Heartbeat(0, self._watch, lambda exc: None)

    # -- the watch (heartbeat thread) ---------------------------------------------------------------
    def _watch(self, store) -> None:
        if self.failure is not None or self.world == 1:
            return
        ranks = list(range(1, self.world))
        ages = self._stale.update(dict(zip(ranks, store.multi_get([f"hb/{r}" for r in ranks]))))
        if int(store.add("nfailed", 0)) > len(self._reports):
            for r in ranks:
                if r not in self._reports and store.check([f"failed/{r}"]):
                    order, text = store.get(f"failed/{r}").decode().split("\t", 1)
                    self._reports[r] = (int(order), text)
                    self._first_report = self._first_report or time.monotonic()
        verdict = self._verdict(ages)
        if verdict is not None:
            self._fail(verdict, store)

    def _verdict(self, ages: dict[int, float]) -> str | None:
        silent = [r for r, a in ages.items() if a > DEAD_AFTER_S and r not in self._reports]
        if silent:
            r = silent[0]
            return (f"rank {r} ({self.infos[r]}) stopped its heartbeat {ages[r]:.1f} s ago: it died (killed by a "
                    "signal such as SIGKILL, or crashed; its host's torchrun log names the signal) or its host is gone")
        if self._reports and time.monotonic() - self._first_report > DEAD_AFTER_S + HEARTBEAT_S:
            # no rank died silently meanwhile: the first report is the cause, the others followed from it
            r = min(self._reports, key=lambda k: self._reports[k][0])
            return f"rank {r} ({self.infos[r]}) {self._reports[r][1]}"
        return None

    def _fail(self, verdict: str, store) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = self._WorkerError(f"{verdict}; every other rank was shut down")
        abort_collectives(self.failure)  # a step in a collective with the dead rank raises it
        try:
            store.set("abort", verdict)  # the other ranks' heartbeat threads exit their processes
            for _d, key in list(self._awaiting):
                store.set(key, b"")  # wakes the step waiting for it, which raises the failure
        except Exception:  # noqa: BLE001 - the store is gone: the ranks exit on their own
            pass
        self.heartbeat.stop()

    def _diagnose(self, exc: BaseException) -> BaseException:
        """Rank 0's own step failed (e.g. gloo: "connection closed by peer"): wait for the watch to
        name the rank that died, at most the heartbeat timeout; else the step's error is the cause."""
        deadline = time.monotonic() + DEAD_AFTER_S + 3 * HEARTBEAT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(HEARTBEAT_S / 5)
        if self.failure is None:
            self._fail(f"rank 0 ({self.infos[0]}) raised {type(exc).__name__}: {exc}", self.alarm)
        return self.failure

    # -- steps --------------------------------------------------------------------------------------
    def step_function(self, d: int) -> Callable:
        """Replica ``d``'s step: post it for the replica's ranks, run rank 0's shard (replica 0), and
        take the logits from the replica's logits rank."""
        lr = replica_logits_rank(self.plan, d)

        def step(bucket, arrays, copies, micro_batches=1):
            if self.failure is not None:
                raise self.failure
            if self.closed:
                raise self._WorkerError("the torchrun ranks were shut down")
            n = self.seq[d]
            self.seq[d] += 1
            key, ctl = f"r{d}/s{n}", self.ctls[d]
            try:
                ctl.set(key, pickle.dumps(("step", bucket, arrays, copies, micro_batches), protocol=5))
                out = self.run_step(bucket, arrays, copies, micro_batches) if d == 0 else None
                if lr != 0:
                    out = torch.from_numpy(self._await(d, f"r{d}/l{n}"))
                    ctl.delete_key(f"r{d}/l{n}")
                ctl.delete_key(key)  # every rank of the replica took part in the step: it was read
            except self._WorkerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a collective or the store failed: name the rank
                raise self._diagnose(exc) from exc
            return out

        return step

    def _await(self, d: int, key: str):
        """The value a replica's logits rank posts under ``key``; the watch wakes the wait (an empty
        value) when it declares a rank dead, so a long wait never outlives a failure."""
        ctl = self._await_start(d, key)
        try:
            while True:
                try:
                    ctl.wait([key], timedelta(seconds=3600))  # no short timeouts: c10d logs each one
                except Exception as exc:  # noqa: BLE001
                    if _is_wait_timeout(exc):
                        continue
                    raise
                raw = ctl.get(key)
                if not raw:
                    raise self.failure
                return pickle.loads(raw)
        finally:
            self._awaiting.discard((d, key))

    def _await_start(self, d: int, key: str):
        with self._lock:
            self._awaiting.add((d, key))
        if self.failure is not None:
            raise self.failure
        return self.ctls[d]

    # -- teardown -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        self.heartbeat.stop()
        try:
            if self.failure is None:
                for d in range(self.plan.dp):
                    self.ctls[d].set(f"r{d}/s{self.seq[d]}", pickle.dumps(("exit",)))
        except Exception:  # noqa: BLE001 - the store is gone: the ranks exit on their own
            pass
        finally:
            if dist.is_initialized():
                if self.failure is None:
                    try:
                        dist.destroy_process_group()
                    except Exception:  # noqa: BLE001 - a peer died after the last step
                        pass
                else:
                    _abandon_process_groups()
            self.shard.shutdown()

    def pids(self) -> list[int]:
        return []


def _abandon_process_groups() -> None:
    """Keep this process's c10d groups alive to its end, never destroyed: after a rank died, a
    gloo thread may still wait in a send to it until the group's timeout, and destroying the group
    (``destroy_process_group``, or the interpreter's exit dropping the last reference) joins that
    thread, so rank 0 would outlive the failure by minutes."""
    import ctypes

    import torch.distributed.distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


def _replica_kv(plans: list[dict], plan: ParallelPlan) -> list[dict]:
    """Each replica's KV plan; every rank of a replica must address the same blocks."""
    r = plan.tp * plan.pp
    out = []
    for d in range(plan.dp):
        blocks = [p["num_blocks"] for p in plans[d * r:(d + 1) * r]]
        if len(set(blocks)) != 1:
            raise RuntimeError(f"torchrun ranks {d * r}..{(d + 1) * r - 1} (replica {d}) sized different KV caches: "
                               f"{blocks} blocks")
        out.append(plans[d * r])
    return out


def start_torchrun(plan: ParallelPlan, llm_kwargs: dict[str, Any]):
    """Join the torchrun job; rank 0 returns ``(peers, readies, steps)`` (one ready report and one
    step function per data-parallel replica), the other ranks serve and exit."""
    import torch.distributed as dist

    from .llm import LLM
    from .parallel_llm import tp_group

    env = torchrun_env()
    check_world(plan, env["world"])
    clear_collectives_abort()
    world = env["world"]
    if llm_kwargs.get("artifacts_export_path") is not None and plan.dp > 1:
        raise NotImplementedError(f"artifacts_export_path with data_parallel_size={plan.dp} under torchrun: "
                                  "export from a job with data_parallel_size=1 (the artifact records one "
                                  "replica's plan)")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    plan = ParallelPlan.from_dict({**plan.to_dict(), "comm": "gloo"})  # hosts share no memory
    group, _pg, comm = tp_group(plan, rank, shm=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    kw = dict(llm_kwargs)
    if kw.get("artifacts_export_path") is not None:  # each rank exports its shard (fxcompiler/parallel_artifacts.py)
        from .parallel_artifacts import rank_dir

        kw["artifacts_export_path"] = rank_dir(kw["artifacts_export_path"], rank)
    shard = LLM(**kw, _mppp={"plan": plan.to_dict(), "rank": rank, "group": group})
    from .parallel_llm import rank_step_runner

    run_step = rank_step_runner(shard)
    ctl = store_client(60.0)
    ctl.add(f"hb/{rank}", 1)  # exists before anyone watches it
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (asdict(shard.kv_cache_plan), f"{socket.gethostname()} pid {os.getpid()}"))
    kvs = _replica_kv([g[0] for g in gathered], plan)
    infos = [g[1] for g in gathered]
    if rank != 0:
        _serve(shard, plan, rank, run_step, ctl)  # never returns
    peers = TorchrunPeers(shard, plan, run_step, infos)
    history = [{k: v for k, v in h.items() if isinstance(v, (str, int, float, bool))} for h in shard.pass_history]
    meta = shard._build.graph_module.meta.get("mppp") if shard._build.graph_module is not None else None
    ready = {"kv": kvs[0], "geometry": shard.geometry, "pass_history": history,
             "build_info": dict(shard.build_info), "comm": comm,
             "placements": {"placements": dict((meta or {}).get("placements") or {}),
                            "stages": [(meta or {}).get("stage")]}}
    readies = [ready] + [{**ready, "kv": kvs[d]} for d in range(1, plan.dp)]
    return peers, readies, [peers.step_function(d) for d in range(plan.dp)]


def _serve(shard, plan: ParallelPlan, rank: int, run_step, ctl) -> None:
    """A rank other than 0: run its replica's steps as rank 0 posts them; exit with the job."""
    import torch.distributed as dist

    d = rank // (plan.tp * plan.pp)
    answers = rank == replica_logits_rank(plan, d)
    leaving = threading.Event()
    stale = _Staleness([0])

    def watch(store) -> None:
        if leaving.is_set():
            return
        if store.check(["abort"]):
            _die(rank, f"rank 0 tore the job down ({store.get('abort').decode()})")
        age = stale.update({0: store.add("hb/0", 0)})[0]
        if age > DEAD_AFTER_S and not leaving.is_set():
            _die(rank, f"rank 0 stopped its heartbeat {age:.1f} s ago (it died or its host is gone)")

    def store_gone(exc: BaseException) -> None:
        if not leaving.is_set():
            _die(rank, f"the rendezvous store is unreachable ({type(exc).__name__}): rank 0's host is gone")

    hb = _Heartbeat(rank, watch, store_gone)
    n = 0
    while True:
        key = f"r{d}/s{n}"
        try:
            ctl.wait([key], timedelta(seconds=3600))  # idle: the heartbeat thread watches rank 0 meanwhile
        except Exception as exc:  # noqa: BLE001
            if _is_wait_timeout(exc):
                continue
            store_gone(exc)
            continue
        msg = pickle.loads(ctl.get(key))
        n += 1
        if msg[0] == "exit":
            break
        try:
            out = run_step(*msg[1:])
            if answers:
                ctl.set(f"r{d}/l{n - 1}", pickle.dumps(out.numpy(), protocol=5))
        except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this rank leaves
            try:
                order = int(ctl.add("nfailed", 1))
                ctl.set(f"failed/{rank}", f"{order}\traised {type(exc).__name__}: {exc}")
            finally:
                _die(rank, f"its step raised {type(exc).__name__}: {exc}")
    leaving.set()
    hb.stop()
    dist.destroy_process_group()
    shard.shutdown()
    raise SystemExit(0)
