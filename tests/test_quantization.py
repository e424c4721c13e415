"""Quantization (issue 17): config, packers, fxc::linear_w4 kernel, GGUF native blocks, the quantize pass
(int8, int4 and fp8 e4m3 weights)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxcompiler.config import LLMConfig, QDtype, QuantizationConfig
from fxcompiler.ops.linear import dequantize_linear_weight_int8
from fxcompiler.ops.quant_linear import (dequantize_int4_codes, dequantize_linear_weight_fp8, dequantize_linear_weight_int4,
                                         fp16_if_exact, linear_w4, linear_w4_reference, pack_fp8, pack_int4, quantize_fp8_codes,
                                         quantize_linear_weight_fp8, quantize_linear_weight_int4, unpack_fp8, unpack_int4)
from fxcompiler.quant_config import parse_qformat_metadata
from fxcompiler.quant_options import quantization_options


# -- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset, text", [("w_i8_a_i8_kv_i8", "W8A8KV8"), ("w_i8_a_i8", "W8A8KV16"),
                                          ("w_f8_a_f8_kv_f8", "Wf8Af8KVf8"), ("w_4_a_16_kv_f8", "W4A16KVf8"),
                                          ("w_16_a_16_kv_16", "W16A16KV16"), ("w_16_a_16", "W16A16"),
                                          ("w_i8_a_16", "W8A16"), ("w_4_a_16", "W4A16"), ("w_f8_a_16", "Wf8A16")])
def test_presets_round_trip_through_str(preset, text):
    cfg = getattr(QuantizationConfig, preset)()
    assert str(cfg) == text
    assert QuantizationConfig.from_str(text) == cfg


def test_config_parsing_and_llm_config():
    assert QuantizationConfig("i8", "bfloat16").weight is QDtype.INT8
    assert LLMConfig().with_quantization_config(QuantizationConfig.w_i8_a_16()).quantization_config.weight == QDtype.INT8
    with pytest.raises(ValueError, match="QuantizationConfig.weight"):
        QuantizationConfig("int3", "bf16")
    with pytest.raises(ValueError, match="not a quantization scheme"):
        QuantizationConfig.from_str("W5A16")
    with pytest.raises(TypeError, match="quantization_config must be a QuantizationConfig"):
        LLMConfig(quantization_config="W8A16")


def test_from_qformat_reads_furiosa_metadata_line(tmp_path):
    f = tmp_path / "qformat.yaml"
    f.write_text("# --weight_dtype int8 --act_dtype bf16 --kv_dtype fp8-E4M3 --weight_calib_method AMAX_SYM\n"
                 "quantized_op:\n  model.layers.0.mlp.up_proj: {}\n")
    assert parse_qformat_metadata(f)["weight_calib_method"] == "AMAX_SYM"
    assert str(QuantizationConfig.from_qformat(f)) == "W8A16KVf8"
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantized_op: {}\n")
    with pytest.raises(ValueError, match="first line must be furiosa's metadata line"):
        QuantizationConfig.from_qformat(bad)
    bad.write_text("--act_dtype bf16\n")
    with pytest.raises(ValueError, match="lacks --weight_dtype"):
        QuantizationConfig.from_qformat(bad)


@pytest.mark.parametrize("cfg, match", [
    (QuantizationConfig("fp8", "int8"), "int8 activations are built with int8 or int4 weights only"),
    (QuantizationConfig("int8", "fp8"), "W8Af8: fp8 activations are built with fp8 weights only"),
    (QuantizationConfig("int4", "fp8", "fp8"), "W4Af8KVf8: fp8 activations are built with fp8 weights only"),
])
def test_unimplemented_schemes_raise_with_reason(cfg, match):
    with pytest.raises(NotImplementedError, match=match):
        quantization_options(cfg)


@pytest.mark.parametrize("cfg, weight", [(QuantizationConfig.w_i8_a_i8_kv_i8(), "int8"),
                                         (QuantizationConfig("int8", "bf16", "int8"), "int8"),
                                         (QuantizationConfig("int4", "bf16", "int8"), "int4")])
def test_kv8_schemes_quantize_the_weights_and_name_an_int8_cache(cfg, weight):
    from fxcompiler.quant_options import quantized_kv_dtype

    opts, _ = quantization_options(cfg)
    assert opts["weight"] == weight and opts["scheme"] == str(cfg)
    assert quantized_kv_dtype(cfg) == QDtype.INT8


def test_quantization_option_errors(tmp_path):
    with pytest.raises(ValueError, match="qformat_path=.*q.yaml' cannot be read"):
        quantization_options(None, qformat_path=tmp_path / "q.yaml")
    with pytest.raises(ValueError, match="quant_ckpt_file_path=.*x' does not exist"):
        quantization_options(None, quant_ckpt_file_path=tmp_path / "x")
    with pytest.raises(ValueError, match="quantization_group_size"):
        quantization_options(QuantizationConfig.w_4_a_16(), group_size=33)
    with pytest.raises(ValueError, match="per channel"):
        quantization_options(QuantizationConfig.w_4_a_16(), group_size=-1)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        quantization_options(None, keep_gguf_quantization=True)
    with pytest.raises(ValueError, match="quantize_lm_head=True needs"):
        quantization_options(None, quantize_lm_head=True)
    assert quantization_options(QuantizationConfig.w_16_a_16()) == (None, True)
    opts, bf16 = quantization_options(QuantizationConfig("int4", "fp32"), group_size=64)
    assert opts["weight"] == "int4" and opts["group_size"] == 64 and not bf16 and opts["scheme"] == "W4A32"


def test_lm_head_default_follows_keep_gguf_quantization():
    """A kept GGUF's output projection runs on the tied table's own blocks by default (``"native"``: the
    checkpoint's weights, never re-quantized); ``False`` keeps it in float; RTN schemes keep it in float."""
    def head(**kw):
        return quantization_options(None, check_source=False, **kw)[0]["lm_head"]

    assert head(keep_gguf_quantization=True) == "native"
    assert head(keep_gguf_quantization=True, quantize_lm_head=False) is False
    assert head(keep_gguf_quantization=True, quantize_lm_head=True) is True
    assert quantization_options(QuantizationConfig.w_i8_a_16())[0]["lm_head"] is False
    with pytest.raises(TypeError, match="quantize_lm_head must be a bool or None"):
        quantization_options(None, keep_gguf_quantization=True, quantize_lm_head="yes", check_source=False)


def test_fp8_weight_schemes_are_built():
    """Wf8A16 / Wf8A32 (once NotImplementedError): fp8 weights, activations as the config says."""
    opts, bf16 = quantization_options(QuantizationConfig.from_str("Wf8A16"))
    assert opts == {"weight": "fp8", "group_size": -1, "lm_head": False, "scheme": "Wf8A16"} and bf16
    opts, bf16 = quantization_options(QuantizationConfig("fp8", "fp32"), group_size=-1)
    assert opts["weight"] == "fp8" and opts["scheme"] == "Wf8A32" and not bf16
    with pytest.raises(ValueError, match="quantization_group_size=32 with fp8 weights.*one scale per output channel"):
        quantization_options(QuantizationConfig.w_f8_a_16(), group_size=32)


# -- packers / unpackers (property tests against the reference dequantiser) -------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), groups=st.integers(1, 4), gs=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**16))
def test_int4_pack_unpack_round_trip(n, groups, gs, seed):
    g = torch.Generator().manual_seed(seed)
    k = groups * gs - (gs // 2 if groups > 1 else 0)  # a short last group too
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, groups, generator=g)
    m = torch.randn(n, groups, generator=g)
    packed, ps, pm = pack_int4(q, s, m, gs)
    q2, s2, m2 = unpack_int4(packed, ps, pm, n)
    assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(m2, m)
    ref = dequantize_int4_codes(q, s, m, gs)
    assert torch.equal(dequantize_linear_weight_int4(packed, ps, pm, n, gs), ref)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 3), seed=st.integers(0, 2**16), exact=st.booleans())
def test_int4_compact_scales_only_when_lossless(n, groups, seed, exact):
    """pack_int4(compact=True) stores scales and mins as fp16 exactly when every value is an fp16 value (one
    that is not keeps both fp32), and the dequantised weight is the fp32 packing's bit for bit either way."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, 32 * groups), generator=g, dtype=torch.uint8)
    s, m = torch.rand(n, groups, generator=g) * 0.1, torch.randn(n, groups, generator=g)
    s = s.half().float()
    m = m.half().float() if exact else m.half().float() + torch.where(torch.arange(groups) == 0, 2.0 ** -20, 0.0)
    packed, ps, pm = pack_int4(q, s, m, 32, compact=True)
    assert ps.dtype == pm.dtype == (torch.float16 if exact else torch.float32)
    ref = dequantize_linear_weight_int4(*pack_int4(q, s, m, 32), n, 32)
    assert torch.equal(dequantize_linear_weight_int4(packed, ps, pm, n, 32).view(torch.int32), ref.view(torch.int32))
    assert fp16_if_exact(torch.tensor([1e5]))[0].dtype == torch.float32  # beyond fp16's range: kept


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 3), gs=st.sampled_from([32, 64, 128]), sym=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int4_rtn_error_is_within_half_a_step(n, groups, gs, sym, seed):
    w = torch.randn(n, groups * gs, generator=torch.Generator().manual_seed(seed))
    packed, s, m = quantize_linear_weight_int4(w, gs, sym)
    dq = dequantize_linear_weight_int4(packed, s, m, n, gs)
    step = s.permute(0, 2, 1).reshape(-1, groups)[:n].abs().repeat_interleave(gs, 1)
    assert ((dq - w).abs() <= step * (1.0 if sym else 0.5) + 1e-6).all()  # sym: the clamped +8 end costs one step


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), k=st.sampled_from([64, 96, 128]), gs=st.sampled_from([-1, 32]), seed=st.integers(0, 999))
def test_int8_codes_packer_matches_reference(n, k, gs, seed):
    from passes.quantize import pack_int8_codes

    g = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else k // gs
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, groups, generator=g)
    packed, ps, got_gs = pack_int8_codes(q, s)
    ref = q.float() * s.repeat_interleave(k // groups, 1)
    assert torch.equal(dequantize_linear_weight_int8(packed, ps, n, got_gs), ref)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 200), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 2**16))
def test_fp8_rtn_error_bound_and_pack_round_trip(n, k, scale, seed):
    """Per value |w − s·q| ≤ max(|w|/16, s/1024) (half an e4m3 ulp), s = amax/448 per row, codes never NaN;
    pack/unpack is the identity and the packed dequantisation is s·float(q)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    w[0, 0] = 0.0  # zeros and an all-zero row stay exact
    if n > 1:
        w[1] = 0.0
    q, s = quantize_fp8_codes(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (n, 1)
    amax = w.abs().amax(1, keepdim=True)
    assert torch.equal(s, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)))
    qf = q.float()
    assert bool(torch.isfinite(qf).all()) and float(qf.abs().max()) <= 448.0
    err = (qf * s - w).abs()
    assert (err <= torch.maximum(w.abs() / 16, s / 1024) * (1 + 1e-6) + 1e-30).all()
    packed, ps = pack_fp8(q, s)
    q2, s2 = unpack_fp8(packed, ps, n)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s[:, 0])
    assert torch.equal(dequantize_linear_weight_fp8(packed, ps, n), qf * s)
    p2, ps2 = quantize_linear_weight_fp8(w)
    assert torch.equal(p2.view(torch.uint8), packed.view(torch.uint8)) and torch.equal(ps2, ps)


def test_fp8_packer_errors():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8_codes(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        pack_fp8(torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="one per output channel"):
        pack_fp8(torch.zeros(2, 3).to(torch.float8_e4m3fn), torch.ones(3))


# -- GGUF blocks ------------------------------------------------------------------------------------------
def _q41_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n, k = q.shape
    g = k // 32
    qs = q.reshape(n, g, 2, 16)
    out = np.zeros((n, g, 20), np.uint8)
    out[:, :, 0:2] = d.astype(np.float16).reshape(n, g, 1).view(np.uint8).reshape(n, g, 2)
    out[:, :, 2:4] = m.astype(np.float16).reshape(n, g, 1).view(np.uint8).reshape(n, g, 2)
    out[:, :, 4:] = qs[:, :, 0] | (qs[:, :, 1] << 4)
    return out.reshape(n, g * 20)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 20), g=st.integers(1, 4), qtype=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]),
       seed=st.integers(0, 999))
def test_gguf_blocks_decode_to_gguf_py_dequantisation(n, g, qtype, seed):
    from gguf import GGMLQuantizationType, quants

    from fxcompiler.models.gguf_quant import NativeTensor, decode_blocks

    rng = np.random.default_rng(seed)
    k = 32 * g
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, getattr(GGMLQuantizationType, qtype)) if qtype != "Q4_1" else _q41_blocks(
        rng.integers(0, 16, (n, k)).astype(np.uint8), rng.random((n, g)), rng.standard_normal((n, g)))
    ref = quants.dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(n, k)
    codes, scales, mins = decode_blocks(raw, qtype, k)
    got = NativeTensor("t", qtype, codes, scales, mins).dequantize()
    ref = torch.from_numpy(np.ascontiguousarray(ref))
    if qtype == "Q4_0":  # d·q − 8d is +0.0 where gguf-py's d·(q − 8) is −0.0 (d < 0): equal values
        assert torch.equal(got, ref)
    else:  # bit for bit
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    if qtype != "Q8_0":  # through the op's own packer/dequantiser as well, fp32 and compact (fp16) scales
        packed, s, m = pack_int4(codes, scales, mins, 32)
        assert torch.equal(dequantize_linear_weight_int4(packed, s, m, n, 32), got)
        packed, s, m = pack_int4(codes, scales, mins, 32, compact=True)
        assert s.dtype == m.dtype == torch.float16  # d, m and -8d are fp16 values: stored in 2 bytes, losslessly
        assert torch.equal(dequantize_linear_weight_int4(packed, s, m, n, 32).view(torch.int32), got.view(torch.int32))


_FP16_OFFSETS = {"Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # where each block keeps its fp16 d (and dmin)


def _random_blocks(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """Random raw rows of ``qtype``: every byte pattern is a valid block once its fp16 fields are finite."""
    from fxcompiler.models.gguf_quant import BLOCK_BYTES, BLOCK_VALUES

    nb, size = k // BLOCK_VALUES[qtype], BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (n * nb, size), dtype=np.uint8)
    for off in _FP16_OFFSETS[qtype]:
        raw[:, off:off + 2] = (rng.standard_normal((n * nb, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return raw.reshape(n, nb * size)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), blocks=st.integers(1, 3), qtype=st.sampled_from(["Q5_0", "Q4_K", "Q6_K"]),
       seed=st.integers(0, 999))
def test_gguf_k_quant_and_q5_0_blocks_decode_bit_for_bit(n, blocks, qtype, seed):
    """Q4_K (int4, scale and min per 32), Q6_K (int8, scale per 16) and Q5_0 (int8, scale per 32) decode to
    codes whose dequantisation is gguf-py's bit for bit, and survive the ops' packers."""
    from gguf import GGMLQuantizationType, quants

    from fxcompiler.models.gguf_quant import BLOCK_VALUES, NativeTensor, decode_blocks
    from passes.quantize import pack_int8_codes

    rng = np.random.default_rng(seed)
    k = BLOCK_VALUES[qtype] * blocks
    raw = _random_blocks(rng, qtype, n, k)
    ref = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, getattr(GGMLQuantizationType, qtype)))).reshape(n, k)
    codes, scales, mins = decode_blocks(raw, qtype, k)
    t = NativeTensor("t", qtype, codes, scales, mins)
    got = t.dequantize()
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert scales.shape == (n, k // t.group)
    if t.bits == 4:
        assert mins is not None and int(codes.min()) >= 0 and int(codes.max()) <= 15
        packed, s, m = pack_int4(codes, scales, mins, t.group)
        assert torch.equal(dequantize_linear_weight_int4(packed, s, m, n, t.group), got)
    else:
        assert mins is None and codes.dtype == torch.int8
        assert (-32 if qtype == "Q6_K" else -16) <= int(codes.min()) and int(codes.max()) <= (31 if qtype == "Q6_K" else 15)
        packed, s, gs = pack_int8_codes(codes, scales)
        assert gs == (-1 if k == t.group else t.group)  # one group a row is per channel
        assert torch.equal(dequantize_linear_weight_int8(packed, s, n, gs), got)


def test_gguf_k_quant_row_length_must_hold_whole_super_blocks():
    from fxcompiler.models.gguf_quant import decode_blocks

    with pytest.raises(ValueError, match="Q4_K: row length 96 is not a multiple of 256"):
        decode_blocks(np.zeros((2, 54), np.uint8), "Q4_K", 96)
    with pytest.raises(ValueError, match="Q6_K: rows of 200 bytes, expected 210 for K=256"):
        decode_blocks(np.zeros((2, 200), np.uint8), "Q6_K", 256)


def test_reverse_permutation_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from fxcompiler.models.gguf_quant import _reverse_permutation

    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w, 6, 2)
    assert np.array_equal(w[_reverse_permutation(24, 2).numpy()], ref)


# -- the C++ kernel against the ATen reference -------------------------------------------------------------
@pytest.mark.parametrize("m, k, n, gs", [(1, 576, 1536, 32), (5, 192, 70, 64), (67, 256, 96, 128), (3, 160, 33, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_w4_kernel_matches_reference(m, k, n, gs, dtype):
    import backends.cpu.quant  # noqa: F401  (installs the C++ kernel loader)

    g = torch.Generator().manual_seed(m * k + n)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed, s, mins = quantize_linear_weight_int4(w, gs)
    ref = linear_w4_reference(x, packed, s, mins, b, n, gs)
    out = linear_w4(x, packed, s, mins, b, n, gs)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * 10)


# -- the quantize pass on tiny models ------------------------------------------------------------------------
def _requantized_program(cfg, weight: str, group: int):
    """A tiny fp32 model whose linear weights are already on the scheme's grid (RTN applied once), so the
    pass must reproduce them: the function changes only by accumulation order and grid round-off."""
    from fxcompiler import testing
    from fxcompiler.ops.linear import dequantize_linear_weight_int8, quantize_linear_weight_int8

    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    program.info.pop("tiny_key", None)  # params edited: no memoised pass results
    for name, w in list(program.params.items()):
        if w.dim() != 2 or any(h in name for h in ("embed", "lm_head", "wte")):
            continue
        if weight == "int4":
            p, s, m = quantize_linear_weight_int4(w, group)
            program.params[name] = dequantize_linear_weight_int4(p, s, m, w.shape[0], group)
        elif weight == "fp8":
            p, s = quantize_linear_weight_fp8(w)
            program.params[name] = dequantize_linear_weight_fp8(p, s, w.shape[0])
        else:
            p, s = quantize_linear_weight_int8(w, group)
            program.params[name] = dequantize_linear_weight_int8(p, s, w.shape[0], group)
    return program


@settings(max_examples=8, deadline=None)
@given(cfg=st.sampled_from([None]).flatmap(lambda _: __import__("fxcompiler.testing", fromlist=["x"]).model_configs(
           archs=("llama", "qwen2", "mistral"))),
       bucket=st.sampled_from([None]).flatmap(lambda _: __import__("fxcompiler.testing", fromlist=["x"]).buckets()),
       scheme=st.sampled_from([("int4", 32), ("int4", 64), ("int8", -1), ("int8", 8), ("fp8", -1)]))
def test_quantize_pass_is_lossless_on_grid_weights(cfg, bucket, scheme):
    from fxcompiler import testing
    from fxcompiler.pass_manager import get_pass
    from passes.quantize import QuantizePass

    weight, group = scheme
    program = _requantized_program(cfg, weight, group)
    info = testing.assert_pass_preserves_semantics(
        QuantizePass({"weight": weight, "group_size": group}), program, testing.example_inputs(program, bucket),
        rtol=1e-4, atol=1e-4, passes_before=(get_pass("weight_layout"), get_pass("fuse_projections")))
    assert info["quantized"] >= 3 * cfg.layers and info["kept"] == 1  # qkv, o, gate_up, down per layer; lm_head kept
    assert set(info["ops"]) == {{"int4": "w4", "int8": "w8", "fp8": "f8"}[weight]}


def test_quantize_pass_lm_head_option_and_errors():
    from fxcompiler import testing
    from fxcompiler.pass_manager import PassError, get_pass
    from passes.quantize import QuantizePass

    cfg = testing.TinyConfig("llama", 1, 32, 2, 1, 97, 48)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    inputs = testing.example_inputs(program, testing.TestBucket(1, 3, 0, 4))
    before = (get_pass("weight_layout"), get_pass("fuse_projections"))
    info = testing.assert_pass_preserves_semantics(QuantizePass({"weight": "int8", "lm_head": True}), program, inputs,
                                                   rtol=0.1, atol=0.1, passes_before=before)
    assert info["kept"] == 0 and info["ops"] == {"w8": 5}  # qkv, o, gate_up, down, lm_head
    with pytest.raises(PassError, match="group_size=24 does not divide K=32"):
        testing.assert_pass_preserves_semantics(QuantizePass({"weight": "int8", "group_size": 24}), program, inputs,
                                                passes_before=before)
    with pytest.raises(PassError, match="weight must be 'int8', 'int4', 'fp8', 'native' or 'rules'"):
        testing.assert_pass_preserves_semantics(QuantizePass({"weight": "int2"}), program, inputs, passes_before=before)


# -- LLM arguments (validated before any model is loaded) ------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(llm_config=LLMConfig(quantization_config=QuantizationConfig("int8", "fp8"))), NotImplementedError,
     "fp8 activations are built with fp8 weights only"),
    (dict(quantization_group_size=64, llm_config=LLMConfig(quantization_config=QuantizationConfig.w_f8_a_16())),
     ValueError, "with fp8 weights"),
    (dict(qformat_path="qformat.yaml"), ValueError, "qformat_path='qformat.yaml' cannot be read"),
    (dict(qparam_path="qparam.safetensors"), ValueError, "qparam_path='qparam.safetensors' needs a qformat_path"),
    (dict(quant_ckpt_file_path="ckpt"), ValueError, "quant_ckpt_file_path='ckpt' does not exist"),
    (dict(keep_gguf_quantization="yes"), TypeError, "keep_gguf_quantization must be a bool"),
    (dict(quantization_group_size=33, llm_config=LLMConfig(quantization_config=QuantizationConfig.w_4_a_16())),
     ValueError, "quantization_group_size"),
])
def test_llm_rejects_bad_quantization_arguments(kwargs, exc, match):
    from fxcompiler import LLM

    with pytest.raises(exc, match=match):
        LLM("no-such-model-needed", **kwargs)


def test_keep_gguf_quantization_needs_a_gguf(tiny_models):
    from fxcompiler import LLM

    with pytest.raises(ValueError, match="needs a GGUF model"):
        LLM(str(tiny_models["llama"]), keep_gguf_quantization=True, max_seq_len_to_capture=64)
