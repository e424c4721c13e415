"""Open quantization files: qformat.yaml (furiosa's metadata line + per-module schemes) and qparam
(safetensors/npz, no pickle), through the ``quantize`` pass on a tiny model; bad input names the culprit."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from fxcompiler import testing
from fxcompiler.config import QuantizationConfig
from fxcompiler.ops.linear import dequantize_linear_weight_int8, quantize_linear_weight_int8
from fxcompiler.ops.quant_linear import dequantize_int4_codes
from fxcompiler.qformat import ModuleScheme, load_qformat, write_qformat
from fxcompiler.qparam import save_qparam
from fxcompiler.quant_options import quantization_options

META = "--weight_dtype int8 --act_dtype bf16 --kv_dtype bf16 --weight_calib_method AMAX_SYM\n"
CFG = testing.TinyConfig("llama", 1, 32, 2, 1, 97, 48)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _qformat(tmp_path, body: str, meta: str = META):
    f = tmp_path / "qformat.yaml"
    f.write_text(meta + body)
    return f


@pytest.fixture(scope="module")
def program():
    return testing.capture_tiny_model(CFG, dtype=torch.float32)


def _weights(program) -> dict[str, torch.Tensor]:
    """transformers module name -> [N, K] weight of every linear of the tiny model."""
    out = {}
    for name, w in program.params.items():
        mod = name.removeprefix("model.").removesuffix(".weight")
        if w.dim() == 2 and mod.split(".")[-1] in ATTN + MLP:
            out[mod] = w
    return out


def _rtn_qparam(program, int8_mods=ATTN, int4_mods=("gate_proj", "up_proj"), group=32, codes=True):
    """RTN scales (+ codes) of the tiny model: int8 per channel for ``int8_mods``, int4 g``group`` asymmetric."""
    tensors = {}
    for mod, w in _weights(program).items():
        leaf = mod.split(".")[-1]
        if leaf in int8_mods:
            amax = w.abs().amax(1, keepdim=True)
            s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            tensors[f"{mod}.weight_scale"] = s
            if codes:
                tensors[f"{mod}.qweight"] = torch.clamp(torch.round(w / s), -127, 127).to(torch.int8)
        elif leaf in int4_mods:
            n, k = w.shape
            wg = w.reshape(n, k // group, group)
            lo, hi = wg.amin(2), wg.amax(2)
            s = (hi - lo) / 15
            tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_min"] = s, lo
            if codes:
                q = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
                tensors[f"{mod}.qweight"] = q.reshape(n, k)
    return tensors


MIXED = ('modules:\n  "model.layers.*.self_attn.*": {weight: int8, granularity: channel}\n'
         '  "model.layers.*.mlp.down_proj": {weight: bf16}\n'
         '  "model.layers.*.mlp.*": {weight: int4, granularity: group, group_size: 32, symmetric: false}\n')


def _run(program, opts, rtol=1e-4, atol=1e-4):
    from fxcompiler.pass_manager import get_pass
    from passes.quantize import QuantizePass

    inputs = testing.example_inputs(program, testing.TestBucket(1, 3, 0, 4))
    return testing.assert_pass_preserves_semantics(
        QuantizePass(opts), program, inputs, rtol=rtol, atol=atol,
        passes_before=(get_pass("weight_layout"), get_pass("fuse_projections")))


def _opts(tmp_path, body=MIXED, tensors=None, meta=META, name="qparam.safetensors"):
    qf = _qformat(tmp_path, body, meta)
    qp = None
    if tensors is not None:
        qp = tmp_path / name
        save_qparam(qp, tensors)
    opts, _ = quantization_options(QuantizationConfig.from_qformat(qf), qformat_path=qf, qparam_path=qp)
    return opts


# -- what works --------------------------------------------------------------------------------------------
def test_qformat_round_trip_and_per_module_schemes(tmp_path):
    f = tmp_path / "q.yaml"
    write_qformat(f, QuantizationConfig.w_4_a_16(), ModuleScheme("int4", 64, False),
                  {"lm_head": ModuleScheme("int8", -1, True), "model.layers.0.*": ModuleScheme("keep")})
    qf = load_qformat(f)
    assert str(qf.config) == "W4A16KV16" and qf.default == ModuleScheme("int4", 64, False)
    assert dict(qf.modules) == {"lm_head": ModuleScheme("int8", -1, True), "model.layers.0.*": ModuleScheme("keep")}
    assert f.read_text().splitlines()[0].startswith("--weight_dtype int4 --act_dtype bf16 --kv_dtype bf16")


def test_mixed_schemes_with_qparam_codes_reproduce_the_grid_model(program, tmp_path):
    """Weights put on the qparam's grid first: the quantized graph must compute the same function."""
    tensors = _rtn_qparam(program)
    grid = testing.copy_program(program)
    grid.info.pop("tiny_key", None)  # params edited: no memoised pass results
    for mod, w in _weights(program).items():
        key = f"model.{mod}.weight"
        if f"{mod}.weight_min" in tensors:
            q = tensors[f"{mod}.qweight"]
            grid.params[key] = dequantize_int4_codes(q, tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_min"], 32)
        elif f"{mod}.weight_scale" in tensors:
            grid.params[key] = tensors[f"{mod}.qweight"].float() * tensors[f"{mod}.weight_scale"]
    info = _run(grid, _opts(tmp_path, tensors=tensors))
    assert info["ops"] == {"w8": 2, "w4": 1} and info["kept"] == 2  # qkv, o | gate_up | down, lm_head
    assert info["from_qparam"] == 3


def test_qparam_scales_without_codes_round_like_rtn(program, tmp_path):
    tensors = _rtn_qparam(program, int4_mods=(), codes=False)
    body = 'modules:\n  "model.layers.*.self_attn.*": {weight: int8}\n  "*": {weight: bf16}\n'
    info = _run(program, _opts(tmp_path, body, tensors), rtol=0.05, atol=0.05)
    assert info["ops"] == {"w8": 2}
    from fxcompiler.qparam import QParamSet

    mod = "model.layers.0.self_attn.o_proj"
    w = _weights(program)[mod]
    save_qparam(tmp_path / "o.safetensors", {f"{mod}.weight_scale": tensors[f"{mod}.weight_scale"]})
    codes, scales, mins = QParamSet(tmp_path / "o.safetensors").codes_for([mod], w, "int8", -1, True)
    assert mins is None and torch.equal(dequantize_linear_weight_int8(*quantize_linear_weight_int8(w), 32, -1),
                                        codes.float() * scales)


F8META = "--weight_dtype fp8 --act_dtype bf16 --kv_dtype bf16 --weight_calib_method AMAX_SYM\n"


def _fp8_qparam(program, mods=ATTN + MLP, codes=True):
    from fxcompiler.ops.quant_linear import quantize_fp8_codes

    tensors = {}
    for mod, w in _weights(program).items():
        if mod.split(".")[-1] in mods:
            q, s = quantize_fp8_codes(w)
            tensors[f"{mod}.weight_scale"] = s
            if codes:
                tensors[f"{mod}.qweight"] = q
    return tensors


def test_fp8_qformat_with_qparam_codes_reproduces_the_grid_model(program, tmp_path):
    """fp8 (e4m3) codes and per-channel scales from the file (safetensors F8_E4M3) through the pass."""
    f = tmp_path / "w.yaml"
    write_qformat(f, QuantizationConfig.w_f8_a_16(), ModuleScheme("fp8", -1, True), {"lm_head": ModuleScheme("keep")})
    assert load_qformat(f).default == ModuleScheme("fp8", -1, True)
    assert f.read_text().startswith("--weight_dtype fp8 --act_dtype bf16")
    tensors = _fp8_qparam(program)
    grid = testing.copy_program(program)
    grid.info.pop("tiny_key", None)
    for mod in _weights(program):
        grid.params[f"model.{mod}.weight"] = tensors[f"{mod}.qweight"].float() * tensors[f"{mod}.weight_scale"]
    opts = _opts(tmp_path, "", tensors, meta=F8META)  # no default: --weight_dtype fp8 gives fp8 per channel
    assert opts["default"] == {"weight": "fp8", "group_size": -1, "symmetric": True}
    info = _run(grid, opts)
    assert info["ops"] == {"f8": 4} and info["kept"] == 1 and info["from_qparam"] == 4


def test_fp8_qparam_scales_without_codes_round_like_rtn(program, tmp_path):
    from fxcompiler.ops.quant_linear import quantize_fp8_codes
    from fxcompiler.qparam import QParamSet

    mod = "model.layers.0.mlp.down_proj"
    w = _weights(program)[mod]
    q, s = quantize_fp8_codes(w)
    save_qparam(tmp_path / "d.safetensors", {f"{mod}.weight_scale": s})
    codes, scales, mins = QParamSet(tmp_path / "d.safetensors").codes_for([mod], w, "fp8", -1, True)
    assert mins is None and torch.equal(codes.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales, s)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.qweight": torch.zeros(32, 32, dtype=torch.int8)}),
     "'model.layers.0.self_attn.o_proj.qweight' is torch.int8 \\[32, 32\\], expected torch.float8_e4m3fn"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.qweight":
                         torch.full((32, 32), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)}),
     "'model.layers.0.self_attn.o_proj.qweight' has NaN fp8 codes"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.zeros(32, 1)}),
     "'model.layers.0.self_attn.o_proj.weight_scale' has 32 non-finite or non-positive"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_min": torch.zeros(32, 1)}),
     "unexpected tensor model.layers.0.mlp.down_proj.weight_min: the scheme of .* is fp8 \\(no min\\)"),
])
def test_bad_fp8_qparam_names_the_tensor(program, tmp_path, edit, match):
    from fxcompiler.pass_manager import PassError

    tensors = _fp8_qparam(program)
    edit(tensors)
    with pytest.raises((ValueError, PassError), match=match):
        _run(program, _opts(tmp_path, "", tensors, meta=F8META))


def test_npz_qparam_is_read_without_pickle(program, tmp_path):
    tensors = _rtn_qparam(program, int4_mods=())
    np.savez(tmp_path / "qp.npz", **{k: v.numpy() for k, v in tensors.items()})
    qf = _qformat(tmp_path, 'modules:\n  "model.layers.*.self_attn.*": {weight: int8}\n  "*": {weight: bf16}\n')
    opts, _ = quantization_options(None, qformat_path=qf, qparam_path=tmp_path / "qp.npz")
    assert _run(program, opts, rtol=0.1, atol=0.1)["from_qparam"] == 2  # float weights, RTN error


# -- bad input names the culprit (acceptance 4) -------------------------------------------------------------
@pytest.mark.parametrize("meta, body, exc, match", [
    ("quantized_op: {}\n", "", ValueError, "first line must be furiosa's metadata line"),
    ("--act_dtype bf16\n", "", ValueError, "lacks --weight_dtype"),
    (META, "modules: [unclosed\n", ValueError, "not valid YAML"),
    (META, "layers: {}\n", ValueError, "unknown top-level keys \\['layers'\\]"),
    (META, 'modules:\n  "*.q_proj": {weight: int8, bits: 8}\n', ValueError, "modules\\['\\*.q_proj'\\] has unknown keys"),
    (META, 'modules:\n  "*.q_proj": {weight: int3}\n', ValueError, "modules\\['\\*.q_proj'\\].weight must be one of"),
    (META, 'modules:\n  "*.q_proj": {weight: int8, symmetric: false}\n', ValueError, "int8 weights are symmetric"),
    (META, 'default: {weight: int4, group_size: 33}\n', ValueError, "default.group_size must be a positive even"),
    (META, 'modules:\n  "*": {weight: int8, granularity: channel, group_size: 64}\n', ValueError,
     "granularity 'channel' takes no group_size"),
    (META, 'modules:\n  "*": {weight: fp8, granularity: group, group_size: 32}\n', ValueError,
     "fp8 weights have one scale per output channel"),
    (META, 'modules:\n  "*": {weight: fp8, symmetric: false}\n', ValueError, "fp8 weights are symmetric"),
    ("--weight_dtype int8 --act_dtype fp8 --kv_dtype bf16\n", "", NotImplementedError,
     "W8Af8KV16: fp8 activations are built with fp8 weights only"),
    ("--weight_dtype int8 --act_dtype fp32 --kv_dtype bf16\n", "", ValueError,
     "--kv_dtype bf16 with --act_dtype fp32: the KV cache is kept in the activation dtype"),
])
def test_bad_qformat(tmp_path, meta, body, exc, match):
    qf = _qformat(tmp_path, body, meta)
    with pytest.raises(exc, match=match):
        quantization_options(None, qformat_path=qf)


def test_qformat_conflicting_with_llm_config(tmp_path):
    qf = _qformat(tmp_path, "")
    with pytest.raises(ValueError, match="--kv_dtype bf16 conflicts with llm_config.quantization_config.kv_cache=fp32"):
        quantization_options(QuantizationConfig("int8", "bf16", "fp32"), qformat_path=qf)
    with pytest.raises(ValueError, match="describes W8A16KV16 but llm_config.quantization_config is W4A16"):
        quantization_options(QuantizationConfig.w_4_a_16(), qformat_path=qf)
    with pytest.raises(ValueError, match="needs a qformat_path"):
        quantization_options(None, qparam_path=tmp_path / "qparam.safetensors")


def test_pickle_qparam_files_are_refused(tmp_path):
    qf = _qformat(tmp_path, "")
    torch.save({"x": torch.ones(1)}, tmp_path / "qparam.pt")
    with pytest.raises(ValueError, match="pickle-based files are refused"):
        quantization_options(None, qformat_path=qf, qparam_path=tmp_path / "qparam.pt")
    (tmp_path / "disguised.safetensors").write_bytes(pickle.dumps({"x": 1}, protocol=4))
    with pytest.raises(ValueError, match="the file is a pickle"):
        quantization_options(None, qformat_path=qf, qparam_path=tmp_path / "disguised.safetensors")
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="array 'x' needs pickle"):
        quantization_options(None, qformat_path=qf, qparam_path=tmp_path / "obj.npz")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(ValueError, match="not a safetensors file"):
        quantization_options(None, qformat_path=qf, qparam_path=tmp_path / "junk.safetensors")


def _bad_qparam(program, edit):
    tensors = _rtn_qparam(program)
    edit(tensors)
    return tensors


@pytest.mark.parametrize("edit, body, exc, match", [
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_min"), MIXED, ValueError,
     "missing tensor 'model.layers.0.mlp.up_proj.weight_min'"),
    (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale"), MIXED, ValueError,
     "missing tensor 'model.layers.0.self_attn.o_proj.weight_scale' \\(int8 scale per channel\\)"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(32, 1)}), MIXED, ValueError,
     "tensors no quantized module uses, e.g. 'model.layers.0.mlp.down_proj.weight_scale'"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(32, 2)}), MIXED, ValueError,
     "'model.layers.0.self_attn.o_proj.weight_scale' has shape \\[32, 2\\], expected \\[32, 1\\]"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale": torch.ones(17, 1)}), MIXED, ValueError,
     "give 65 output rows, the weight has 64"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.qweight": torch.full((48, 32), 16, dtype=torch.uint8)}),
     MIXED, ValueError, "'model.layers.0.mlp.gate_proj.qweight' has codes outside \\[0, 15\\]"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": -torch.ones(32, 1)}), MIXED, ValueError,
     "'model.layers.0.self_attn.o_proj.weight_scale' has 32 non-finite or non-positive"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.smooth_factor": torch.ones(32)}), MIXED,
     NotImplementedError, "SmoothQuant factor"),
    (lambda t: None, MIXED + '  "model.layers.*.attn.c_proj": {weight: int8}\n', ValueError,
     "pattern 'model.layers.\\*.attn.c_proj' matches no matmul"),
    (lambda t: None, 'modules:\n  "*.q_proj": {weight: int8, granularity: group, group_size: 16}\n', ValueError,
     "different schemes to modules fused into one matmul \\(model.layers.0.self_attn.q_proj, "
     "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj\\)"),
])
def test_bad_qparam_names_the_tensor(program, tmp_path, edit, body, exc, match):
    from fxcompiler.pass_manager import PassError

    opts = _opts(tmp_path, body, _bad_qparam(program, edit))
    with pytest.raises((exc, PassError), match=match) as err:
        _run(program, opts)
    assert isinstance(err.value, exc) or isinstance(err.value.__cause__, exc)


def test_unsupported_gguf_type_is_named():
    from fxcompiler.models.gguf_quant import decode_blocks

    with pytest.raises(ValueError, match="GGUF type Q5_K has no native int4/int8 layout"):
        decode_blocks(np.zeros((2, 176), np.uint8), "Q5_K", 256)


def test_compile_cache_key_covers_qformat_and_qparam_contents(tiny_models, tmp_path):
    from fxcompiler.build import ProgramRequest

    def key(tensors, body=MIXED):
        opts = _opts(tmp_path, body, tensors)
        req = ProgramRequest("hf", "tiny", tiny_models["llama"], {}, None, False, None, False, 16,
                             {"quantization": opts})
        return req.cache_key(torch.device("cpu"))

    one = {"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(32, 1)}
    two = {"model.layers.0.self_attn.o_proj.weight_scale": torch.full((32, 1), 2.0)}
    k1, k2 = key(one), key(two)
    assert k1 is not None and k1 != k2 and key(one) == k1
    assert key(one, MIXED.replace("group_size: 32", "group_size: 64")) != k1
