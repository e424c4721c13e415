"""Example fusion written with the pattern matcher: the gated MLP's fused gate/up projection,
``split_with_sizes(gate_up, [n, n]) → fxc::silu_mul(gate, up)``, becomes one ``example::swiglu``.

The pattern and its replacement are plain functions traced to ATen (``n`` is a wildcard, so
the two halves must be equal); the op is defined here with ``torch.library``. Insert it after
``fuse_projections`` (which makes the gate/up split):

    from fxcompiler import LLM
    from examples.fuse_swiglu import fuse_swiglu
    llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", compiler_config_overrides={"passes": {
        "insert": [(fuse_swiglu, {"after": "fuse_projections", "must_fire": True})]}})
    print(next(h for h in llm.pass_history if h["pass"] == "fuse_swiglu"))   # {'fused': 30, ...}
"""
import torch

from fxcompiler.pattern_matcher import PatternMatcherPass, Scalar


@torch.library.custom_op("example::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def search(gate_up, n):
    gate, up = gate_up.split([n, n], -1)
    return torch.ops.fxc.silu_mul(gate, up)


fuse_swiglu = PatternMatcherPass("fuse_swiglu", count_key="fused").register_replacement(
    search, lambda gate_up, n: torch.ops.example.swiglu(gate_up), [torch.empty(2, 16), Scalar("n", 8)])
fuse_swiglu.cache_key = "fuse_swiglu-v1"  # lets LLM(...) cache builds that use it
