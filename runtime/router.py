"""Data parallelism: ``data_parallel_size`` replicas, each a full engine, behind one router.

:class:`ReplicaRouter` stands where one :class:`~runtime.engine.Engine` stands (the ``LLM``'s
driver and lifecycle use the same methods). A new request goes to the least-loaded replica,
the load being its queued tokens: for every unfinished sequence, the prompt tokens not yet in
its KV cache plus the tokens it may still generate (``max_tokens`` less what it produced).
With prefix caching the prompt's own cost counts too: the leading tokens a replica already holds
(its prefix cache, or a request it holds that computes the same leading blocks first) are not
computed again there, so the request goes where queued tokens plus the prompt tokens left to
compute are fewest; ties go to the lowest index. A shared system prompt thus stays on the
replicas that hold it until their queues outweigh computing it elsewhere.
A step steps every replica that has work and returns their outputs together (in replica order).
Each replica owns its scheduler, block manager and KV cache (in-process, or in its own rank
workers when the replica is itself tensor/pipeline parallel). Replicas whose runner says
``steps_concurrently`` (their step only waits on ranks of their own: torchrun's replicas) are
stepped at once, one thread each; the others one after the other.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from fxcompiler.outputs import RequestOutput
from fxcompiler.sampling_params import SamplingParams

from .engine import EngineStats


class _Requests(dict):
    """The union of the replicas' request tables (read by ``LLM.shutdown`` to abort them all)."""


class ReplicaRouter:
    def __init__(self, replicas: list[Any]):
        if not replicas:
            raise ValueError("a ReplicaRouter needs at least one replica")
        self.replicas = list(replicas)
        self._where: dict[str, int] = {}  # request id -> its replica
        self.routed = [0] * len(self.replicas)  # requests each replica received (introspection)
        self.prefix_routed_tokens = [0] * len(self.replicas)  # prompt tokens routed onto a held prefix
        self.concurrent = len(self.replicas) > 1 and all(
            getattr(getattr(r, "runner", None), "steps_concurrently", False) for r in self.replicas)
        self._pool: ThreadPoolExecutor | None = None

    # -- the Engine interface the LLM uses ---------------------------------------------------------
    def configure(self, **kwargs) -> None:
        for r in self.replicas:
            r.configure(**kwargs)

    def check_params(self, params: SamplingParams) -> None:
        self.replicas[0].check_params(params)

    @property
    def requests(self) -> dict:
        out = _Requests()
        for r in self.replicas:
            out.update(r.requests)
        return out

    @property
    def stats(self) -> EngineStats:
        """The replicas' statistics summed (a fresh snapshot: rates are over every replica)."""
        total = EngineStats()
        for r in self.replicas:
            st = getattr(r, "stats", None)
            if st is not None:
                for f in fields(EngineStats):
                    setattr(total, f.name, getattr(total, f.name) + getattr(st, f.name))
        return total

    @property
    def runner(self):
        return self.replicas[0].runner

    def loads(self) -> list[int]:
        """Queued tokens of each replica: what its unfinished sequences still have to compute
        (prompt tokens not in the KV cache, plus ``max_tokens`` less what they generated)."""
        load = []
        for r in self.replicas:
            total = 0
            for st in list(r.requests.values()):
                for s in getattr(st, "seqs", ()):
                    if not s.is_finished:
                        total += s.num_uncomputed + max(0, int(s.params.max_tokens or 0) - len(s.output_token_ids))
            load.append(total)
        return load

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already in use")
        load = self.loads()
        held = self.prefix_tokens(prompt_token_ids, params)
        i = min(range(len(self.replicas)), key=lambda k: (load[k] - held[k], k))
        self.replicas[i].add_request(request_id, prompt_token_ids, params, prompt)
        self._where[request_id] = i
        self.routed[i] += 1
        self.prefix_routed_tokens[i] += held[i]

    def prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Each replica's leading prompt tokens it would not compute again (0 where a replica cannot say)."""
        return [r.prefix_tokens(prompt_token_ids, params) if hasattr(r, "prefix_tokens") else 0
                for r in self.replicas]

    def abort_request(self, request_id: str) -> None:
        i = self._where.pop(request_id, None)
        if i is not None:
            self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outs: list[RequestOutput] = []
        if self.concurrent and len(busy) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="fxcompiler-replica")
            for part in self._pool.map(lambda r: r.step(), busy):  # in replica order
                outs.extend(part)
        else:
            for r in busy:
                outs.extend(r.step())
        for out in outs:
            if out.finished:
                self._where.pop(out.request_id, None)
        return outs
