"""Composition root of a tensor-parallel ``LLM``: rank workers and the engine that drives them.

``LLM(..., tensor_parallel_size=tp)`` (or ``devices="cpu:0,cpu:1"``) spawns one process per rank
(:class:`runtime.workers.WorkerGroup`). Each rank joins a ``torch.distributed`` process group
(gloo over TCP on the loopback address; the graph's ``fxc::all_reduce``/``all_gather`` run on it,
or on the CPU backend's shared-memory path when it is available), builds its own shard of the
program with the ``mppp`` pass (``LLM(..., _mppp={...})`` inside the worker: same arguments, so
the compile cache holds one entry per rank) and allocates a KV cache with its heads only. The
``LLM`` process keeps the tokenizer, scheduler, block manager and sampler, and broadcasts each
step's inputs (:class:`runtime.workers.ParallelModelRunner`); rank 0 returns the logits.
"""
from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import asdict
from typing import Any

import torch

from .mppp import ParallelPlan, PlanError, check_tensor_parallel

log = logging.getLogger("fxcompiler.parallel")

# how long a rank may take to build its program, and one step (a dead rank is noticed at once)
START_TIMEOUT_S = float(os.environ.get("FXCOMPILER_WORKER_START_TIMEOUT", "900"))
STEP_TIMEOUT_S = float(os.environ.get("FXCOMPILER_WORKER_STEP_TIMEOUT", "600"))


def resolve_plan(tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int | None,
                 devices: list, num_blocks_per_pp_stage) -> ParallelPlan | None:
    """The parallel plan of the ``LLM`` arguments (furiosa's mesh rules: dp is inferred from the
    devices and tp × pp when not given), or None for one process. Errors name the numbers."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    n_dev = len(devices)
    if data_parallel_size is None:
        dp = max(1, n_dev // (tp * pp)) if n_dev > 1 else 1
    else:
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
        dp = data_parallel_size
    world = tp * pp * dp
    if n_dev > 1 and n_dev < world:
        raise PlanError(f"devices names {n_dev} devices but tensor_parallel_size={tp} × pipeline_parallel_size={pp}"
                        f" × data_parallel_size={dp} needs {world}")
    if n_dev > 1 and n_dev != world:
        raise PlanError(f"devices names {n_dev} devices; tensor_parallel_size={tp} × pipeline_parallel_size={pp} "
                        f"× data_parallel_size={dp} = {world} must use them all")
    if world == 1:
        if num_blocks_per_pp_stage is not None and list(num_blocks_per_pp_stage) not in ([], None):
            stages = list(num_blocks_per_pp_stage)
            if len(stages) != 1:
                raise PlanError(f"num_blocks_per_pp_stage has {len(stages)} stages but pipeline_parallel_size=1")
        return None
    if any(d.kind == "cuda" for d in devices):
        raise NotImplementedError(
            "tensor/pipeline/data parallelism over cuda devices (NCCL ranks) is not built: a rank worker builds "
            "its shard on the LLM's first device (no cuda:N per rank), feeds its step CPU tensors and returns "
            "logits as NumPy, joins a gloo group (the shared-memory all-reduce and the pipeline sends are CPU "
            "only), and the one-process CUDA path it would build on has never run on a GPU; use cpu devices")
    stages = None if num_blocks_per_pp_stage is None else [int(n) for n in num_blocks_per_pp_stage]
    if stages is not None and len(stages) != pp:
        raise PlanError(f"num_blocks_per_pp_stage={stages} has {len(stages)} stages but pipeline_parallel_size={pp}")
    return ParallelPlan(tp=tp, pp=pp, dp=dp, num_blocks_per_pp_stage=stages)


def check_model(plan: ParallelPlan, config) -> None:
    """Refuse a plan this model's heads / MLP cannot be split by, before any process starts."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or getattr(config, "model_type", "") == "gpt2":
        raise NotImplementedError(f"tensor parallelism of model_type={getattr(config, 'model_type', '?')!r}: "
                                  "only models with separate q/k/v projections (Llama, Qwen2, Mistral) are sharded")
    check_tensor_parallel(plan.tp, heads, kv, getattr(config, "intermediate_size", None))
    if plan.pp > 1:
        from passes.mppp import stage_layers

        stage_layers(int(config.num_hidden_layers), plan.pp, plan.num_blocks_per_pp_stage)  # raises naming the numbers


def logits_rank(plan: ParallelPlan) -> int:
    """The worker rank whose step returns the logits: TP rank 0 of the last pipeline stage."""
    return (plan.pp - 1) * plan.tp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank_workers(plan: ParallelPlan, llm_kwargs: dict[str, Any]):
    """Spawn the ranks, wait until each built its shard; returns ``(workers, ready)`` where
    ``ready`` is rank 0's report (KV plan, geometry, pass history)."""
    from runtime.workers import WorkerGroup

    world = plan.mesh.world_size
    threads = max(1, torch.get_num_threads() // world)
    port = _free_port()
    args = [(world, port, plan.to_dict(), llm_kwargs, threads) for _ in range(world)]
    workers = WorkerGroup(rank_main, args)
    reports = workers.recv_all(START_TIMEOUT_S)
    kv = {r[1]["kv"]["num_blocks"] for r in reports}
    if len(kv) != 1:  # every rank must address the same blocks
        workers.shutdown()
        raise RuntimeError(f"rank workers sized different KV caches: {sorted(kv)} blocks")
    ready = dict(reports[0][1])
    placements: dict = {}
    for _, r in reports[::plan.tp]:  # TP rank 0 of every stage: together every parameter
        placements.update((r.get("placements") or {}).get("placements") or {})
    ready["placements"] = {"placements": placements,
                           "stages": [(r.get("placements") or {}).get("stage") for _, r in reports[::plan.tp]]}
    return workers, ready


def rank_main(rank: int, conn, world: int, port: int, plan: dict, llm_kwargs: dict, threads: int) -> None:
    """A rank worker: join the process group, build this rank's shard, serve steps until told to exit."""
    import torch.distributed as dist

    from runtime.workers import die_with_parent, serve_steps

    die_with_parent()
    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group, pg, comm = tp_group(ParallelPlan.from_dict(dict(plan)), rank, shm=plan.get("comm", "shm") == "shm")
        from .llm import LLM

        artifact = llm_kwargs.get("_artifact_dir")
        if artifact is not None:  # load this rank's shard of a parallel artifact
            from .parallel_artifacts import rank_dir

            kw = {k: v for k, v in llm_kwargs.items() if k != "_artifact_dir"}
            llm = LLM.load_artifact(rank_dir(artifact, rank), _rank_of_plan=True, **kw)
        else:
            kw = dict(llm_kwargs)
            if kw.get("artifacts_export_path") is not None:  # each rank exports its shard
                from .parallel_artifacts import rank_dir

                kw["artifacts_export_path"] = rank_dir(kw["artifacts_export_path"], rank)
            llm = LLM(**kw, _mppp={"plan": plan, "rank": rank, "group": group})
        g = llm.geometry
        history = [{k: v for k, v in h.items() if isinstance(v, (str, int, float, bool))} for h in llm.pass_history]
        conn.send(("ready", {"kv": asdict(llm.kv_cache_plan), "num_kv_heads": g.num_kv_heads,
                             "geometry": g, "pass_history": history, "build_info": dict(llm.build_info), "comm": comm,
                             "placements": llm._build.graph_module.meta.get("mppp") if getattr(
                                 llm._build, "graph_module", None) is not None else None}))
        serve_steps(conn, rank_step_runner(llm), rank, sends_logits=rank == logits_rank(ParallelPlan.from_dict(dict(plan))))
    except BaseException as exc:  # noqa: BLE001 - reported to the LLM process, which raises it
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tp_group(plan: ParallelPlan, rank: int, *, shm: bool, timeout=None) -> tuple[str, Any, str]:
    """``(group name, process group, comm)`` of ``rank``'s tensor-parallel group: the world when
    the plan is one replica of one stage, else one new group per (replica, stage), the ranks
    ``[i·tp, (i+1)·tp)`` (created by every rank, in order; ``timeout`` their collectives' limit).
    ``comm`` is ``"shm"`` when the group joined a shared-memory segment (every rank on this host)."""
    import torch.distributed as dist

    pg = None
    if plan.pp * plan.dp > 1:
        for s in range(plan.pp * plan.dp):  # collective: every rank creates every group
            g = dist.new_group(list(range(s * plan.tp, (s + 1) * plan.tp)), timeout=timeout)
            if s == rank // plan.tp:
                pg = g
    pg = pg if pg is not None else dist.group.WORLD
    name = pg.group_name
    comm = "gloo"
    if shm and plan.tp > 1:
        from backends.cpu.comm import join_shm_group

        comm = "shm" if join_shm_group(name, pg=pg) else "gloo"
    return name, pg, comm


def start_parallel_engine(workers, *, logits_rank: int = 0, micro_batches: int = 1, kv, prefill_buckets, decode_buckets, scheduler_config, tokenizer,
                          eos_token_ids, max_context):
    """The ``LLM`` process's engine: scheduler, block manager and sampler here, steps in the ranks."""
    from runtime.block_manager import BlockManager
    from runtime.engine import Engine
    from runtime.scheduler import Scheduler
    from runtime.workers import ParallelModelRunner

    blocks = BlockManager(kv.num_blocks, kv.block_size, kv.max_seqs, kv.max_blocks_per_seq)
    scheduler = Scheduler(scheduler_config, blocks, prefill_buckets, decode_buckets)
    if callable(workers):  # torchrun's rank 0: a step function (fxcompiler/multihost.py)
        from runtime.workers import LocalStepRunner

        runner = LocalStepRunner(workers, blocks, micro_batches=micro_batches)
    else:
        runner = ParallelModelRunner(workers, blocks, STEP_TIMEOUT_S, logits_rank=logits_rank,
                                     micro_batches=micro_batches)
    return Engine(runner, scheduler, tokenizer, eos_token_ids, max_context)


def rank_step_runner(llm):
    """The step function a rank serves: copy blocks, then run the bucket's executable on the step's
    arrays, in ``micro_batches`` micro-batches of rows (every rank cuts the same way, so each
    stage's sends and receives pair up; the last stage's logits are concatenated in row order)."""
    from runtime.workers import split_step_arrays

    runner = llm.engine.runner
    exes, kv = runner.executables, runner.kv

    def run_step(bucket, arrays, copies, micro_batches: int = 1):
        kv.copy_blocks(copies)
        outs = []
        with torch.inference_mode():
            for part in split_step_arrays(arrays, micro_batches) if micro_batches > 1 else [arrays]:
                ids, pos, table, slots, seq_lens, logits_idx = (torch.from_numpy(a) for a in part)
                outs.append(exes[bucket](ids, pos, *kv.k, *kv.v, table, slots, seq_lens, logits_idx))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return run_step


def rank_kv_scales(scales, config, mppp: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's KV8 / KVf8 scales: the model's ``[num_layers, num_kv_heads]`` scales (checked against the model)
    sliced to its pipeline stage's layers (renumbered from 0, as ``cut_stage`` renumbers the caches) and its
    tensor-parallel KV heads (``head_layout``: its contiguous share, or with ``tp > num_kv_heads`` the one
    replicated KV head its query heads read); every data-parallel replica takes the same slice."""
    from passes.mppp import stage_layers

    from .kv_cache_quant import check_kv_scales
    from .mppp import head_layout

    plan = ParallelPlan.from_dict(dict(mppp["plan"]))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    layers = int(config.num_hidden_layers)
    k, v = check_kv_scales(scales, layers, kv_heads)
    _, pp_rank, tp_rank = plan.mesh.coords(int(mppp["rank"]))
    start, stop = stage_layers(layers, plan.pp, plan.num_blocks_per_pp_stage)[pp_rank]
    lay = head_layout(tp_rank, plan.tp, heads, kv_heads)
    return tuple(t[start:stop, lay.kv_start:lay.kv_start + lay.kv_heads].contiguous() for t in (k, v))
