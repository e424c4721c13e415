"""MPPP plan: a device mesh (``tp × pp × dp``), per-parameter placements and their JSON form.

This is IR, not a pass: the sharding pass (``passes/mppp.py``) reads a :class:`ParallelPlan`
and a rank from ``ctx.options["mppp"]``; the worker runtime and the artifacts record the same
JSON-able dict (the idea of furiosa's ``MpppConfig``: the plan is data, written next to the
graphs, and a loader refuses a different one).

Placements follow ``torch.distributed.tensor``: :class:`Replicate` (every rank holds the whole
tensor), :class:`Shard` (rank ``r`` holds slice ``r`` of dimension ``dim``) and :class:`Partial`
(every rank holds a summand; an all-reduce makes it whole).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

COMM_BACKENDS = ("shm", "gloo", "nccl")


@dataclass(frozen=True)
class Replicate:
    def to_json(self) -> list:
        return ["R"]


@dataclass(frozen=True)
class Shard:
    dim: int

    def to_json(self) -> list:
        return ["S", self.dim]


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def to_json(self) -> list:
        return ["P", self.reduce_op]


Placement = Replicate | Shard | Partial


def placement_from_json(data) -> Placement:
    tag = data[0]
    if tag == "R":
        return Replicate()
    if tag == "S":
        return Shard(int(data[1]))
    if tag == "P":
        return Partial(str(data[1]))
    raise ValueError(f"unknown placement {data!r}: expected ['R'], ['S', dim] or ['P', op]")


class PlanError(ValueError):
    """A parallel plan that cannot work for this model or these devices (names the numbers)."""


@dataclass(frozen=True)
class DeviceMesh:
    """Ranks laid out as ``[dp][pp][tp]`` (tp fastest: a TP group is adjacent ranks, as in vLLM)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} size must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return rank // (self.tp * self.pp), (rank // self.tp) % self.pp, rank % self.tp

    def tp_group(self, rank: int) -> list[int]:
        base = rank - rank % self.tp
        return list(range(base, base + self.tp))


@dataclass
class ParallelPlan:
    """What the sharding pass does and what workers run: sizes, the communication backend and
    (filled by the pass) the placement of every parameter, keyed by its state-dict name."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    comm: str = "shm"
    num_blocks_per_pp_stage: list[int] | None = None
    placements: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        if self.comm not in COMM_BACKENDS:
            raise PlanError(f"comm must be one of {COMM_BACKENDS}, got {self.comm!r}")
        self.mesh  # validates the sizes

    @property
    def mesh(self) -> DeviceMesh:
        return DeviceMesh(self.tp, self.pp, self.dp)

    @property
    def is_parallel(self) -> bool:
        return self.mesh.world_size > 1

    def identity(self) -> dict[str, Any]:
        """What must match between a built artifact and the plan it is loaded with."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                "num_blocks_per_pp_stage": self.num_blocks_per_pp_stage}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ParallelPlan":
        known = {"tp", "pp", "dp", "comm", "num_blocks_per_pp_stage", "placements"}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"parallel plan has unknown fields {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class HeadLayout:
    """How a TP rank's attention heads map onto the model's: ``q_heads`` query heads starting at
    ``q_start``, ``kv_heads`` KV heads starting at ``kv_start`` (replicated when tp > num_kv_heads)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None) -> None:
    """Refuse a TP size the model cannot be split by (every error names the numbers).

    Query heads are split (``num_heads % tp == 0``); KV heads are split when ``tp <= num_kv_heads``
    (``num_kv_heads % tp == 0``) and replicated otherwise (``tp % num_kv_heads == 0``, so that a
    rank's query heads share one KV head); the MLP's intermediate size must split evenly."""
    if tp == 1:
        return
    valid = [t for t in range(1, num_heads + 1) if _tp_ok(t, num_heads, num_kv_heads, intermediate_size)]
    hint = f"; valid tensor_parallel_size values for this model: {valid}"
    if num_heads % tp:
        raise PlanError(f"tensor_parallel_size={tp} does not divide the {num_heads} query heads{hint}")
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise PlanError(f"tensor_parallel_size={tp} does not divide the {num_kv_heads} KV heads{hint}")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise PlanError(f"tensor_parallel_size={tp} exceeds the {num_kv_heads} KV heads and is not a multiple "
                        f"of them (KV heads can only be replicated whole){hint}")
    if intermediate_size is not None and intermediate_size % tp:
        raise PlanError(f"tensor_parallel_size={tp} does not divide the MLP intermediate size "
                        f"{intermediate_size}{hint}")


def _tp_ok(tp: int, h: int, kv: int, inter: int | None) -> bool:
    return not (h % tp or (tp <= kv and kv % tp) or (tp > kv and tp % kv) or (inter is not None and inter % tp))


def head_layout(tp_rank: int, tp: int, num_heads: int, num_kv_heads: int) -> HeadLayout:
    """The heads of one TP rank (Megatron/vLLM: contiguous query heads; KV heads split, or the one
    KV head its query heads attend to when KV heads are replicated)."""
    q = num_heads // tp
    if tp <= num_kv_heads:
        kv = num_kv_heads // tp
        return HeadLayout(tp_rank * q, q, tp_rank * kv, kv)
    group = num_heads // num_kv_heads
    return HeadLayout(tp_rank * q, q, (tp_rank * q) // group, 1)


def vocab_shard(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """``(start, stop, padded_rows)`` of a rank's vocab rows: ``ceil(V / tp)`` rows each, the last
    shard padded with zero rows (vLLM's padded vocab); ``stop`` is clipped to the real vocab."""
    rows = -(-vocab_size // tp)
    start = tp_rank * rows
    return start, min(start + rows, vocab_size), rows
