"""Blockwise partition: cut the optimised graph into embedding, transformer blocks and head.

Not a graph → graph pass: :func:`partition_blockwise` turns one optimised GraphModule into
several, one per compute supertask (furiosa_llm_semantics.md §2.4):

* **embedding** — everything that depends on user inputs and non-layer parameters only
  (token/position embeddings, rotary tables: computed once, then inputs of every block);
* **one part per transformer block** (``num_blocks_per_supertask`` consecutive blocks
  merged) — it takes the residual stream in and gives it out;
* **head** — the final norm, the logits selection and ``lm_head``.

*Which layer.* The layer index comes from parameter names: the outermost ``<prefix>.<int>.``
component of the parameter FQNs (fused parameters ``a+b`` are split first); the prefix
with the most distinct indices (``model.model.layers``, ``model.transformer.h``) wins, so
no per-model list is needed. KV-cache inputs ``k_cache_i``/``v_cache_i`` belong to the
i-th layer.

*Which part a node goes to.* A node that reads a layer's parameters or KV cache is
pinned to that layer's block. Every other node has an earliest part ``e`` (the latest
part of its inputs) and a latest part ``l`` (the earliest part of its readers):

* ``e == l``: that part;
* ``e`` is the embedding and the node reads a non-layer parameter, or its readers sit
  in several parts: the embedding (rotary tables are computed once and passed on);
* otherwise the values part ``e`` hands to later parts form a minimum vertex cut of the
  dataflow (each value crossing costs 1); what lies on its far side moves to its
  readers' part. After a block, the cut closest to the block: the residual ``add``
  closes block ``e`` while a norm's statistics, the logits selection and the final norm
  go to the reader, GPT-2's token + position embeddings are added in the embedding, and
  a value computed from user inputs alone for one block only moves into that block.
  Should the first block then differ from the second, the cut after the embedding
  closest to the readers is tried instead (captured graphs end the embedding with a
  no-op cast or dropout that the other blocks lack).

Scalar shape nodes (``sym_size`` of an input) are recomputed in every part that uses
them; other values crossing parts become named intermediate tensors.

*Shared blobs.* Every part's graph is rebuilt with canonical names: layer parameters are
named by their FQN without the layer prefix (``self_attn_o_proj_weight_t``; with several
blocks per supertask prefixed ``b<j>_``), KV caches ``k_cache``/``v_cache``, intermediates
``hidden_states`` (the first used) then ``act_<n>``, nodes by their op. Placeholders come
in order of first use (parameters first). The content hash of the generated code plus
the placeholders' shapes/dtypes (and embedded constants, if any) is the blob id, so
blocks 3 and 7 of a uniform model share one blob and one GraphModule object; only their
parameter bindings and KV-cache inputs differ. Blocks that differ (sizes, sliding window)
get their own blob.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from fxcompiler.pass_manager import CompileContext

_CACHE_RE = re.compile(r"^([kv])_cache_(\d+)$")
_LAYER_RE = re.compile(r"^(.*?)\.(\d+)\.")
_SCALAR_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


class BlockwiseError(ValueError):
    """The graph cannot be cut into blocks (no layer structure, or an unexpected dataflow)."""


@dataclass
class GraphPart:
    """One compute supertask's graph: its blob, parameter bindings and named inputs/outputs.

    ``params``: (placeholder name, parameter target) in placeholder order — they come first;
    ``inputs``: pipeline tensor names bound to the remaining placeholders, in order;
    ``outputs``: pipeline tensor names of the graph's outputs (always a tuple), in order."""

    label: str  # "embed", "block<g>", "head"
    role: str  # "embed" | "block" | "head"
    layers: tuple[int, ...]
    blob_id: str
    graph_module: GraphModule
    params: list[tuple[str, str]]
    inputs: list[str]
    outputs: list[str]


@dataclass
class BlockwisePartition:
    parts: list[GraphPart]
    blobs: dict[str, GraphModule]  # blob id -> GraphModule (identical blocks: the same object)
    intermediates: dict[str, Any]  # tensor name -> meta['val'] of the value crossing parts
    user_inputs: list[str]  # original user placeholders (pipeline tensor names), in graph order
    output: str
    layer_prefix: str
    layers: list[int]
    num_blocks_per_supertask: int
    info: dict = field(default_factory=dict)

    @property
    def block_blobs(self) -> list[str]:
        """Distinct blob ids of the block parts, in first-use order."""
        return list(dict.fromkeys(p.blob_id for p in self.parts if p.role == "block"))


def _split_targets(target: str) -> list[str]:
    return [t for t in target.split("+") if t]


def discover_layer_prefix(targets: list[str], num_layers: int | None = None) -> tuple[str, list[int]] | None:
    """The layer prefix of parameter FQNs (``model.model.layers``) and its sorted indices:
    the outermost ``<prefix>.<int>.`` component, the prefix with the most distinct indices
    (one with exactly ``num_layers`` indices first, then the longest)."""
    found: dict[str, set[int]] = {}
    for target in targets:
        for t in _split_targets(target):
            m = _LAYER_RE.match(t)
            if m:
                found.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not found:
        return None
    prefix = max(found, key=lambda p: (len(found[p]) == num_layers, len(found[p]), len(p)))
    return prefix, sorted(found[prefix])


class _Ext:
    """An external input of the original graph: a parameter (placeholder or get_attr constant)
    or a user input, with its layer (None: shared)."""

    __slots__ = ("kind", "layer", "node", "target")

    def __init__(self, node, kind, target, layer):
        self.node, self.kind, self.target, self.layer = node, kind, target, layer


def _san(text: str) -> str:
    s = "".join(c if c.isalnum() else "_" for c in text).lower()
    return s if s and not s[0].isdigit() else "_" + s


def _is_scalar_node(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, _SCALAR_TYPES) and node.op == "call_function"


def partition_blockwise(gm: GraphModule, ctx: CompileContext, *, num_blocks_per_supertask: int = 1) -> BlockwisePartition:
    """Cut ``gm`` (placeholders described by ``ctx.input_specs``) into embedding, blocks and head.

    Raises :class:`BlockwiseError` when no layer structure is found or the dataflow does not
    allow the cut; the caller then keeps one supertask."""
    k = int(num_blocks_per_supertask)
    if k < 1:
        raise ValueError(f"num_blocks_per_supertask must be >= 1, got {num_blocks_per_supertask!r}")
    first = _partition(gm, ctx, k, embed_cut_near_readers=False)
    blocks = [p for p in first.parts if p.role == "block"]
    if len(blocks) < 2 or blocks[0].blob_id == blocks[1].blob_id or len(blocks[1].layers) != k:
        return first
    # The first block differs from the second: maybe only by where the embedding ends (a no-op
    # cast or dropout after the embedding lookup); the cut nearest the readers may fix that.
    other = _partition(gm, ctx, k, embed_cut_near_readers=True)
    blocks = [p for p in other.parts if p.role == "block"]
    return other if blocks[0].blob_id == blocks[1].blob_id else first


def _partition(gm: GraphModule, ctx: CompileContext, k: int, embed_cut_near_readers: bool) -> BlockwisePartition:
    graph = gm.graph
    nodes = list(graph.nodes)
    if any(n.op in ("call_module", "call_method") for n in nodes):
        raise BlockwiseError("graphs with call_module/call_method nodes are not partitioned")
    specs = {s.name: s for s in ctx.input_specs}
    constants = gm.meta.get("fxc_constants", {}) or {}
    param_targets = [s.target for s in ctx.input_specs if s.kind == "param"] + list(constants.values())
    num_layers = getattr(ctx.geometry, "num_layers", None)
    found = discover_layer_prefix(param_targets, num_layers)
    if found is None:
        raise BlockwiseError("no '<prefix>.<int>.' layer structure in the parameter names")
    prefix, layer_ids = found
    pos_of_layer = {layer: i for i, layer in enumerate(layer_ids)}
    prefix_re = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")

    def layer_of_param(target: str) -> tuple[int | None, str]:
        layers, rest = set(), []
        for t in _split_targets(target):
            m = prefix_re.match(t)
            if m and int(m.group(1)) in pos_of_layer:
                layers.add(int(m.group(1)))
                rest.append(m.group(2))
            else:
                rest.append(t)
        if len(layers) > 1:
            raise BlockwiseError(f"parameter {target!r} spans layers {sorted(layers)}")
        return (layers.pop() if layers else None), "+".join(rest)

    # External inputs.
    ext: dict[Node, _Ext] = {}
    user_inputs: list[str] = []
    for n in nodes:
        if n.op == "placeholder":
            spec = specs.get(n.name)
            if spec is None:
                raise BlockwiseError(f"placeholder {n.name!r} is not in ctx.input_specs")
            if spec.kind == "param":
                layer, _ = layer_of_param(spec.target)
                ext[n] = _Ext(n, "param", spec.target, layer)
            else:
                m = _CACHE_RE.match(spec.target)
                layer = None
                if m:
                    idx = int(m.group(2))
                    if idx >= len(layer_ids):
                        raise BlockwiseError(f"KV cache {spec.target} has no layer among {len(layer_ids)}")
                    layer = layer_ids[idx]
                ext[n] = _Ext(n, "user", spec.target, layer)
                user_inputs.append(n.name)
        elif n.op == "get_attr":
            target = constants.get(n.target, n.target)
            layer, _ = layer_of_param(target)
            ext[n] = _Ext(n, "const", target, layer)

    # Parts: 0 embed, 1..G blocks (k layers each), G+1 head.
    num_groups = -(-len(layer_ids) // k)
    head = num_groups + 1

    def part_of_layer(layer: int) -> int:
        return 1 + pos_of_layer[layer] // k

    scalar: set[Node] = set()  # recomputed wherever used
    for n in nodes:
        if n.op == "call_function" and _is_scalar_node(n) and all(
                a in scalar or (a in ext and ext[a].kind == "user") for a in n.all_input_nodes):
            scalar.add(n)
    compute = [n for n in nodes if n.op == "call_function" and n not in scalar]

    pinned: dict[Node, int] = {}
    reads_shared_param: set[Node] = set()
    earliest: dict[Node, int] = {}
    for n in compute:
        e = 0
        layers = set()
        for a in n.all_input_nodes:
            if a in ext:
                x = ext[a]
                if x.layer is not None:
                    layers.add(x.layer)
                elif x.kind != "user":
                    reads_shared_param.add(n)
            elif a in earliest:
                e = max(e, earliest[a])
        if len(layers) > 1:
            raise BlockwiseError(f"node {n.name} reads parameters/caches of layers {sorted(layers)}")
        if layers:
            p = part_of_layer(layers.pop())
            if p < e:
                raise BlockwiseError(f"node {n.name} reads layer parameters of part {p} after part {e}")
            pinned[n] = e = p
        earliest[n] = e

    # Latest part of every node if unpinned nodes went as late as possible.
    # Unpinned nodes nobody reads (export's metadata asserts) go where their inputs are, last.
    readerless = {n for n in compute if not n.users and n not in pinned}
    latest: dict[Node, int] = {}
    for n in reversed(compute):
        if n in pinned:
            latest[n] = pinned[n]
            continue
        if n in readerless:
            continue
        ups = []
        for u in n.users:
            if u in readerless:
                continue
            if u.op == "output":
                ups.append(head)
            elif u in latest:
                ups.append(latest[u])
            elif u in scalar:
                raise BlockwiseError(f"scalar node {u.name} depends on computed node {n.name}")
        latest[n] = min(ups) if ups else earliest[n]
        if earliest[n] == 0 and (n in reads_shared_param or len(set(ups)) > 1):
            # Depends on user inputs and shared parameters only: the embedding computes what
            # reads a shared parameter or has readers in several parts (rotary tables), once.
            latest[n] = 0
        if latest[n] < earliest[n]:
            raise BlockwiseError(f"node {n.name}: a user precedes it (parts {earliest[n]} > {latest[n]})")
    # After each part p: the values of part p that later parts read are a minimum vertex cut;
    # among minimum cuts the one closest to part p (the residual ``add`` closes block p; a
    # norm's statistics and the logits selection go to the reader; token + position
    # embeddings are added in the embedding).
    stays: set[Node] = set()
    by_earliest: dict[int, list[Node]] = {}
    for n in compute:
        by_earliest.setdefault(earliest[n], []).append(n)
    for p, group in by_earliest.items():
        group = [n for n in group if n not in readerless]
        movable = [n for n in group if n not in pinned and latest[n] > p]
        if movable:
            stays |= _producer_side(group, set(movable), earliest, latest, p,
                                    near_readers=p == 0 and embed_cut_near_readers)

    part: dict[Node, int] = {}
    for n in reversed(compute):
        if n in readerless:
            continue
        e = earliest[n]
        ups = {head if u.op == "output" else part[u] for u in n.users if u not in readerless}
        if n in pinned:
            part[n] = pinned[n]
        elif n in stays or latest[n] == e or not ups:
            part[n] = e
        else:
            part[n] = min(ups)
    for n in compute:
        if n in readerless:
            part[n] = max((part[a] for a in n.all_input_nodes if a in part), default=0)
    for n in compute:
        bad = [a.name for a in n.all_input_nodes if a in part and part[a] > part[n]]
        if bad:
            raise BlockwiseError(f"node {n.name} (part {part[n]}) reads {bad} from a later part")

    by_part: dict[int, list[Node]] = {}
    for n in compute:
        by_part.setdefault(part[n], []).append(n)
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    out_vals = output_node.args[0]
    out_list = list(out_vals) if isinstance(out_vals, (tuple, list)) else [out_vals]
    if len(out_list) != 1 or not isinstance(out_list[0], Node) or part.get(out_list[0]) != head:
        raise BlockwiseError("the graph output must be one value computed in the head")

    labels = {0: "embed", head: "head", **{g: f"block{g - 1}" for g in range(1, head)}}
    # Values crossing parts: name per (producer part, output index).
    crossing: dict[Node, str] = {}
    intermediates: dict[str, Any] = {}
    for p in sorted(by_part):
        outs = [n for n in by_part[p] if any(u.op != "output" and u in part and part[u] != p for u in n.users)]
        for i, n in enumerate(outs):
            name = f"{labels[p]}_out{i}"
            crossing[n] = name
            intermediates[name] = n.meta.get("val")
    final_name = "logits"

    parts: list[GraphPart] = []
    blobs: dict[str, GraphModule] = {}
    for p in sorted(by_part):
        role = "embed" if p == 0 else "head" if p == head else "block"
        group_layers = tuple(layer_ids[(p - 1) * k:p * k]) if role == "block" else ()
        rel = {layer: j for j, layer in enumerate(group_layers)}
        sub, params, inputs, outputs = _build_part(gm, by_part[p], p, part, scalar, ext, crossing, output_node,
                                                   final_name, rel, k, layer_of_param)
        blob_id = _content_id(sub)
        shared = blobs.setdefault(blob_id, sub)
        parts.append(GraphPart(labels[p], role, group_layers, blob_id, shared, params, inputs, outputs))
    return BlockwisePartition(parts, blobs, intermediates, user_inputs, final_name, prefix, layer_ids, k,
                              {"parts": len(parts), "blobs": len(blobs),
                               "block_blobs": len({q.blob_id for q in parts if q.role == "block"})})


def _producer_side(group: list[Node], movable: set[Node], earliest, latest, p: int, near_readers: bool) -> set[Node]:
    """Which ``movable`` nodes (earliest part ``p``, readers later) stay in part ``p``: the
    source side of a minimum vertex cut between part ``p``'s fixed nodes and the readers in
    later parts (each node's value costs 1 if it crosses): the minimum cut closest to the
    source, or with ``near_readers`` the one closest to the readers."""
    members = set(group)
    fixed = [n for n in group if n not in movable and latest[n] == p]
    index: dict[Node, int] = {}
    for n in fixed + [n for n in group if n in movable]:
        index[n] = len(index)
    inf = 1 << 30
    source, sink = 2 * len(index), 2 * len(index) + 1
    cap: dict[tuple[int, int], int] = {}
    adj: dict[int, set[int]] = {}

    def edge(a, b, c):
        cap[(a, b)] = cap.get((a, b), 0) + c
        cap.setdefault((b, a), 0)
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)

    for n, i in index.items():
        edge(2 * i, 2 * i + 1, 1)  # n's value crosses
        if n not in movable:
            edge(source, 2 * i, inf)
        for u in n.users:
            if u in index and u in movable:
                edge(2 * i + 1, 2 * index[u], inf)
                if n in movable:
                    edge(2 * index[u], 2 * i, inf)  # a reader on the source side keeps its input there
            elif u.op == "output" or (u not in members and u in latest and earliest[u] > p):
                edge(2 * i + 1, sink, inf)
    # Edmonds-Karp: the flow (values crossing) is small, so a few BFS rounds.
    while True:
        prev = {source: None}
        queue = [source]
        for a in queue:
            for b in adj.get(a, ()):
                if b not in prev and cap[(a, b)] > 0:
                    prev[b] = a
                    queue.append(b)
            if sink in prev:
                break
        if sink not in prev:
            break
        path, b = [], sink
        while prev[b] is not None:
            path.append((prev[b], b))
            b = prev[b]
        push = min(cap[e] for e in path)
        for a, b in path:
            cap[(a, b)] -= push
            cap[(b, a)] += push
    if not near_readers:  # the cut closest to the source: the rest goes to the readers
        reached = set(prev)
        return {n for n, i in index.items() if n in movable and 2 * i in reached}
    to_sink = {sink}
    queue = [sink]
    for b in queue:
        for a in adj.get(b, ()):
            if a not in to_sink and cap[(a, b)] > 0:
                to_sink.add(a)
                queue.append(a)
    return {n for n, i in index.items() if n in movable and 2 * i not in to_sink}


def _build_part(gm, part_nodes, p, part, scalar, ext, crossing, output_node, final_name, rel, k, layer_of_param):
    """A GraphModule for one part with canonical placeholder and node names."""
    members = set(part_nodes)
    # External inputs in order of first use (scalar nodes are expanded where used).
    order: list[Node] = []
    seen: set[Node] = set()

    def visit(a: Node):
        if a in members or a in seen:
            return
        if a in scalar:
            seen.add(a)
            for b in a.all_input_nodes:
                visit(b)
            return
        seen.add(a)
        order.append(a)

    for n in part_nodes:
        for a in n.all_input_nodes:
            visit(a)
    param_nodes = [a for a in order if a in ext and ext[a].kind == "param"]
    const_nodes = [a for a in order if a in ext and ext[a].kind == "const"]
    other_nodes = [a for a in order if not (a in ext and ext[a].kind in ("param", "const"))]

    def prefix_for(layer):
        return f"b{rel[layer]}_" if (k > 1 and layer in rel) else ""

    def param_name(x: _Ext) -> str:
        layer, rest = layer_of_param(x.target)
        return prefix_for(layer) + _san(rest) if layer is not None else _san(x.target)

    graph = Graph()
    env: dict[Node, Node] = {}
    used: set[str] = set()

    def unique(name):
        base, i = name, 1
        while name in used:
            name = f"{base}_{i}"
            i += 1
        used.add(name)
        return name

    params: list[tuple[str, str]] = []
    for a in param_nodes:
        ph = graph.placeholder(unique(param_name(ext[a])))
        ph.meta["val"] = a.meta.get("val")
        env[a] = ph
        params.append((ph.name, ext[a].target))
    inputs: list[str] = []
    n_act = 0
    for a in other_nodes:
        if a in ext:  # user input
            x = ext[a]
            m = _CACHE_RE.match(x.target)
            name = f"{prefix_for(x.layer)}{m.group(1)}_cache" if m else _san(x.target)
            inputs.append(a.name)
        else:
            if a not in crossing:
                raise BlockwiseError(f"node {a.name} (part {part.get(a)}) feeds part {p} but is not an output")
            name = "hidden_states" if n_act == 0 else f"act_{n_act}"
            n_act += 1
            inputs.append(crossing[a])
        ph = graph.placeholder(unique(name))
        ph.meta["val"] = a.meta.get("val")
        env[a] = ph
    root = torch.nn.Module()
    consts = {}
    for a in const_nodes:
        attr = unique("c_" + param_name(ext[a]))
        node = graph.get_attr(attr)
        node.meta.update(a.meta)
        root.register_buffer(attr, getattr(gm, a.target), persistent=True)
        consts[attr] = ext[a].target
        env[a] = node

    def copy(n: Node) -> Node:
        if n in env:
            return env[n]
        for b in n.all_input_nodes:
            copy(b)
        new = graph.create_node(n.op, n.target, torch.fx.map_arg(n.args, lambda x: env[x]),
                                torch.fx.map_arg(n.kwargs, lambda x: env[x]), None, n.type)
        new.meta.update(n.meta)
        env[n] = new
        return new

    for n in part_nodes:
        copy(n)
    out_nodes = [n for n in part_nodes if n in crossing]
    outputs = [crossing[n] for n in out_nodes]
    results = [env[n] for n in out_nodes]
    final = output_node.args[0]
    final = final[0] if isinstance(final, (tuple, list)) else final
    if final in members:
        results.append(env[final])
        outputs.append(final_name)
    graph.output(tuple(results))
    sub = GraphModule(root, graph)
    sub.meta["fxc_constants"] = consts
    return sub, params, inputs, outputs


def _content_id(sub: GraphModule) -> str:
    """Blob id: generated code, placeholder shapes/dtypes and the embedded constants."""
    text = [sub.code]
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                text.append(f"{n.name}:{v.dtype}:{[str(s) for s in v.shape]}")
            else:
                text.append(f"{n.name}:{type(v).__name__}")
    consts = sub.meta.get("fxc_constants", {})
    if consts:
        h = hashlib.sha256()
        for attr in sorted(consts):
            t = getattr(sub, attr).detach().contiguous()
            h.update(f"{attr}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        text.append("constants " + h.hexdigest())
    from fxcompiler.pipeline import DataBlob

    return DataBlob.content_id("fx", "\n".join(text))
