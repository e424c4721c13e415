"""``mppp``: shard a captured program for one tensor-parallel rank (Megatron / vLLM rules).

Requires: the captured graph (this pass runs first, before ``decompose`` and before any pass
re-lays weights out or prepacks them), with linears as ``aten.linear(x, W[N, K][, b])`` on
lifted parameters named like transformers' Llama family (``q_proj``/``k_proj``/``v_proj``,
``o_proj``, ``gate_proj``/``up_proj``, ``down_proj``), ``aten.embedding`` on the vocabulary
table and ``lm_head`` as a linear on a 2-D input; ``ctx.options["mppp"]`` =
``{"plan": ParallelPlan.to_dict(), "rank": r, "group": "<process-group name>"}``.

Ensures: rank ``r``'s share of the same function, so that the ranks together compute what the
unsharded graph computes:

* q/k/v and gate/up are column-parallel (``Shard(0)`` of ``W[N, K]``): rank ``r`` keeps its
  query heads, its KV heads (or, when ``tp > num_kv_heads``, the one KV head its query heads
  read: replicated), its slice of the MLP; their biases are split alike. Head views use ``-1``,
  so the attention op sees the per-rank head counts; the KV cache inputs hold the rank's KV
  heads only (``ctx.geometry.num_kv_heads`` becomes per rank). ``fuse_projections`` later fuses
  the per-rank parts, so the fused projections are split per part.
* o_proj and down_proj are row-parallel (``Shard(1)``): the local product is ``Partial`` and an
  ``fxc::all_reduce`` makes it whole; a bias is added once, after the reduce.
* the embedding is vocab-parallel (``Shard(0)``, ``ceil(V / tp)`` rows a rank, zero-padded):
  out-of-shard ids read row 0 and are masked to zero, then ``fxc::all_reduce``. ``lm_head``
  computes its vocab shard's logits and ``fxc::all_gather`` + a transpose rebuild ``[N, V]``.
  A tied ``lm_head`` reads the same sharded table (one placeholder, one placement).
* every other parameter (norms, rotary tables) is replicated.

Signature: unchanged names; sharded parameters take their per-rank shapes. The plan's
``placements`` (state-dict name → placement JSON) are recorded in ``gm.meta["mppp"]`` and in the
pass info. Architectures with other projections (GPT-2's fused ``c_attn``) are refused.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch.fx import GraphModule, Node

from fxcompiler.mppp import ParallelPlan, Partial, Replicate, Shard, check_tensor_parallel, head_layout, vocab_shard
from fxcompiler.pass_manager import CompileContext, PassResult, _fake_like, propagate_fake_shapes, register_pass

aten = torch.ops.aten

_QKV = re.compile(r"\.(q_proj|k_proj|v_proj)\.(weight|bias)$")
_COL = re.compile(r"\.(gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.(weight|bias)$")


@register_pass("mppp")
class MpppShardPass:
    """Shard the graph and parameters for ``ctx.options["mppp"]``'s rank (no-op without it)."""

    name = "mppp"

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        spec = ctx.options.get("mppp")
        if not spec:
            return PassResult(gm, False)
        plan = ParallelPlan.from_dict(dict(spec["plan"]))
        rank, group = int(spec["rank"]), str(spec["group"])
        _dp_rank, _pp_rank, tp_rank = plan.mesh.coords(rank)
        if plan.pp > 1:
            raise NotImplementedError(f"pipeline_parallel_size={plan.pp}: stage cutting is not built yet "
                                      "(only tensor parallelism shards graphs today)")
        if plan.tp == 1:
            gm.meta["mppp"] = plan.to_dict()
            return PassResult(gm, False, {"tp": 1})
        sharder = _Sharder(gm, ctx, plan.tp, tp_rank, group)
        placements = sharder.run()
        plan.placements = placements
        gm.meta["mppp"] = {**plan.to_dict(), "rank": rank, "group": group}
        ctx.geometry = dataclasses.replace(ctx.geometry, num_kv_heads=sharder.layout.kv_heads)
        gm.graph.lint()
        gm.recompile()
        propagate_fake_shapes(gm, "mppp")
        return PassResult(gm, True, {"tp": plan.tp, "rank": rank, "group": group,
                                     "sharded": sum(1 for p in placements.values() if p[0] == "S"),
                                     "collectives": sharder.collectives})


class _Sharder:
    def __init__(self, gm: GraphModule, ctx: CompileContext, tp: int, tp_rank: int, group: str):
        self.gm, self.ctx, self.tp, self.rank, self.group = gm, ctx, tp, tp_rank, group
        self.placements: dict[str, list] = {}
        self.collectives = 0
        g = ctx.geometry
        self.head_dim = g.head_dim
        q_rows = {ctx.params[s.target].shape[0] for s in ctx.input_specs
                  if s.kind == "param" and s.target.endswith("q_proj.weight")}
        inter = {ctx.params[s.target].shape[0] for s in ctx.input_specs
                 if s.kind == "param" and s.target.endswith("gate_proj.weight")}
        if not q_rows:
            raise NotImplementedError("tensor parallelism needs separate q_proj/k_proj/v_proj projections "
                                      "(Llama, Qwen2, Mistral); this model has none (e.g. GPT-2's fused c_attn)")
        self.num_heads = next(iter(q_rows)) // g.head_dim
        self.num_kv_heads = g.num_kv_heads
        self.intermediate = next(iter(inter)) if inter else None
        check_tensor_parallel(tp, self.num_heads, self.num_kv_heads, self.intermediate)
        self.layout = head_layout(tp_rank, tp, self.num_heads, self.num_kv_heads)

    # -- helpers ----------------------------------------------------------------------------------
    def _target(self, node) -> str | None:
        if not isinstance(node, Node) or node.op != "placeholder":
            return None
        spec = self.ctx.placeholder_spec(node)
        return spec.target if spec is not None and spec.kind == "param" else None

    def _set(self, node: Node, value: torch.Tensor, placement) -> None:
        target = self._target(node)
        if target in self.placements:
            if self.placements[target] != placement.to_json():
                raise NotImplementedError(f"parameter {target} needs two placements "
                                          f"({self.placements[target]} and {placement.to_json()})")
            return
        self.ctx.params[target] = value.contiguous().clone() if isinstance(placement, Shard) else value
        node.meta["val"] = _fake_like(self.ctx.params[target], self.gm.graph)
        self.placements[target] = placement.to_json()

    def _rows(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return t.narrow(0, start, stop - start)

    def _call(self, target, args, like: Node) -> Node:
        with self.gm.graph.inserting_after(like):
            n = self.gm.graph.call_function(target, args)
        n.meta["fxc_pass"] = "mppp"
        return n

    # -- rules ------------------------------------------------------------------------------------
    def run(self) -> dict[str, list]:
        graph = self.gm.graph
        vocab_param = None
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.embedding.default and self._target(node.args[0]):
                vocab_param = node.args[0]
                self._embedding(node)
            elif node.target is aten.linear.default and self._target(node.args[1]):
                self._linear(node, vocab_param)
        for spec in self.ctx.input_specs:
            if spec.kind == "param" and spec.target not in self.placements:
                self.placements[spec.target] = Replicate().to_json()
        return self.placements

    def _linear(self, node: Node, vocab_param: Node | None) -> None:
        w_node = node.args[1]
        b_node = node.args[2] if len(node.args) > 2 else None
        target = self._target(w_node)
        w = self.ctx.params[target]
        if _QKV.search(target):
            part = _QKV.search(target).group(1)
            lay, d = self.layout, self.head_dim
            start, count = (lay.q_start, lay.q_heads) if part == "q_proj" else (lay.kv_start, lay.kv_heads)
            self._column(node, w_node, b_node, start * d, (start + count) * d,
                         Replicate() if part != "q_proj" and self.tp > self.num_kv_heads else Shard(0))
        elif _COL.search(target):
            n = w.shape[0] // self.tp
            self._column(node, w_node, b_node, self.rank * n, (self.rank + 1) * n, Shard(0))
        elif _ROW.search(target):
            self._row(node, w_node, b_node)
        elif w_node is vocab_param or target.endswith("lm_head.weight"):
            self._lm_head(node, w_node, b_node)
        else:
            raise NotImplementedError(f"mppp: no tensor-parallel rule for the linear on parameter {target} "
                                      f"({list(w.shape)}); known: q/k/v/o_proj, gate/up/down_proj, lm_head")

    def _column(self, node, w_node, b_node, start, stop, placement) -> None:
        # A replicated KV head is still a row slice of W; its placement says every rank of a
        # group of ranks holds the same rows (recorded as Replicate of that head).
        self._set(w_node, self._rows(self.ctx.params[self._target(w_node)], start, stop), Shard(0))
        if isinstance(b_node, Node):
            self._set(b_node, self._rows(self.ctx.params[self._target(b_node)], start, stop), Shard(0))
        if isinstance(placement, Replicate):
            self.placements[self._target(w_node)] = ["S", 0, "kv-replicated"]

    def _row(self, node, w_node, b_node) -> None:
        w = self.ctx.params[self._target(w_node)]
        k = w.shape[1] // self.tp
        self._set(w_node, w.narrow(1, self.rank * k, k), Shard(1))
        if b_node is not None:
            node.args = (node.args[0], w_node)
            self._set(b_node, self.ctx.params[self._target(b_node)], Replicate())
        users = list(node.users)
        reduced = self._call(torch.ops.fxc.all_reduce.default, (node, self.group), node)
        out = reduced
        if b_node is not None:
            out = self._call(aten.add.Tensor, (reduced, b_node), reduced)
        for u in users:
            u.replace_input_with(node, out)
        node.meta["mppp_placement"] = Partial().to_json()
        self.collectives += 1

    def _embedding(self, node: Node) -> None:
        w_node, ids = node.args[0], node.args[1]
        w = self.ctx.params[self._target(w_node)]
        start, stop, rows = vocab_shard(w.shape[0], self.tp, self.rank)
        self._set(w_node, _padded_rows(w, start, stop, rows), Shard(0))
        users = list(node.users)
        g = self.gm.graph
        with g.inserting_before(node):
            lo = g.call_function(aten.ge.Scalar, (ids, start))
            hi = g.call_function(aten.lt.Scalar, (ids, stop))
            mask = g.call_function(aten.logical_and.default, (lo, hi))
            shifted = g.call_function(aten.sub.Tensor, (ids, start))
            local = g.call_function(aten.mul.Tensor, (shifted, mask))
        node.args = (w_node, local, *node.args[2:])
        with g.inserting_after(node):
            m = g.call_function(aten.unsqueeze.default, (mask, -1))
        with g.inserting_after(m):
            masked = g.call_function(aten.mul.Tensor, (node, m))
        reduced = self._call(torch.ops.fxc.all_reduce.default, (masked, self.group), masked)
        for n in (lo, hi, mask, shifted, local, m, masked):
            n.meta["fxc_pass"] = "mppp"
        for u in users:
            u.replace_input_with(node, reduced)
        self.collectives += 1

    def _lm_head(self, node, w_node, b_node) -> None:
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() != 2:
            raise NotImplementedError("mppp: the vocab-parallel lm_head needs a 2-D input [rows, hidden]")
        w = self.ctx.params[self._target(w_node)]
        vocab = w.shape[0] if self._target(w_node) not in self.placements else self.ctx.geometry.vocab_size
        start, stop, rows = vocab_shard(vocab, self.tp, self.rank)
        if self._target(w_node) not in self.placements:
            self._set(w_node, _padded_rows(w, start, stop, rows), Shard(0))
        if b_node is not None:
            self._set(b_node, _padded_rows(self.ctx.params[self._target(b_node)], start, stop, rows), Shard(0))
        users = list(node.users)
        g = self.gm.graph
        with g.inserting_after(node):
            gathered = g.call_function(torch.ops.fxc.all_gather.default, (node, self.tp, self.group))
        with g.inserting_after(gathered):
            split = g.call_function(aten.view.default, (gathered, [self.tp, -1, rows]))
        with g.inserting_after(split):
            perm = g.call_function(aten.permute.default, (split, [1, 0, 2]))
        with g.inserting_after(perm):
            out = g.call_function(aten.reshape.default, (perm, [-1, self.tp * rows]))
        last = out
        if self.tp * rows != vocab:
            with g.inserting_after(out):
                last = g.call_function(aten.slice.Tensor, (out, 1, 0, vocab))
        for n in {gathered, split, perm, out, last}:
            n.meta["fxc_pass"] = "mppp"
        for u in users:
            u.replace_input_with(node, last)
        self.collectives += 1


def _padded_rows(t: torch.Tensor, start: int, stop: int, rows: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``t``, zero-padded to ``rows`` rows."""
    part = t.narrow(0, start, stop - start)
    if stop - start == rows:
        return part
    pad = t.new_zeros((rows - (stop - start), *t.shape[1:]))
    return torch.cat([part, pad], 0)
