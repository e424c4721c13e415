"""``fxc::moe``: the CPU kernel and the ATen reference against transformers' own MoE blocks (fp64), the
kernel reads only the selected experts, and the capture turns every recognised block into one op."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxcompiler.model_zoo import zoo_config, zoo_names
from fxcompiler.models.moe import fxc_moe_blocks, moe_spec
from fxcompiler.ops.moe import moe_cpu, moe_reference


def _model(name, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(zoo_config(name), dtype=torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # biases too: GPT-OSS's router/expert biases must count
    model.set_experts_implementation("eager")
    return model


def _blocks(model):
    return [m for m in model.modules() if moe_spec(m) is not None]


@pytest.mark.parametrize("name", zoo_names(moe=True))
def test_op_matches_transformers_block(name):
    model = _model(name)
    blocks = _blocks(model)
    assert len(blocks) == model.config.num_hidden_layers
    block = blocks[0]
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        with fxc_moe_blocks(model) as n:
            got = block(x)
            got = got[0] if isinstance(got, tuple) else got
        assert n == len(blocks)
        restored = block(x)  # the class's forward is back
    restored = restored[0] if isinstance(restored, tuple) else restored
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(restored, want, rtol=0, atol=0)
    assert not torch.allclose(want, torch.zeros_like(want))


def _args(model, x):
    block = _blocks(model)[0]
    spec = moe_spec(block)
    router, ex = getattr(block, spec.router), block.experts
    return (x, router.weight, getattr(router, "bias", None), ex.gate_up_proj, getattr(ex, "gate_up_proj_bias", None),
            ex.down_proj, getattr(ex, "down_proj_bias", None), int(router.top_k), spec.scoring, spec.normalize,
            spec.fp32_weights, spec.activation, spec.transposed, float(getattr(ex, "alpha", 1.702)),
            float(getattr(ex, "limit", 7.0)))


@pytest.mark.parametrize("name", zoo_names(moe=True))
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_cpu_kernel_matches_reference(name, tokens):
    model = _model(name, seed=1)
    x = torch.randn(tokens, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        args = _args(model, x)
        torch.testing.assert_close(moe_cpu(*args), moe_reference(*args), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.ops.fxc.moe(*args), moe_cpu(*args), rtol=0, atol=0)  # CPU dispatch


def test_cpu_kernel_reads_only_selected_experts():
    """Unselected experts' weights are NaN: a kernel that read them would return NaN."""
    model = _model("qwen3_moe", seed=2)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        args = list(_args(model, x))
        logits = torch.nn.functional.linear(x, args[1])
        chosen = set(torch.topk(torch.softmax(logits, -1), args[7], -1).indices.flatten().tolist())
        unused = sorted(set(range(args[3].shape[0])) - chosen)
        assert unused
        want = moe_cpu(*args)
        gate_up, down = args[3].clone(), args[5].clone()
        gate_up[unused] = float("nan")
        down[unused] = float("nan")
        args[3], args[5] = gate_up, down
        assert torch.equal(moe_cpu(*args), want)
        assert not moe_reference(*args).isnan().any()  # the reference gathers the selected experts only, too


def test_capture_has_one_moe_node_per_block():
    from fxcompiler.testing import capture_zoo_model

    for name in zoo_names(moe=True):
        gm = capture_zoo_model(name).graph_module
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.fxc.moe.default]
        assert len(nodes) == 2, name
        assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.bmm.default]


# ---- the C++ experts kernel (backends/cpu/moe.py, fp32 / bf16, up to MAX_TOKENS tokens) ----

import importlib  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.cpu import _build  # noqa: E402
from backends.cpu import moe as cpu_moe  # noqa: E402

moe_ops = importlib.import_module("fxcompiler.ops.moe")  # the module (fxcompiler.ops.moe is also the op's name)
needs_kernel = pytest.mark.skipif(not _build.can_build(), reason="no C++ compiler / AVX2 on this machine")


def _via_kernel(args, want: bool = True):
    """``moe_cpu(*args)``, asserting which path ran (the C++ kernel when ``want``)."""
    before = dict(moe_ops.dispatch_counts)
    out = moe_cpu(*args)
    took = {k: moe_ops.dispatch_counts[k] - before[k] for k in before}
    assert took == ({"kernel": 1, "aten": 0} if want else {"kernel": 0, "aten": 1}), took
    return out


def _random_args(seed, tokens, hidden, inter, experts, top_k, scoring, activation, transposed, biases, dtype):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype)

    gate_up = r(experts, hidden, 2 * inter, s=0.2) if transposed else r(experts, 2 * inter, hidden, s=0.2)
    down = r(experts, inter, hidden, s=0.2) if transposed else r(experts, hidden, inter, s=0.2)
    return (r(tokens, hidden), r(experts, hidden), r(experts) if biases else None, gate_up,
            r(experts, 2 * inter) if biases else None, down, r(experts, hidden) if biases else None, top_k, scoring,
            scoring == moe_ops.SOFTMAX_TOPK, seed % 2 == 0, activation, transposed, 1.702, 1.5)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, cpu_moe.MAX_TOKENS), hidden=st.integers(1, 70),
       inter=st.integers(1, 90), experts=st.integers(1, 9), data=st.data(),
       scoring=st.sampled_from([moe_ops.SOFTMAX_TOPK, moe_ops.TOPK_SOFTMAX]),
       activation=st.sampled_from([moe_ops.SILU_GLU, moe_ops.CLAMPED_SWIGLU]), transposed=st.booleans(),
       biases=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_cpp_kernel_matches_reference(seed, tokens, hidden, inter, experts, data, scoring, activation, transposed,
                                      biases, dtype):
    top_k = data.draw(st.integers(1, experts))
    args = _random_args(seed, tokens, hidden, inter, experts, top_k, scoring, activation, transposed, biases, dtype)
    got = _via_kernel(args)
    want = moe_reference(*args)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    close = torch.isclose(got.float(), want.float(), rtol=4e-2, atol=4e-2 * want.abs().max().item()).all().item()
    if not close:
        # An output can be far smaller than the bf16-rounded terms it is summed from (a down projection plus its
        # bias, hidden = 1: the reference moves in steps of 2^-7 where the outputs are ~0.03): then the kernel must
        # be as close to the same computation on the same values in fp32 as the bf16 reference is, or closer.
        exact = moe_reference(*[a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                for a in args]).float()
        err, ref_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
        assert err <= 2 * ref_err + 4e-2 * exact.abs().max().item(), (err, ref_err, got, want)


@needs_kernel
def test_cpp_kernel_only_up_to_max_tokens_and_for_fp32_bf16():
    args = _random_args(0, cpu_moe.MAX_TOKENS + 1, 16, 8, 4, 2, 0, 0, False, False, torch.float32)
    _via_kernel(args, want=False)
    _via_kernel(_random_args(0, 2, 16, 8, 4, 2, 0, 0, False, False, torch.float64), want=False)


@needs_kernel
@pytest.mark.parametrize("name", zoo_names(moe=True))
def test_cpp_kernel_reads_only_selected_experts(name):
    """fp32 through the C++ kernel: unselected experts' weights are NaN, the output is unchanged."""
    model = _model(name, seed=2).float()
    x = torch.randn(1, model.config.hidden_size)  # one token (decode): every zoo model then leaves experts unused
    with torch.no_grad():
        args = list(_args(model, x))
        chosen = set(moe_ops.route(x, args[1], args[2], args[7], args[8], args[9], args[10])[1].flatten().tolist())
        unused = sorted(set(range(args[3].shape[0])) - chosen)
        assert unused
        want = _via_kernel(args)
        gate_up, down = args[3].clone(), args[5].clone()
        gate_up[unused] = float("nan")
        down[unused] = float("nan")
        args[3], args[5] = gate_up, down
        assert torch.equal(_via_kernel(args), want)
        torch.testing.assert_close(want, moe_reference(*args), rtol=1e-4, atol=1e-4)
