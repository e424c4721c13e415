"""fxcompiler.pattern_matcher: traced patterns, wildcards, commutativity, users outside a match,
extra checks, meta['val'] on the replacement, blocked reasons; the built-in fusions on it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxcompiler import testing
from fxcompiler.pass_manager import get_pass
from fxcompiler.pattern_matcher import Dtype, PatternMatcherPass, Scalar, replace_pattern

aten = torch.ops.aten


def _graph(fn, *args):
    """``fn`` traced to ATen, with fake ``meta['val']`` on every node (as captured graphs have)."""
    gm = make_fx(fn)(*args)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, mode).propagate(*args)
    return gm


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_scalar_wildcard_commutative_operands_and_meta_val():
    gm = _graph(lambda x, y: (y * (x + 0.5)) + (x * 3.0 + 0.25), torch.randn(4, 3), torch.randn(4, 3))
    n = replace_pattern(gm, lambda a, c: a + c, lambda a, c: torch.sub(a, c, alpha=-1), [torch.empty(2), Scalar("c")],
                        extra_check=lambda m: isinstance(m["c"], float))
    assert n == 2 and _ops(gm).count("aten.sub.Tensor") == 2
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(gm(x, y), (y * (x + 0.5)) + (x * 3.0 + 0.25))
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    # y * (x + 0.5) written the other way round still matches a pattern (x + c) * y
    gm = _graph(lambda x, y: y * (x + 0.5), torch.randn(4, 3), torch.randn(4, 3))
    assert replace_pattern(gm, lambda a, b, c: (a + c) * b, lambda a, b, c: torch.addcmul(b * c, a, b),
                           [torch.empty(2), torch.empty(2), Scalar("c")]) == 1


def test_dtype_wildcard_and_same_binding():
    gm = _graph(lambda x: x.to(torch.float64) * 2 + x.to(torch.float16).float(), torch.randn(3))
    p = PatternMatcherPass("casts").register_replacement(
        lambda x, d: x.to(d) * 2, lambda x, d: (x * 2).to(d), [torch.empty(2), Dtype("d")],
        extra_check=lambda m: m["d"] == torch.float64)
    result = p(gm)
    assert result.info == {"matched": 1}
    # a wildcard used twice binds one value: split([n, n]) matches equal halves only
    def halves(x, n):
        a, b = x.split([n, n], -1)
        return a * b

    equal = _graph(lambda x: torch.mul(*x.split([3, 3], -1)), torch.randn(2, 6))
    unequal = _graph(lambda x: torch.mul(*x.split([2, 4], -1)[::-1][:1] * 2), torch.randn(2, 6))
    assert replace_pattern(equal, halves, lambda x, n: x[..., :n] * x[..., n:], [torch.empty(2, 4), Scalar("n", 2)]) == 1
    assert replace_pattern(unequal, halves, lambda x, n: x, [torch.empty(2, 4), Scalar("n", 2)]) == 0


def test_users_outside_the_match_and_extra_check_block_with_a_reason():
    p = PatternMatcherPass("relu_double").register_replacement(
        lambda x: torch.relu(x) * 2, lambda x: torch.relu(x + x), [torch.empty(2)])
    gm = _graph(lambda x: (lambda r: r * 2 + r.sum())(torch.relu(x)), torch.randn(3))
    info = p(gm).info
    assert info["matched"] == 0 and "also used outside the pattern" in info["blocked"]
    rejecting = PatternMatcherPass("never").register_replacement(
        lambda x: torch.relu(x) * 2, lambda x: x, [torch.empty(2)], extra_check=lambda m: False)
    gm = _graph(lambda x: torch.relu(x) * 2, torch.randn(3))
    assert "extra check" in rejecting(gm).info["blocked"]
    gm = _graph(lambda x: torch.tanh(x), torch.randn(3))
    assert "no aten.mul.Tensor node" in rejecting(gm).info["blocked"]
    with pytest.raises(ValueError, match="2 parameters but 1 example inputs"):
        PatternMatcherPass("bad").register_replacement(lambda a, b: a * b, lambda a, b: a, [torch.empty(2)])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(archs=("llama", "qwen2", "mistral"), max_layers=2), bucket=testing.buckets())
def test_fusions_on_the_matcher_preserve_semantics(cfg, bucket):
    """fp32 captures (transformers' RMSNorm casts nothing there, so fuse_rms_norm fires)."""
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    inputs = testing.example_inputs(program, bucket)
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_rms_norm"), program, inputs, rtol=1e-4, atol=1e-4,
                                                   passes_before="default-up-to:fuse_rms_norm")
    assert info["fused"] == 2 * cfg.layers + 1
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_silu_mul"), program, inputs, rtol=1e-5, atol=1e-5,
                                                   passes_before="default-up-to:fuse_silu_mul")
    assert info["fused"] == cfg.layers
