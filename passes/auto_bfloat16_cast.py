"""``auto_bfloat16_cast``: run an fp32 (or fp64) checkpoint's graph in bfloat16: weights,
compute and KV cache, with fp32 kept where transformers keeps it in a bf16 model.

The model is captured in its checkpoint dtype; this pass then does what loading it with
``dtype=torch.bfloat16`` would have done to the computation, so one capture serves both
precisions and the compiler, not the loader, owns the choice:

* every wide float parameter becomes bf16, one tensor at a time (the fp32 tensor is
  released as soon as its bf16 copy is bound, so peak memory is the fp32 model plus one
  tensor); tied weights stay tied;
* the rotary-embedding inputs stay fp32: a parameter that is only combined with values
  derived from integer inputs (``inv_freq * position_ids.float()``) is kept, and that
  computation (cos/sin) runs in fp32, as transformers computes it; cos/sin are cast to
  bf16 where they meet the activations (transformers' ``cos.to(x.dtype)``);
* the RMSNorm variance runs in fp32: ``pow(x, 2) → mean → add eps → rsqrt → mul x`` gets
  its ``x`` upcast, the normalised value is cast back to bf16 before the weight multiply
  (transformers' ``LlamaRMSNorm``). An already fused ``fxc::rms_norm`` needs nothing: on
  bf16 inputs its reference and CPU kernel compute that same sequence, bit for bit;
* wherever a wide float value meets a bf16 one it is cast down to bf16 first; a float
  factory op (``full``/``arange``/``zeros``/... with ``dtype=float32``) or an int→float
  cast whose every use is such a meeting gets ``dtype=bfloat16`` instead of a cast;
  float→float32 casts of bf16 values (left over when the pass runs before ``fold_casts``)
  are removed;
* the KV-cache inputs become bf16 (``ctx.geometry.dtype`` is bf16 afterwards, so the
  runtime allocates a bf16 cache and the pipelines' TensorInfos say bf16);
* the logits output is cast back to the checkpoint's dtype (fp32) for the sampler.

Attention softmax stays fp32 inside ``fxc::paged_attention`` (the C++ decode kernel
accumulates bf16 in fp32; the prefill reference runs SDPA, which does the same on CPU).

Enabled by ``ctx.options["auto_bfloat16_cast"]`` (``LLM(..., auto_bfloat16_cast=True)``) or
``get_pass("auto_bfloat16_cast", enabled=True)``; a no-op otherwise, and on a graph
whose parameters are already bf16 (a bf16 checkpoint loaded with ``dtype="auto"``).

Place it after the fusions and before ``weight_layout``: the fusion patterns then match
the fp32 graph as captured (the fp32 RMSNorm island would hide ``fuse_rms_norm``'s
pattern), and ``weight_layout`` / ``fuse_projections`` re-lay out bf16 weights (half the
bytes to copy). It also works directly after ``dce`` (unfused RMSNorm gets the island).

Requires: ``meta["val"]`` (fake tensors) on nodes. Ensures: the same function up to bf16
rounding; ``meta["val"]`` re-derived for every node whose inputs changed dtype.
Signature: same placeholders and parameter names; parameter and cache dtypes change.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

from fxcompiler.pass_manager import CompileContext, PassResult, register_pass

aten = torch.ops.aten

LOW = torch.bfloat16
WIDE = (torch.float32, torch.float64)

_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout}
_FACTORIES = {aten.full.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
              aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.full_like.default,
              aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.linspace.default}
_VIEWS = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.expand.default, aten.transpose.int, aten.permute.default, aten.t.default,
          aten.slice.Tensor, aten.select.int, aten.alias.default}


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _is(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]


def _cast_dtype(node: Node):
    """The dtype a cast node converts to (None if it does not set one)."""
    if node.target is aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target is aten.to.device:
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    return node.kwargs.get("dtype")


def _set_dtype_arg(node: Node, dtype: torch.dtype) -> None:
    if node.target is aten.to.dtype and len(node.args) > 1:
        node.args = (node.args[0], dtype, *node.args[2:])
    elif node.target is aten.to.device and len(node.args) > 2:
        node.args = (*node.args[:2], dtype, *node.args[3:])
    else:
        node.kwargs = {**node.kwargs, "dtype": dtype}


def _is_seed(node: Node) -> bool:
    """A float value made from no float tensor: a factory op, or a cast of an integer tensor."""
    if node.op != "call_function" or not _is_float(_val(node)):
        return False
    if node.target in _FACTORIES:
        return not any(_is_float(_val(a)) for a in node.all_input_nodes)
    if node.target in _CASTS:
        src = _val(node.args[0])
        return isinstance(src, torch.Tensor) and not src.is_floating_point()
    return False


def _rotary_like_params(gm: GraphModule, ctx: CompileContext) -> set[str]:
    """Parameters combined only with integer-derived floats before any activation: kept wide.

    Each float node is classified as W (weights only), I (integer-derived: positions,
    constants) or A (activations: anything reading a token's embedding or the cache). A
    parameter whose W lineage feeds an op producing I (``inv_freq * position_ids.float()``)
    is kept; a gather of weights by an integer tensor (``embedding``) produces A."""
    kind: dict[Node, str] = {}
    sources: dict[Node, set[str]] = {}
    keep: set[str] = set()
    for node in gm.graph.nodes:
        v = _val(node)
        if node.op == "placeholder":
            spec = ctx.placeholder_spec(node)
            if _is_float(v):
                if spec is not None and spec.kind == "param":
                    kind[node], sources[node] = "W", {spec.target}
                else:
                    kind[node] = "A"
            continue
        if node.op != "call_function" or not (_is_float(v) or isinstance(v, (tuple, list))):
            continue
        ins = [a for a in node.all_input_nodes if a in kind]
        kinds = {kind[a] for a in ins}
        int_tensor_in = any(isinstance(_val(a), torch.Tensor) and not _is_float(_val(a)) for a in node.all_input_nodes)
        if "A" in kinds:
            k = "A"
        elif "I" in kinds:
            k = "I"
        elif "W" in kinds:
            k = "A" if int_tensor_in else "W"
        else:  # made from integers and constants only (a factory, position_ids.float())
            k = "I"
        kind[node] = k
        if k == "W":
            sources[node] = set().union(*(sources.get(a, set()) for a in ins))
        elif k == "I":
            for a in ins:
                if kind.get(a) == "W":
                    keep |= sources.get(a, set())
    return keep


def _rms_variance_x(pow_: Node) -> tuple[Node, Node] | None:
    """For ``pow(x, 2) → mean(-1, keepdim) → add(eps) → rsqrt → mul(x, ·)``: (x, that mul)."""
    if not _is(pow_, aten.pow.Tensor_Scalar) or pow_.args[1] != 2 or len(pow_.users) != 1:
        return None
    x = pow_.args[0]
    mean = next(iter(pow_.users))
    if not _is(mean, aten.mean.dim) or len(mean.users) != 1:
        return None
    xv = _val(x)
    if not _is_float(xv) or list(mean.args[1]) not in ([-1], [xv.dim() - 1]):
        return None
    add = next(iter(mean.users))
    if not _is(add, aten.add.Tensor) or add.args[0] is not mean or len(add.users) != 1:
        return None
    rsqrt = next(iter(add.users))
    if not _is(rsqrt, aten.rsqrt.default):
        return None
    muls = [u for u in rsqrt.users if _is(u, aten.mul.Tensor) and x in u.args]
    if len(rsqrt.users) != 1 or len(muls) != 1:
        return None
    return x, muls[0]


def _run_fake(node: Node, mode):
    def val(a):
        return a.meta["val"] if isinstance(a, Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    with mode, torch.no_grad():
        return node.target(*args, **kwargs)


@register_pass("auto_bfloat16_cast")
class AutoBfloat16CastPass:
    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        enabled = self.enabled if self.enabled is not None else bool(ctx.options.get("auto_bfloat16_cast"))
        if not enabled:
            return PassResult(gm, False, {"enabled": False})
        graph = gm.graph
        param_nodes = {n: ctx.placeholder_spec(n) for n in graph.nodes if n.op == "placeholder"}
        wide = [n for n, s in param_nodes.items() if s is not None and s.kind == "param"
                and ctx.params[s.target].dtype in WIDE]
        if not wide:  # a bf16 (or otherwise narrow) checkpoint: nothing to do
            return PassResult(gm, False, {"enabled": True, "cast_params": 0})

        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        placeholder_vals = [_val(n) for n in param_nodes]
        mode = detect_fake_mode([v for v in placeholder_vals if isinstance(v, torch.Tensor)])
        if mode is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
        changed: set[Node] = set()
        info = {"enabled": True, "cast_params": 0, "kept_wide_params": [], "rms_norm_upcasts": 0, "downcasts": 0,
                "factories_rewritten": 0, "removed_casts": 0, "param_bytes_before": 0, "param_bytes_after": 0}

        # 1. Parameters: bf16 copies, the wide original released right away (aliases share one copy).
        keep = _rotary_like_params(gm, ctx)
        converted: dict[tuple, torch.Tensor] = {}
        for node in wide:
            target = param_nodes[node].target
            if target in keep:
                if target not in info["kept_wide_params"]:
                    info["kept_wide_params"].append(target)
                continue
            old = ctx.params[target]
            if old.dtype in WIDE:  # (not yet converted through another placeholder of the same target)
                key = (old.untyped_storage().data_ptr(), old.storage_offset(), tuple(old.shape), tuple(old.stride()))
                if key not in converted:
                    info["param_bytes_before"] += old.numel() * old.element_size()
                    converted[key] = old.detach().to(LOW)
                    info["param_bytes_after"] += converted[key].numel() * converted[key].element_size()
                    info["cast_params"] += 1
                ctx.params[target] = converted[key]
            del old  # the dict held the only other reference: the wide tensor is freed here
            node.meta["val"] = mode.from_tensor(ctx.params[target], static_shapes=True)
            changed.add(node)
        converted.clear()

        # 2. Float user inputs (the KV caches) become bf16.
        for node, spec in param_nodes.items():
            v = _val(node)
            if spec is not None and spec.kind == "user" and _is_float(v) and v.dtype in WIDE:
                with mode:
                    node.meta["val"] = v.to(LOW)
                changed.add(node)

        if not changed:  # only kept (rotary) parameters are wide: already cast
            return PassResult(gm, False, info)

        # 3. Walk the graph: fp32 islands, down-casts where wide meets bf16, fresh fake values.
        down: dict[Node, Node] = {}

        def downcast(a: Node) -> Node:
            """``a`` in bf16, placed right after it; a view of a wide value is re-viewed from the
            down-cast source, so one cast serves every layer (cos/sin are unsqueezed per layer)."""
            if a in down:
                return down[a]
            src = a.args[0] if _is(a, a.target) and a.target in _VIEWS and a.args else None
            if isinstance(src, Node) and _is_float(_val(src)) and _val(src).dtype in WIDE:
                low_src = downcast(src)
                with graph.inserting_after(a):
                    c = graph.call_function(a.target, (low_src, *a.args[1:]), dict(a.kwargs))
            else:
                with graph.inserting_after(a):
                    c = graph.call_function(aten._to_copy.default, (a,), {"dtype": LOW})
                info["downcasts"] += 1
            c.meta["val"] = _run_fake(c, mode)
            down[a] = c
            return c

        upcast_x: dict[Node, Node] = {}
        output = next(n for n in graph.nodes if n.op == "output")
        out_dtypes = {a: _val(a).dtype for a in output.all_input_nodes if _is_float(_val(a))}
        for node in list(graph.nodes):
            if node.op == "output":
                self._cast_output(gm, node, out_dtypes, mode, info)
                continue
            if node.op != "call_function":
                continue
            if not any(a in changed for a in node.all_input_nodes):
                continue
            # 3a. RMSNorm variance in fp32.
            rms = _rms_variance_x(node)
            if rms is not None and _val(rms[0]).dtype == LOW:
                x, mul = rms
                if x not in upcast_x:
                    with graph.inserting_before(node):
                        up = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
                    up.meta["val"] = _run_fake(up, mode)
                    changed.add(up)
                    upcast_x[x] = up
                    info["rms_norm_upcasts"] += 1
                node.replace_input_with(x, upcast_x[x])
                mul.replace_input_with(x, upcast_x[x])
            # 3b. A float→wide cast of a bf16 value: the bf16 graph does not need it.
            if node.target in _CASTS and _cast_dtype(node) in WIDE and node not in upcast_x.values():
                src = node.args[0]
                if _is_float(_val(src)) and _val(src).dtype == LOW and set(node.kwargs) <= {"dtype"} \
                        and (node.target is not aten.to.device or len(node.args) <= 3):
                    node.replace_all_uses_with(src)
                    graph.erase_node(node)
                    info["removed_casts"] += 1
                    continue
            # 3c. Wide meets bf16: cast the wide operands down (transformers' ``cos.to(x.dtype)``).
            floats = [a for a in _tensor_inputs(node) if _is_float(_val(a))]
            if any(_val(a).dtype == LOW for a in floats) and node.target not in _CASTS:
                for a in floats:
                    if _val(a).dtype in WIDE:
                        node.replace_input_with(a, downcast(a))
            try:
                node.meta["val"] = _run_fake(node, mode)
            except Exception as exc:
                raise RuntimeError(f"auto_bfloat16_cast: cannot run {node.format_node()} on bf16 inputs: "
                                   f"{type(exc).__name__}: {exc}") from exc
            changed.add(node)

        # 4. A factory (or int→float cast) read only through a down-cast is made bf16 directly.
        for src, cast in list(down.items()):
            if _is_seed(src) and set(src.users) == {cast}:
                _set_dtype_arg(src, LOW)
                src.meta["val"] = _run_fake(src, mode)
                cast.replace_all_uses_with(src)
                graph.erase_node(cast)
                info["downcasts"] -= 1
                info["factories_rewritten"] += 1

        # 5. Wide views that only fed a down-cast (per-layer ``unsqueeze(cos)``) are dead now.
        for a in reversed(list(down)):
            if a.op == "call_function" and a.target in _VIEWS and not a.users:
                graph.erase_node(a)

        ctx.geometry = dataclasses.replace(ctx.geometry, dtype=LOW)
        return PassResult(gm, True, info)

    @staticmethod
    def _cast_output(gm: GraphModule, out: Node, out_dtypes: dict, mode, info: dict) -> None:
        """Logits back to the dtype the graph returned before (fp32) for the sampler."""
        graph = gm.graph
        casts: dict[Node, Node] = {}

        def fix(a):
            if not isinstance(a, Node) or not _is_float(_val(a)) or _val(a).dtype != LOW \
                    or out_dtypes.get(a, LOW) == LOW:
                return a
            if a not in casts:
                with graph.inserting_before(out):
                    casts[a] = graph.call_function(aten._to_copy.default, (a,), {"dtype": out_dtypes[a]})
                casts[a].meta["val"] = _run_fake(casts[a], mode)
            return casts[a]

        out.args = torch.fx.node.map_aggregate(out.args, fix)
        info["output_casts"] = len(casts)


__all__ = ["AutoBfloat16CastPass"]
