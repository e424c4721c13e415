"""Several hosts: the same program under ``torchrun`` (env:// rendezvous), one rank a process.

Every host runs the same script, e.g. on two hosts with one rank each::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 app.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr HOST0 --master-port 29500 app.py

where ``app.py`` builds ``LLM(model, tensor_parallel_size=2)`` (tp × pp must equal torchrun's
world size). Every rank joins the default process group through ``env://`` (gloo: the ranks may
be on different hosts, so no shared memory) and builds its shard with the ``mppp`` pass. Rank 0's
``LLM`` schedules: each step it broadcasts the step's inputs to the other ranks
(``broadcast_object_list``), runs its own shard, and (pipeline parallel) receives the logits from
the last stage by broadcast. On every other rank ``LLM(...)`` serves steps and ends the process
(``SystemExit(0)``) when rank 0's ``LLM`` shuts down. A rank that dies is not detected here: its
peers wait in gloo until its timeout (the spawned single-host workers detect faults at once).
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from .mppp import ParallelPlan, PlanError


def torchrun_env() -> dict[str, int] | None:
    """``{"rank", "world"}`` when this process is one rank of a torchrun job of several ranks."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_ADDR" not in os.environ:
        return None
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    return {"rank": rank, "world": world} if world > 1 else None


class TorchrunPeers:
    """Rank 0's handle on the other torchrun ranks: ``shutdown()`` tells them to exit."""

    def __init__(self, shard):
        self.shard = shard  # rank 0's own shard (an LLM built with the mppp pass)
        self.closed = False

    def shutdown(self, timeout: float = 5.0) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            try:
                dist.broadcast_object_list([("exit",)], src=0)
            finally:
                dist.destroy_process_group()
        self.shard.shutdown()

    def pids(self) -> list[int]:
        return []


def start_torchrun(plan: ParallelPlan, llm_kwargs: dict[str, Any]):
    """Join the torchrun job; rank 0 returns ``(peers, ready, run_step)``, other ranks serve and exit."""
    import torch.distributed as dist

    from .llm import LLM
    from .parallel_llm import logits_rank, rank_step_runner, tp_group

    env = torchrun_env()
    world = plan.tp * plan.pp
    if plan.dp != 1 or env["world"] != world:
        raise PlanError(f"torchrun started {env['world']} ranks but tensor_parallel_size={plan.tp} × "
                        f"pipeline_parallel_size={plan.pp} × data_parallel_size={plan.dp} needs {world} "
                        "(data-parallel replicas under torchrun are not built yet: use dp=1)")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    plan = ParallelPlan.from_dict({**plan.to_dict(), "comm": "gloo"})  # hosts share no memory
    group, _pg, comm = tp_group(plan, rank, shm=False)
    kw = dict(llm_kwargs)
    if kw.get("artifacts_export_path") is not None:  # each rank exports its shard (fxcompiler/parallel_artifacts.py)
        from .parallel_artifacts import rank_dir

        kw["artifacts_export_path"] = rank_dir(kw["artifacts_export_path"], rank)
    shard = LLM(**kw, _mppp={"plan": plan.to_dict(), "rank": rank, "group": group})
    run_step = rank_step_runner(shard)
    kvs: list = [None] * world
    dist.all_gather_object(kvs, shard.kv_cache_plan.num_blocks)
    if len(set(kvs)) != 1:
        raise RuntimeError(f"torchrun ranks sized different KV caches: {kvs} blocks")
    lr = logits_rank(plan)
    if rank != 0:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] == "exit":
                break
            out = run_step(*box[0][1:])
            if lr != 0:
                dist.broadcast_object_list([out if rank == lr else None], src=lr)
        dist.destroy_process_group()
        shard.shutdown()
        raise SystemExit(0)
    history = [{k: v for k, v in h.items() if isinstance(v, (str, int, float, bool))} for h in shard.pass_history]
    meta = shard._build.graph_module.meta.get("mppp") if shard._build.graph_module is not None else None
    ready = {"kv": asdict(shard.kv_cache_plan), "geometry": shard.geometry, "pass_history": history,
             "build_info": dict(shard.build_info), "comm": comm,
             "placements": {"placements": dict((meta or {}).get("placements") or {}),
                            "stages": [(meta or {}).get("stage")]}}

    def step(bucket, arrays, copies, micro_batches=1):
        dist.broadcast_object_list([("step", bucket, arrays, copies, micro_batches)], src=0)
        out = run_step(bucket, arrays, copies, micro_batches)
        if lr != 0:
            box = [None]
            dist.broadcast_object_list(box, src=lr)
            out = box[0]
        return out

    return TorchrunPeers(shard), ready, step
