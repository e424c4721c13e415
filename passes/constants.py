"""``constants``: where the weights live — graph constants or inputs backed by a param file.

``embed_all_constants_into_graph=True`` (furiosa's option of the same name) folds every
parameter into the graph: each parameter placeholder becomes a ``get_attr`` of a buffer
registered on the GraphModule, so the graph blob is self-contained (one object to hand
to a compiler that specialises on weight values, or to serialise) and the pipeline has
no ``ParamInfo`` inputs. ``False`` (the default) keeps them as lifted inputs, which the
pipeline binds from the param file (``param_file_path`` / ``param_saved_format``) or from
memory; then this pass only reports how many there are.

Runs last: every other pass finds weights through ``ctx.param_of(placeholder)``.
Requires: nothing. Ensures: the same function; with embedding, ``ctx.params`` is empty
and ``ctx.input_specs`` lists only user inputs. Info: ``embedded`` / ``param_inputs``,
``bytes``.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from fxcompiler.pass_manager import CompileContext, PassResult, register_pass


@register_pass("constants")
class ConstantsPass:
    def __init__(self, embed_all_constants_into_graph: bool | None = None):
        self.embed = embed_all_constants_into_graph

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        embed = self.embed if self.embed is not None else bool(ctx.options.get("embed_all_constants_into_graph"))
        param_nodes = [n for n in gm.graph.nodes if n.op == "placeholder" and ctx.param_of(n) is not None]
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in ctx.params.values()}.values())
        if not embed:
            return PassResult(gm, False, {"embedded": 0, "param_inputs": len(param_nodes), "bytes": nbytes})
        first_compute = next(n for n in gm.graph.nodes if n.op != "placeholder")
        attrs: dict[str, str] = {}
        for node in param_nodes:
            spec = ctx.placeholder_spec(node)
            if spec.target not in attrs:
                attrs[spec.target] = attr = f"_fxc_const_{len(attrs)}"
                gm.register_buffer(attr, ctx.params[spec.target], persistent=True)
            with gm.graph.inserting_before(first_compute):
                const = gm.graph.get_attr(attrs[spec.target])
            const.meta.update(node.meta)
            node.replace_all_uses_with(const)
            gm.graph.erase_node(node)
            ctx.input_specs.remove(spec)
        ctx.params.clear()
        gm.meta["fxc_constants"] = {attr: target for target, attr in attrs.items()}
        return PassResult(gm, True, {"embedded": len(attrs), "param_inputs": 0, "bytes": nbytes})


def constant_tensors(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The parameters a graph carries as constants, by their original names."""
    return {target: getattr(gm, attr) for attr, target in gm.meta.get("fxc_constants", {}).items()}
