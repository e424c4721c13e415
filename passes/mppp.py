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
        if plan.tp == 1 and plan.pp == 1:
            gm.meta["mppp"] = plan.to_dict()
            return PassResult(gm, False, {"tp": 1})
        info: dict = {"tp": plan.tp, "pp": plan.pp, "rank": rank, "group": group}
        if plan.tp > 1:
            sharder = _Sharder(gm, ctx, plan.tp, tp_rank, group)
            plan.placements = sharder.run()
            ctx.geometry = dataclasses.replace(ctx.geometry, num_kv_heads=sharder.layout.kv_heads)
            info.update(sharded=sum(1 for p in plan.placements.values() if p[0] == "S"),
                        collectives=sharder.collectives)
        stage = None
        if plan.pp > 1:
            stage = cut_stage(gm, ctx, plan, rank)
            info.update(stage=stage["stage"], layers=stage["layers"])
            plan.placements = {k: plan.placements.get(k, Replicate().to_json()) for k in ctx.params}
        gm.meta["mppp"] = {**plan.to_dict(), "rank": rank, "group": group, "stage": stage}
        gm.graph.lint()
        gm.recompile()
        propagate_fake_shapes(gm, "mppp")
        return PassResult(gm, True, info)


def stage_layers(num_layers: int, pp: int, num_blocks_per_pp_stage=None) -> list[tuple[int, int]]:
    """``[start, stop)`` layers of each pipeline stage: ``num_blocks_per_pp_stage`` if given, else an
    equal split (the first ``num_layers % pp`` stages take one more). Errors name the numbers."""
    from fxcompiler.mppp import PlanError

    if pp > num_layers:
        raise PlanError(f"pipeline_parallel_size={pp} needs at least {pp} blocks; the model has {num_layers}")
    if num_blocks_per_pp_stage is None:
        sizes = [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
    else:
        sizes = [int(n) for n in num_blocks_per_pp_stage]
        if len(sizes) != pp:
            raise PlanError(f"num_blocks_per_pp_stage={sizes} has {len(sizes)} stages but "
                            f"pipeline_parallel_size={pp}")
        if any(n < 1 for n in sizes) or sum(sizes) != num_layers:
            raise PlanError(f"num_blocks_per_pp_stage={sizes} must be positive and sum to the model's "
                            f"{num_layers} blocks (sums to {sum(sizes)})")
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def cut_stage(gm: GraphModule, ctx: CompileContext, plan: ParallelPlan, rank: int) -> dict:
    """Keep pipeline stage ``pp_rank``'s blocks of the graph (blockwise boundaries): a later stage
    receives the residual stream entering its first block (``fxc::pp_recv`` from the same TP rank of
    the previous stage) instead of computing the embedding and earlier blocks; an earlier stage sends
    the residual stream leaving its last block (``fxc::pp_send``) and returns instead of computing
    later blocks and the head. Unused parameters and other stages' KV caches leave the signature;
    the stage's KV caches are renumbered from 0 (``ctx.geometry.num_layers`` becomes the stage's)."""
    from passes.blockwise import _CACHE_RE, discover_layer_prefix

    _dp, pp_rank, _tp = plan.mesh.coords(rank)
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    specs = {s.name: s for s in ctx.input_specs}
    found = discover_layer_prefix([s.target for s in ctx.input_specs if s.kind == "param"],
                                  ctx.geometry.num_layers)
    if found is None:
        raise NotImplementedError("pipeline parallelism needs a '<prefix>.<int>.' block structure in the "
                                  "parameter names")
    prefix, layer_ids = found
    num_layers = len(layer_ids)
    bounds = stage_layers(num_layers, plan.pp, plan.num_blocks_per_pp_stage)
    a, b = bounds[pp_rank]
    prefix_re = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")

    def layer_of_input(n: Node) -> int | None:
        spec = specs.get(n.name) if n.op == "placeholder" else None
        if spec is None:
            return None
        if spec.kind == "param":
            m = prefix_re.match(spec.target)
            return layer_ids.index(int(m.group(1))) if m and int(m.group(1)) in layer_ids else None
        m = _CACHE_RE.match(spec.target)
        return int(m.group(2)) if m else None

    first: dict[int, int] = {}
    last: dict[int, int] = {}
    stream: set[Node] = set()  # nodes on the residual stream (depend on the token embedding)
    ids_node = None
    for n in nodes:
        if n.op == "placeholder" and specs.get(n.name) is not None and specs[n.name].target == "input_ids":
            ids_node = n
        if n.op != "call_function":
            continue
        layers = {layer_of_input(x) for x in n.all_input_nodes} - {None}
        for layer in layers:
            first.setdefault(layer, index[n])
            last[layer] = index[n]
        if n.target is aten.embedding.default or any(x in stream for x in n.all_input_nodes):
            stream.add(n)

    def boundary(layer: int) -> Node:
        """The one residual-stream value live between block ``layer - 1`` and block ``layer``."""
        for q in range(last[layer - 1], first[layer]):
            live = [n for n in stream if index[n] <= q and any(index[u] > q for u in n.users)]
            if len(live) == 1:
                return live[0]
        raise NotImplementedError(f"pipeline parallelism: no single residual-stream value between blocks "
                                  f"{layer - 1} and {layer}")

    output = next(n for n in nodes if n.op == "output")
    if b < num_layers:  # send the stream leaving block b - 1 and stop
        h = boundary(b)
        with graph.inserting_after(h):
            sent = graph.call_function(torch.ops.fxc.pp_send.default, (h, rank + plan.tp))
        logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
        lv = logits.meta.get("val")
        with graph.inserting_after(sent):  # zero logits rows: the graph keeps its output's dtype and rank
            empty = graph.call_function(aten.new_zeros.default, (sent, [0] * lv.dim()), {"dtype": lv.dtype})
        sent.meta["fxc_pass"] = empty.meta["fxc_pass"] = "mppp"
        output.args = ((empty,),)
    if a > 0:  # receive the stream entering block a
        h = boundary(a)
        val = h.meta.get("val")
        if ids_node is None or not isinstance(val, torch.Tensor) or val.dim() != ids_node.meta["val"].dim() + 1:
            raise NotImplementedError("pipeline parallelism: the residual stream must be [*input_ids.shape, hidden]")
        with graph.inserting_after(h):
            got = graph.call_function(torch.ops.fxc.pp_recv.default,
                                      (ids_node, int(val.shape[-1]), val.dtype, rank - plan.tp))
        got.meta["fxc_pass"] = "mppp"
        h.replace_all_uses_with(got)
    keep: set[Node] = set()
    todo = [output]
    while todo:
        n = todo.pop()
        if n in keep:
            continue
        keep.add(n)
        todo.extend(n.all_input_nodes)
    for n in reversed(list(graph.nodes)):
        if n.op == "placeholder" or n in keep:
            continue
        graph.erase_node(n)
    new_specs = []
    for s in ctx.input_specs:
        node = next((n for n in graph.nodes if n.op == "placeholder" and n.name == s.name), None)
        m = _CACHE_RE.match(s.target) if s.kind == "user" else None
        if m is not None:
            layer = int(m.group(2))
            if not a <= layer < b:
                if node is not None:
                    graph.erase_node(node)
                continue
            s = dataclasses.replace(s, target=f"{m.group(1)}_cache_{layer - a}")
        elif s.kind == "param" and node is not None and not node.users:
            graph.erase_node(node)
            ctx.params.pop(s.target, None)
            continue
        new_specs.append(s)
    ctx.input_specs[:] = new_specs
    ctx.geometry = dataclasses.replace(ctx.geometry, num_layers=b - a)
    return {"stage": pp_rank, "layers": [a, b], "bounds": [list(x) for x in bounds],
            "sends_to": rank + plan.tp if b < num_layers else None, "receives_from": rank - plan.tp if a > 0 else None}


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
