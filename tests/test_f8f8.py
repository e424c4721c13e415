"""FP8 activations (``Wf8Af8``, furiosa's ``w_f8_a_f8`` / ``w_f8_a_f8_kv_f8``): ``fxc::linear_f8f8`` against an
independent float64 computation on the e4m3 grids, the per-token e4m3 rounding against torch's casts, the
quantize pass, the engine against the eager model with the same op, and the artifact round trip."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import backends.cpu  # noqa: F401  (the C++ fxc::linear_f8 kernel behind fxc::linear_f8f8)
from fxcompiler.ops.f8_linear import linear_f8f8_reference, quantize_rows_e4m3
from fxcompiler.ops.quant_linear import FP8, quantize_fp8_codes, quantize_linear_weight_fp8
from fxcompiler.quant_config import QuantizationConfig

from .test_w8a8 import PROMPT, _hf, _logprobs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(1, 9), K=st.integers(1, 90), N=st.integers(1, 70),
       amp=st.floats(1e-3, 30.0), bias=st.booleans(), bf16=st.booleans(), zero_row=st.booleans())
@example(seed=611, M=9, K=44, N=23, amp=2.5625, bias=True, bf16=True, zero_row=False)  # bf16 sums a ulp apart
def test_linear_f8f8_equals_the_fp8_gemm(seed, M, K, N, amp, bias, bf16, zero_row):
    """The op (the C++ linear_f8 kernel behind it) and its ATen reference equal the float64 product of the e4m3
    activation and weight values (every e4m3 x e4m3 product is exact in fp32: only the fp32 sums round), scaled
    per token and per channel; the activation values are torch's casts of x / (amax / 448), saturating."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * amp
    if zero_row:
        x[0] = 0
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = x.to(dtype)
    w = torch.randn(N, K, generator=g) * 0.1
    b = torch.randn(N, generator=g) if bias else None
    packed, scales = quantize_linear_weight_fp8(w)
    codes, wscale = quantize_fp8_codes(w)
    qx, xs = quantize_rows_e4m3(x)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert torch.equal(xs, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    assert torch.equal(qx, (x.float() / xs).clamp(-448, 448).to(FP8).float())
    exact = (qx.double() @ codes.double().t()) * wscale.double().view(1, N) * xs.double()
    if b is not None:
        exact = exact + b.double()
    for fn in (torch.ops.fxc.linear_f8f8, linear_f8f8_reference):
        out = fn(x, packed, scales, b, N)
        assert out.dtype == dtype and out.shape == (M, N)
        # fp32 accumulation of K exact products: |error| <= K * 2^-23 * sum |products| (+ the final roundings)
        mag = (qx.double().abs() @ codes.double().abs().t()) * wscale.double().view(1, N) * xs.double()
        tol = (K + 4) * 2 ** -23 * mag + (2 ** -8 if bf16 else 2 ** -23) * exact.abs() + 1e-30
        assert bool(((out.double() - exact).abs() <= tol + (2 ** -8 * exact.abs() if bf16 else 0)).all())
    # kernel vs reference: the same exact products summed in another fp32 order, then rounded to the output dtype
    # (bf16: the two sums may round to neighbouring bf16 values, one bf16 ulp = 2^-7 relative at most)
    torch.testing.assert_close(torch.ops.fxc.linear_f8f8(x, packed, scales, b, N),
                               linear_f8f8_reference(x, packed, scales, b, N), rtol=2 ** -7 if bf16 else 2e-5,
                               atol=1e-5 * amp)


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(1, 80), K=st.integers(0, 100), N=st.integers(1, 70),
       amp=st.floats(1e-6, 1e4), bias=st.booleans(), bf16=st.booleans(), special=st.sampled_from(
           ["none", "zero_row", "nan", "inf", "tiny"]), batched=st.booleans())
def test_linear_f8f8_kernel_is_bit_identical_to_the_aten_composite(seed, M, K, N, amp, bias, bf16, special, batched):
    """The C++ kernel (per-token e4m3 rows quantized in C++, then linear_f8's matmul with the row scales in its
    epilogue) gives exactly the bits of the ATen composite (quantize_rows_e4m3 around fxc::linear_f8): zero
    rows, NaN / inf inputs (NaN where the composite has NaN), subnormal-range rows, bf16, decode (M <= 4) and tile (M > 4) paths, K = 0."""
    from backends.cpu import quant
    from fxcompiler.ops.f8_linear import linear_f8f8_composite

    if not quant.ensure_loaded():
        pytest.skip("no C++ kernels on this machine: the composite is what runs")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fxc::linear_f8f8", "CPU")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * amp
    if K and special == "zero_row":
        x[0] = 0
    elif K and special == "nan":
        x[M // 2, K // 2] = float("nan")
    elif K and special == "inf":
        x[0, 0] = float("inf")
    elif special == "tiny":
        x = x * 1e-38  # rows whose scale is subnormal-range: the division's exact rounding matters
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    if batched and M % 2 == 0:
        x = x.view(2, M // 2, K)
    packed, scales = quantize_linear_weight_fp8(torch.randn(N, K, generator=g) * 0.1)
    b = torch.randn(N, generator=g) if bias else None
    got = torch.ops.fxc.linear_f8f8(x, packed, scales, b, N)
    want = linear_f8f8_composite(x, packed, scales, b, N)
    assert got.dtype == want.dtype and got.shape == want.shape == (*x.shape[:-1], N)
    nan = want.isnan()  # NaN outputs: NaN in both (their sign/payload bits are the hardware's, not compared)
    assert torch.equal(got.isnan(), nan) and torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_linear_f8f8_shapes_and_errors():
    packed, scales = quantize_linear_weight_fp8(torch.randn(5, 8))
    x = torch.randn(2, 3, 8)
    assert torch.ops.fxc.linear_f8f8(x, packed, scales, None, 5).shape == (2, 3, 5)
    with pytest.raises(ValueError, match="fxc::linear_f8f8: K mismatch: x has K=7"):
        torch.ops.fxc.linear_f8f8(torch.randn(2, 7), packed, scales, None, 5)


def _f8f8_eager(model):
    """The transformers model with every linear but lm_head replaced by fxc::linear_f8f8 on its RTN fp8 weights."""
    class F8F8(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.args = (*quantize_linear_weight_fp8(lin.weight.detach()), lin.bias, lin.out_features)

        def forward(self, x):
            return torch.ops.fxc.linear_f8f8(x, *self.args)

    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and "lm_head" not in f"{name}.{cname}":
                setattr(mod, cname, F8F8(child))
    return model


@pytest.fixture(scope="module")
def f8f8_llm(tiny_models, tmp_path_factory):
    from fxcompiler import LLM, LLMConfig

    art = tmp_path_factory.mktemp("f8f8-artifact")
    llm = LLM(str(tiny_models["llama"]), max_seq_len_to_capture=64, cache_dir=None, artifacts_export_path=art,
              llm_config=LLMConfig(quantization_config=QuantizationConfig.w_f8_a_f8()))
    llm.test_artifact = art
    yield llm
    llm.shutdown()


def test_llm_wf8af8_runs_linear_f8f8_like_the_eager_model(f8f8_llm, tiny_models):
    """``w_f8_a_f8`` (Wf8Af8KV16): every projection but lm_head is one fxc::linear_f8f8 node, fp32 around it (the
    KV cache too), and the engine's prompt logprobs are the eager model's with the same op, not the float model's."""
    info = next(h for h in f8f8_llm.pass_history if h["pass"] == "quantize")
    assert info["ops"] == {"f8f8": 8} and info["kept"] == 1
    assert f8f8_llm.quantization["scheme"] == "Wf8Af8KV16" and f8f8_llm.quantization["activation"] == "fp8"
    assert f8f8_llm.engine.runner.kv.k[0].dtype == torch.float32
    eager = _f8f8_eager(_hf(tiny_models["llama"]))
    with torch.no_grad():
        lp = torch.log_softmax(eager(torch.tensor([PROMPT])).logits[0].double(), -1)
        float_lp = torch.log_softmax(_hf(tiny_models["llama"])(torch.tensor([PROMPT])).logits[0].double(), -1)
    want = [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    got = _logprobs(f8f8_llm, PROMPT)
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3
    assert max(abs(a - float_lp[i - 1, PROMPT[i]].item()) for i, a in enumerate(got, 1)) > 1e-3


def test_llm_wf8af8_artifact_round_trip(f8f8_llm):
    from fxcompiler import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 33, 2], [9, 8, 7]]
    expected = [o.outputs[0].token_ids for o in f8f8_llm.generate(None, sp, prompt_token_ids=prompts)]
    manifest = json.loads((f8f8_llm.test_artifact / "artifact.json").read_text())
    assert manifest["settings"]["quantization"] == f8f8_llm.quantization
    loaded = LLM.load_artifact(f8f8_llm.test_artifact, cache_dir=None)
    try:
        assert [o.outputs[0].token_ids for o in loaded.generate(None, sp, prompt_token_ids=prompts)] == expected
    finally:
        loaded.shutdown()


def test_wf8af8_kvf8_builds_both(tiny_models):
    """furiosa's ``w_f8_a_f8_kv_f8``: fp8 activations and the fp8 KV cache together."""
    from fxcompiler import LLM, LLMConfig, SamplingParams

    llm = LLM(str(tiny_models["llama"]), max_seq_len_to_capture=64, cache_dir=None, kv_cache_scales=0.05,
              llm_config=LLMConfig(quantization_config=QuantizationConfig.w_f8_a_f8_kv_f8()))
    try:
        assert llm.kv_cache_dtype == "fp8" and llm.engine.runner.kv.k[0].dtype == torch.float8_e4m3fn
        assert llm.quantization["activation"] == "fp8"
        out = llm.generate(None, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), prompt_token_ids=[PROMPT])
        assert len(out[0].outputs[0].token_ids) == 5
    finally:
        llm.shutdown()


@pytest.mark.parametrize("cfg, match", [
    (QuantizationConfig("int8", "fp8"), r"W8Af8: fp8 activations are built with fp8 weights only"),
    (QuantizationConfig("int4", "fp8", "fp8"), r"W4Af8KVf8: fp8 activations are built with fp8 weights only"),
])
def test_fp8_activations_need_fp8_weights(tiny_models, cfg, match):
    from fxcompiler import LLM, LLMConfig

    with pytest.raises(NotImplementedError, match=match):
        LLM(str(tiny_models["llama"]), cache_dir=None, llm_config=LLMConfig(quantization_config=cfg))
