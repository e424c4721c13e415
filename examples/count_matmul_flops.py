"""Example pass: count matmul FLOPs per generated token, per transformer layer.

It reads the graph (no rewrite), uses the weights' shapes to count ``2*K*N`` FLOPs per
row for every ``matmul``/``linear`` on a parameter, groups them by the layer index found
in the parameter names, and reports the result in its ``info`` (shown in
``llm.pass_history`` and in the ``summary.json`` of ``--dump-dir``).

    from fxcompiler import LLM
    from examples.count_matmul_flops import count_matmul_flops
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct",
              compiler_config_overrides={"passes": {"insert": [(count_matmul_flops, {"after": "fuse_projections"})]}})
    print([h for h in llm.pass_history if h["pass"] == "count_matmul_flops"])
"""
from __future__ import annotations

import re

import torch

from fxcompiler.pass_manager import CompileContext, PassResult

_LAYER = re.compile(r"layers?[._](\d+)|\.h\.(\d+)\.")


def count_matmul_flops(gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
    per_layer: dict[str, int] = {}
    targets = {torch.ops.aten.matmul.default, torch.ops.aten.mm.default, torch.ops.aten.linear.default}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets:
            continue
        weight = ctx.param_of(node.args[1])
        if weight is None or weight.dim() != 2:
            continue
        k, n = weight.shape if node.target is not torch.ops.aten.linear.default else weight.shape[::-1]
        name = ctx.placeholder_spec(node.args[1]).target
        m = _LAYER.search(name)
        layer = f"layer{m.group(1) or m.group(2)}" if m else "head"
        per_layer[layer] = per_layer.get(layer, 0) + 2 * int(k) * int(n)
    total = sum(per_layer.values())
    return PassResult(gm, False, {"flops_per_token": total, "per_layer": per_layer})
