"""Artifacts of a parallel plan: recorded when built, checked when loaded.

A one-process artifact records ``settings["parallel_plan"] = {"tp": 1, "pp": 1, ...}``. An
``LLM(..., tensor_parallel_size / pipeline_parallel_size, artifacts_export_path=P)`` writes each
rank's shard as an artifact of its own in ``P/rank<r>`` (its settings name the plan and the
rank) and the plan in ``P/parallel_plan.json``. ``LLM.load_artifact(P, ...)`` loads with the
recorded plan: the parallel sizes it is given must equal the recorded ones (else an
:class:`~fxcompiler.artifacts.ArtifactError` naming both), except ``data_parallel_size``, which
starts that many replicas of the recorded plan. A rank's shard alone is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .mppp import ParallelPlan

PLAN_FILE = "parallel_plan.json"


def plan_settings(mppp: dict | None) -> dict[str, Any]:
    """The artifact settings that record the plan (a rank worker's ``_mppp`` spec, or None)."""
    if mppp is None:
        return {"parallel_plan": ParallelPlan().identity()}
    plan = ParallelPlan.from_dict(dict(mppp["plan"]))
    return {"parallel_plan": plan.identity(), "parallel_rank": int(mppp["rank"])}


def prepare_export(path, plan: ParallelPlan) -> None:
    if os.path.exists(os.path.join(os.fspath(path), PLAN_FILE)):
        os.remove(os.path.join(os.fspath(path), PLAN_FILE))  # rewritten once every rank exported
    os.makedirs(os.fspath(path), exist_ok=True)


def rank_dir(path, rank: int) -> str:
    return os.path.join(os.fspath(path), f"rank{rank}")


def write_plan(path, plan: ParallelPlan) -> None:
    data = {**plan.identity(), "world": plan.tp * plan.pp, "placements": plan.placements}
    tmp = os.path.join(os.fspath(path), PLAN_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(os.fspath(path), PLAN_FILE))


def _describe(d: dict) -> str:
    return (f"tensor_parallel_size={d['tp']}, pipeline_parallel_size={d['pp']}, "
            f"num_blocks_per_pp_stage={d.get('num_blocks_per_pp_stage')}")


def check_plan(path, *, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, num_blocks_per_pp_stage,
               devices, rank_of_plan: bool) -> ParallelPlan | None:
    """The plan to load ``path`` with (None: one process), or an ArtifactError naming both plans."""
    from .artifacts import ArtifactError, read_manifest

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"artifact path must be a str or os.PathLike, got {type(path).__name__}")
    if (Path(path) / PLAN_FILE).is_file():
        # a parallel artifact: its plan as rank 0's manifest records it (the manifest is what load_artifact
        # trusts and verifies; parallel_plan.json is written for people and tools and never parsed here)
        recorded = dict(read_manifest(rank_dir(path, 0))["settings"].get("parallel_plan") or {})
        if not {"tp", "pp"} <= set(recorded):
            raise ArtifactError(f"{rank_dir(path, 0)}: its manifest records no parallel plan; rebuild the artifact")
    else:
        st = read_manifest(path)["settings"]
        recorded = dict(st.get("parallel_plan") or ParallelPlan().identity())
        if "parallel_rank" in st and not rank_of_plan:
            raise ArtifactError(f"{path} is rank {st['parallel_rank']}'s shard of an artifact built with "
                                f"{_describe(recorded)}; load the directory above it (with its {PLAN_FILE})")
        if rank_of_plan:
            return None
    asked = {"tp": recorded["tp"] if tensor_parallel_size is None else tensor_parallel_size,
             "pp": recorded["pp"] if pipeline_parallel_size is None else pipeline_parallel_size,
             "num_blocks_per_pp_stage": recorded.get("num_blocks_per_pp_stage") if num_blocks_per_pp_stage is None
             else [int(n) for n in num_blocks_per_pp_stage]}
    if (asked["tp"], asked["pp"], asked["num_blocks_per_pp_stage"]) != (
            recorded["tp"], recorded["pp"], recorded.get("num_blocks_per_pp_stage")):
        raise ArtifactError(f"artifact {path} was built with {_describe(recorded)}; loading it with "
                            f"{_describe(asked)} is refused (build an artifact with that plan)")
    dp = data_parallel_size
    if dp is None:
        dp = max(1, len(devices) // (recorded["tp"] * recorded["pp"])) if len(devices) > 1 else 1
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
    if recorded["tp"] * recorded["pp"] * dp == 1:
        return None
    return ParallelPlan(tp=recorded["tp"], pp=recorded["pp"], dp=dp,
                        num_blocks_per_pp_stage=recorded.get("num_blocks_per_pp_stage"))


def load_parallel(cls, path, plan: ParallelPlan, **load_kwargs):
    """An ``LLM`` over rank workers that each load their shard (``<path>/rank<r>``)."""
    import dataclasses

    from .build import KvCachePlan
    from .parallel_llm import logits_rank, start_parallel_engine, start_rank_workers
    from runtime.workers import WorkerGroups

    enable_prefix_caching = load_kwargs.get("enable_prefix_caching", True)
    # this process: settings, tokenizer and buckets from rank 0's shard (no engine)
    obj = cls._load_artifact_dir(rank_dir(path, 0), devices=None, data_parallel_size=None,
                                 pipeline_parallel_size=None, num_blocks_per_pp_stage=None, skip_engine=True,
                                 _rank_of_plan=True, **load_kwargs)
    obj.parallel_plan = plan
    worker_kwargs = {"_artifact_dir": os.fspath(path), **load_kwargs}
    obj._workers = WorkerGroups()
    readies = []
    try:
        for _ in range(plan.dp):
            group, ready = start_rank_workers(dataclasses.replace(plan, dp=1), worker_kwargs)
            obj._workers.append(group)
            readies.append(ready)
    except BaseException:
        obj._workers.shutdown()
        raise
    obj.kv_cache_plan = KvCachePlan(**readies[0]["kv"])
    obj.parallel_stages = readies[0]["placements"]["stages"]
    obj.build_info.update(parallel_plan=plan.to_dict(), comm=readies[0]["comm"])
    engines = [start_parallel_engine(
        group, logits_rank=logits_rank(plan), micro_batches=plan.pp, kv=KvCachePlan(**r["kv"]), prefill_buckets=obj._prefill_buckets,
        decode_buckets=obj._decode_buckets, scheduler_config=obj.scheduler_config, tokenizer=obj.tokenizer,
        eos_token_ids=obj._eos, max_context=obj.max_seq_len_to_capture)
        for group, r in zip(obj._workers.groups, readies)]
    obj.engine = obj._route(engines)
    obj.engine.configure(enable_prefix_caching=enable_prefix_caching, prefill_chunk_size=obj.prefill_chunk_size)
    obj._start_driver()
    return obj
