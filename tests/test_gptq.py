"""GPTQ (fxcompiler/gptq.py): with a diagonal Hessian it is RTN code for code (hypothesis); on a tiny llama,
layer by layer over real calibration inputs, its reconstruction error ‖WX − ŴX‖ is at most RTN's for every
linear; ``fxcompiler quantize --algorithm gptq`` writes a directory LLM(OUT) loads and generates with."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxcompiler.gptq import GPTQConfig, gptq_quantize_model, gptq_quantize_weight
from fxcompiler.qformat import ModuleScheme
from fxcompiler.quantize_model import _rtn
from tests._quant_checks import assert_engine_uses_file_codes

SCHEMES = [ModuleScheme("int8", -1, True), ModuleScheme("int4", 32, False), ModuleScheme("int4", 64, False),
           ModuleScheme("int4", 32, True), ModuleScheme("fp8", -1, True)]


def _dequant(t: dict, scheme: ModuleScheme, k: int) -> torch.Tensor:
    """An independent dequantiser of the qparam tensors (float64)."""
    q, s = t["qweight"].float().double(), t["weight_scale"].double()
    if scheme.weight in ("int8", "fp8"):
        return q * s
    idx = torch.arange(k) // scheme.group_size
    m = t["weight_min"].double() if "weight_min" in t else -8.0 * s
    return q * s[:, idx] + m[:, idx]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3), st.sampled_from(range(len(SCHEMES))), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_gptq_with_a_diagonal_hessian_is_rtn(n, blocks, which, act_order, seed):
    scheme = SCHEMES[which]
    k = 64 * blocks - (32 if blocks > 1 else 0)  # also K = 96, 160: g64's last group is shorter
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    diag = torch.rand(k, generator=gen) + 0.05  # any positive diagonal: nothing to propagate
    got = gptq_quantize_weight(w, torch.diag(diag), scheme, GPTQConfig(block_size=64, act_order=act_order))
    ref = _rtn(w, scheme)  # the RTN path `fxcompiler quantize --algorithm rtn` writes
    assert got.keys() == ref.keys()
    for key in ref:
        a, b = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (got[key], ref[key]))
        assert got[key].dtype == ref[key].dtype and torch.equal(a, b), key
    # and the bound RTN keeps: at most half a step per value (one step for symmetric int4 at its clamp)
    step = ref["weight_scale"].double().abs()
    if scheme.weight == "int4":
        step = step.repeat_interleave(scheme.group_size, 1)[:, :k]
    bound = step * (1.0 if scheme.symmetric and scheme.weight == "int4" else 0.5) + 1e-6
    if scheme.weight == "fp8":  # half an e4m3 ulp
        bound = torch.maximum(w.double().abs() / 16, step / 1024) * (1 + 1e-6) + 1e-12
    assert bool(((_dequant(got, scheme, k) - w.double()).abs() <= bound).all())


def test_gptq_with_a_near_identity_hessian_stays_near_rtn():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=gen)
    a = torch.randn(128, 128, generator=gen)
    scheme = ModuleScheme("int4", 32, False)
    got = gptq_quantize_weight(w, torch.eye(128) + 1e-4 * (a @ a.T) / 128, scheme)
    ref = _rtn(w, scheme)
    # tiny off-diagonal terms move a value by at most one code, and only rarely
    diff = (got["qweight"].int() - ref["qweight"].int()).abs()
    assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.05
    assert torch.allclose(got["weight_scale"], ref["weight_scale"], rtol=0, atol=0.05)


@pytest.fixture(scope="module")
def tiny_llama_model(tiny_models):
    from transformers import AutoModelForCausalLM

    return str(tiny_models["llama"]), AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]),
                                                                           dtype=torch.float32)


def test_gptq_beats_rtn_on_every_linear_of_a_tiny_llama(tiny_llama_model):
    import copy

    from fxcompiler.calibration import calibration_samples, calibration_text
    from fxcompiler.quantize_model import _linear_modules

    path, model = tiny_llama_model
    modules = _linear_modules(model.config)
    samples, _ = calibration_samples(calibration_text(), None, model.config.vocab_size, 4, 32, seed=0)
    for scheme in (ModuleScheme("int4", 32, False), ModuleScheme("int8", -1, True), ModuleScheme("fp8", -1, True)):
        m = copy.deepcopy(model)
        res = gptq_quantize_model(m, samples, modules, scheme, progress=False, keep_hessians=True)
        assert sorted(res.hessians) == sorted(modules) and len(modules) == 14
        for mod in modules:
            w, h = res.stats[mod]["weight"].double(), res.hessians[mod].double()
            k = w.shape[1]
            gptq = {key: res.tensors[f"{mod}.{key}"] for key in ("qweight", "weight_scale", "weight_min")
                    if f"{mod}.{key}" in res.tensors}
            errs = {}
            for name, t in (("gptq", gptq), ("rtn", _rtn(w.float(), scheme))):
                d = w - _dequant(t, scheme, k)
                errs[name] = float(torch.einsum("nk,kl,nl->", d, h, d))  # ∝ ‖(W − Ŵ) Xᵀ‖²
            assert errs["gptq"] <= errs["rtn"], (scheme, mod, errs)
            # the model now carries the quantized values (what the next layer's Hessians were taken with)
            got = dict(m.named_modules())[mod].weight.double()
            assert torch.allclose(got, _dequant(gptq, scheme, k), atol=1e-6)
        assert res.inputs_seen == 4 * 32
        # sequential: layer 0's Hessians are the float model's, layer 1's come from inputs through quantized layer 0
        for mod, same in (("model.layers.0.self_attn.q_proj", True), ("model.layers.1.self_attn.q_proj", False)):
            xs = []
            hook = dict(model.named_modules())[mod].register_forward_hook(lambda _m, i, _o: xs.append(i[0]))
            with torch.no_grad():
                for ids in samples:
                    model(input_ids=ids, use_cache=False)
            hook.remove()
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
            h_float = 2.0 / x.shape[0] * (x.T @ x)
            assert torch.allclose(res.hessians[mod].double(), h_float, rtol=1e-5, atol=1e-5) == same, mod


def test_quantize_cli_gptq_round_trip(tiny_models, tmp_path, capsys):
    from safetensors.torch import load_file

    from fxcompiler import LLM, SamplingParams
    from fxcompiler.cli import main

    out = tmp_path / "gptq"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "w4a16-g32", "--algorithm", "gptq",
                 "--num-samples", "4", "--seq-len", "32", "--seed", "7"]) == 0
    assert "gptq" in capsys.readouterr().out
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["algorithm"] == "gptq" and recipe["seed"] == 7 and recipe["modules"] == 14
    assert recipe["gptq"]["damp"] == 0.01 and recipe["gptq"]["block_size"] == 128
    assert recipe["gptq"]["act_order"] is False and recipe["gptq"]["hessian_error_vs_rtn_mean"] <= 1.0
    calib = recipe["calibration"]
    assert calib["read"] is True and len(calib["sha256"]) == 16 and calib["num_samples"] == 4
    assert "algorithm gptq" in (out / "qformat.yaml").read_text().splitlines()[0]
    qp = load_file(str(out / "qparam.safetensors"))
    assert not torch.equal(qp["model.layers.1.mlp.down_proj.qweight"],
                           _rtn(load_file(str(out / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"],
                                ModuleScheme("int4", 32, False))["qweight"])  # GPTQ's codes, not RTN's

    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["from_qparam"] == 8 and info["ops"] == {"w4": 8}
    assert_engine_uses_file_codes(llm, qp, "model.layers.1.mlp.down_proj", 64)
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2], [9, 8, 7]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    llm.shutdown()


# ------------------------------------------------------------------------------------------------
# the mse weight observer and GPTQ's refit
# ------------------------------------------------------------------------------------------------
def _group_errors(w: torch.Tensor, t: dict, scheme: ModuleScheme, imp: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error per row and group (per row for int8/fp8), float64, of the qparam tensors ``t``."""
    d2 = (w.double() - _dequant(t, scheme, w.shape[1])) ** 2
    if imp is not None:
        d2 = d2 * imp.double()
    if scheme.weight in ("int8", "fp8"):
        return d2.sum(dim=1, keepdim=True)
    g = scheme.group_size
    return torch.stack([d2[:, j:j + g].sum(dim=1) for j in range(0, w.shape[1], g)], 1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from(range(len(SCHEMES))), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_mse_observer_error_is_at_most_minmax_per_group(n, k32, which, weighted, seed):
    from fxcompiler.gptq import rtn_quantize_weight
    from fxcompiler.weight_observer import fp8_scale, int4_codes, int4_grid

    scheme = SCHEMES[which]
    k = 32 * k32 + (16 if k32 > 1 else 0)  # K = 80, 112, 144: a shorter last group for g32 and g64
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    w[:, 0] += 4 * torch.rand(n, generator=gen)  # an outlier per row: clipping it can pay
    if scheme.weight == "int8":  # int8 keeps amax/127 whatever the observer
        assert all(torch.equal(rtn_quantize_weight(w, scheme, "mse")[key], _rtn(w, scheme)[key])
                   for key in ("qweight", "weight_scale"))
        return
    imp = torch.rand(k, generator=gen) if weighted else None
    if imp is None:  # RTN through the observer (what `fxcompiler quantize --w-observer mse` writes)
        mse, ref = rtn_quantize_weight(w, scheme, "mse"), _rtn(w, scheme)
    else:  # the importance-weighted search GPTQ runs (one group at a time)
        ref = _rtn(w, scheme)
        if scheme.weight == "fp8":
            s = fp8_scale(w, "mse", imp)
            mse = {"weight_scale": s, "qweight": torch.clamp(w / s, -448, 448).to(torch.float8_e4m3fn)}
        else:
            g = scheme.group_size
            grids = [int4_grid(w[:, j:j + g], scheme.symmetric, "mse", imp[j:j + g]) for j in range(0, k, g)]
            s, m = torch.stack([a for a, _ in grids], 1), torch.stack([b for _, b in grids], 1)
            idx = torch.arange(k) // g
            mse = {"weight_scale": s, "qweight": int4_codes(w, s[:, idx], m[:, idx], scheme.symmetric).to(torch.uint8)}
            if not scheme.symmetric:
                mse["weight_min"] = m
    got, base = _group_errors(w, mse, scheme, imp), _group_errors(w, ref, scheme, imp)
    assert bool((got <= base * (1 + 1e-5) + 1e-9).all()), (got, base)
    if scheme.weight == "int4" and not scheme.symmetric:  # the layout's rule: s >= 0
        assert bool((mse["weight_scale"] >= 0).all())
    if scheme.weight == "fp8":
        assert bool((mse["weight_scale"] > 0).all())


def test_mse_observer_lowers_the_error_of_heavy_tailed_groups():
    from fxcompiler.gptq import rtn_quantize_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256))
    for scheme in (ModuleScheme("int4", 128, False), ModuleScheme("int4", 32, True), ModuleScheme("fp8", -1, True)):
        got = _group_errors(w, rtn_quantize_weight(w, scheme, "mse"), scheme).sum()
        base = _group_errors(w, _rtn(w, scheme), scheme).sum()
        assert got < 0.95 * base, (scheme, float(got / base))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.sampled_from(range(len(SCHEMES))), st.sampled_from(["minmax", "mse"]),
       st.integers(0, 2**31 - 1))
def test_gptq_refit_never_raises_the_hessian_error(n, which, observer, seed):
    from fxcompiler.gptq import hessian_error

    scheme = SCHEMES[which]
    k = 96
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(256, k, generator=gen) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen))
    h = 2.0 / 256 * (x.T @ x)
    plain = gptq_quantize_weight(w, h, scheme, GPTQConfig(observer=observer))
    refit = gptq_quantize_weight(w, h, scheme, GPTQConfig(observer=observer, refit=True))
    assert torch.equal(plain["qweight"].view(torch.uint8), refit["qweight"].view(torch.uint8))  # same codes
    assert hessian_error(w, refit, scheme, h) <= hessian_error(w, plain, scheme, h) * (1 + 1e-9) + 1e-12
    if scheme.weight in ("int8", "fp8"):
        assert bool((refit["weight_scale"] > 0).all())
    elif not scheme.symmetric:
        assert bool((refit["weight_scale"] >= 0).all())


def test_gptq_config_rejects_an_unknown_observer():
    with pytest.raises(ValueError, match="GPTQ observer must be one of minmax, mse"):
        GPTQConfig(observer="percentile")
    with pytest.raises(ValueError, match="refit must be a bool"):
        GPTQConfig(refit=1)


def test_quantize_rtn_with_the_mse_observer(tiny_models, tmp_path):
    from safetensors.torch import load_file

    from fxcompiler.quantize_model import quantize_model

    scheme = ModuleScheme("int4", 32, False)
    with pytest.raises(ValueError, match="--w-observer must be one of minmax, mse"):
        quantize_model(str(tiny_models["llama"]), tmp_path / "bad", "w4a16-g32", observer="max")
    out = quantize_model(str(tiny_models["llama"]), tmp_path / "mse", "w4a16-g32", observer="mse", progress=False)
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["rtn"] == {"observer": "mse"}
    assert "--weight_calib_method MSE_ASYM" in (out / "qformat.yaml").read_text().splitlines()[0]
    qp, w = load_file(str(out / "qparam.safetensors")), load_file(str(out / "model.safetensors"))
    mod = "model.layers.1.mlp.down_proj"
    t = {key: qp[f"{mod}.{key}"] for key in ("qweight", "weight_scale", "weight_min")}
    ref = _rtn(w[f"{mod}.weight"], scheme)
    assert not torch.equal(t["weight_scale"], ref["weight_scale"])
    assert float(_group_errors(w[f"{mod}.weight"], t, scheme).sum()) < float(
        _group_errors(w[f"{mod}.weight"], ref, scheme).sum())


def test_gptq_true_sequential_stages_a_tiny_llama(tiny_llama_model):
    import copy

    from fxcompiler.calibration import calibration_samples, calibration_text
    from fxcompiler.gptq import _stages
    from fxcompiler.quantize_model import _linear_modules

    _, model = tiny_llama_model
    modules = _linear_modules(model.config)
    samples, _ = calibration_samples(calibration_text(), None, model.config.vocab_size, 2, 16, seed=1)
    scheme = ModuleScheme("int4", 32, False)
    plain = gptq_quantize_model(copy.deepcopy(model), samples, modules, scheme, progress=False, keep_hessians=True)
    m = copy.deepcopy(model)
    res = gptq_quantize_model(m, samples, modules, scheme, GPTQConfig(true_sequential=True, observer="mse",
                                                                      refit=True),
                              progress=False, keep_hessians=True)
    att, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    layer0 = [x for x in modules if x.startswith("model.layers.0.")]
    named = dict(m.named_modules())
    emb = m.get_input_embeddings()(samples[0])
    pos = torch.arange(samples[0].shape[1])[None]
    kw = {"position_embeddings": m.model.rotary_emb(emb, pos), "position_ids": pos}
    assert _stages(m.model.layers[0], layer0, named, emb, ((), kw)) == [
        [f"{att}.q_proj", f"{att}.k_proj", f"{att}.v_proj"], [f"{att}.o_proj"], [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
        [f"{mlp}.down_proj"]]
    # the first stage sees the float layer; o_proj's inputs come through the quantized q/k/v
    assert torch.equal(res.hessians[f"{att}.q_proj"], plain.hessians[f"{att}.q_proj"])
    assert not torch.allclose(res.hessians[f"{att}.o_proj"], plain.hessians[f"{att}.o_proj"])
    assert sorted(res.hessians) == sorted(modules)
    for mod in modules:
        assert res.stats[mod]["gptq"] <= res.stats[mod]["rtn"], mod
