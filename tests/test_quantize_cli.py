"""``fxcompiler quantize MODEL OUT``: a directory LLM(OUT) loads, computing with the qparam's codes;
the calibration text split; unbuilt schemes and algorithms raise with the reason."""
from __future__ import annotations

import json

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.calibration import split_topics
from fxcompiler.cli import main
from tests._quant_checks import assert_engine_uses_file_codes


def test_pydoc_topics_split_is_deterministic_and_disjoint():
    from pydoc_data.topics import topics

    calib, held = split_topics()
    assert (calib, held) == split_topics()
    names = sorted(topics)
    assert topics[names[0]] in calib and topics[names[1]] in held and topics[names[1]] not in calib
    assert len(calib) + len(held) + 4 >= sum(len(v) for v in topics.values())


@pytest.mark.parametrize("argv, match", [
    (["--scheme", "kv8+kv8"], "one weight scheme, kv8 or kvf8, or a weight scheme \\+kv8"),
    (["--scheme", "kv8+kvf8"], "one weight scheme, kv8 or kvf8, or a weight scheme \\+kv8"),
    (["--scheme", "w8a16+w4a16-g32"], "one weight scheme, kv8 or kvf8, or a weight scheme \\+kv8"),
    (["--scheme", "kv8", "--algorithm", "gptq"], "--algorithm gptq quantizes weights; --scheme kv8"),
    (["--scheme", "kvf8", "--algorithm", "gptq"], "--algorithm gptq quantizes weights; --scheme kvf8 .*w8a16\\+kvf8"),
    (["--scheme", "w8a16", "--kv-calib-tokens", "64"], "--kv-calib-tokens applies to the kv8 / kvf8 schemes"),
    (["--scheme", "kv8", "--kv-calib-tokens", "0"], "--kv-calib-tokens must be a positive int"),
    (["--scheme", "w8a16", "--kv-observer", "percentile"], "--kv-observer / --kv-percentile apply to the kv8"),
    (["--scheme", "kvf8", "--kv-percentile", "99"], "--kv-percentile applies to --kv-observer percentile"),
    (["--scheme", "kvf8", "--kv-observer", "percentile", "--kv-percentile", "0"],
     "--kv-percentile must be a number in \\(0, 100\\], got 0.0"),
    (["--scheme", "wf8af8", "--algorithm", "smoothquant"], "--algorithm smoothquant needs int8 activations"),
    (["--scheme", "w4a16-g48"], "--scheme must be w8a16.*wf8af8"),
    (["--scheme", "w8a16", "--algorithm", "smoothquant"], "--algorithm smoothquant needs int8 activations"),
    (["--scheme", "w8a16", "--algorithm", "awq"], "--algorithm must be rtn, gptq or smoothquant, got .awq."),
])
def test_unbuilt_schemes_are_reported(tmp_path, capsys, argv, match):
    assert main(["quantize", str(tmp_path / "none"), str(tmp_path / "out"), *argv]) == 2
    import re

    assert re.search(match, capsys.readouterr().err)


def test_quantized_directory_loads_and_matches_rtn(tiny_models, tmp_path, capsys):
    out = tmp_path / "w4"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "w4a16-g32"]) == 0
    assert "LLM(" in capsys.readouterr().out
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["algorithm"] == "rtn" and recipe["config"] == "W4A16" and recipe["modules"] == 14
    assert len(recipe["calibration"]["sha256"]) == 16 and recipe["seed"] == 0
    assert (out / "qformat.yaml").read_text().startswith("--weight_dtype int4 --act_dtype bf16 --kv_dtype bf16")
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "w8a16"]) == 2  # not empty

    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["from_qparam"] == 8 and info["ops"] == {"w4": 8} and info["kept"] == 1  # 2 x (qkv, o, gate_up, down)
    assert llm.quantization["scheme"] == "W4A16KV16"
    # the engine multiplies by exactly the file's codes, scales and mins
    from safetensors.torch import load_file

    qp = load_file(str(out / "qparam.safetensors"))
    assert_engine_uses_file_codes(llm, qp, "model.layers.1.mlp.down_proj", 64)
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2], [9, 8, 7]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    llm.shutdown()


def test_w4a8_directory_loads_with_int8_activations_and_the_file_codes(tiny_models, tmp_path, capsys):
    """``--scheme w4a8-g32``: the qformat says int4 weights with int8 activations; LLM(OUT) runs fxc::linear_w4a8 on
    exactly the file's codes, scales and mins. SmoothQuant is refused for it (int8 weights per channel only)."""
    from fxcompiler.ops.w4a8_linear import unpack_w4a8

    out = tmp_path / "w4a8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "w4a8-g32"]) == 0
    assert json.loads((out / "quantization_recipe.json").read_text())["config"] == "W4A8"
    assert (out / "qformat.yaml").read_text().startswith("--weight_dtype int4 --act_dtype int8")
    assert main(["quantize", str(tiny_models["llama"]), str(tmp_path / "sq"), "--scheme", "w4a8-g32",
                 "--algorithm", "smoothquant"]) == 2
    assert "smoothquant is built for int8 weights per channel" in capsys.readouterr().err
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    try:
        info = next(h for h in llm.pass_history if h["pass"] == "quantize")
        assert info["from_qparam"] == 8 and info["ops"] == {"w4a8": 8} and info["kept"] == 1
        assert llm.quantization["scheme"].startswith("W4A8")
        from safetensors.torch import load_file

        qp = load_file(str(out / "qparam.safetensors"))
        module = "model.layers.1.mlp.down_proj"
        base = next(k for k in llm._build.params if module.removeprefix("model.") in k and k.endswith(".q"))[:-2]
        q, s, m = unpack_w4a8(llm._build.params[base + ".q"], llm._build.params[base + ".scales"],
                              llm._build.params[base + ".mins"], 64)
        assert torch.equal(q, qp[f"{module}.qweight"]) and torch.equal(s.float(), qp[f"{module}.weight_scale"])
        assert torch.equal(m.float(), qp[f"{module}.weight_min"])
        outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            prompt_token_ids=[[5, 17, 33, 2]])
        assert len(outs[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_fp8_directory_loads_with_the_file_codes(tiny_models, tmp_path):
    """``--scheme fp8`` (once NotImplementedError): e4m3 codes + per-channel scales; LLM(OUT) runs Wf8A16 on
    fxc::linear_f8 with exactly the file's codes and scales."""
    from safetensors.torch import load_file

    from fxcompiler.ops.quant_linear import unpack_fp8

    out = tmp_path / "f8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "fp8"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["config"] == "Wf8A16" and recipe["module_scheme"] == {"weight": "fp8", "group_size": -1,
                                                                       "symmetric": True}
    assert (out / "qformat.yaml").read_text().startswith("--weight_dtype fp8 --act_dtype bf16 --kv_dtype bf16")
    qp = load_file(str(out / "qparam.safetensors"))
    mod = "model.layers.1.mlp.down_proj"
    assert qp[f"{mod}.qweight"].dtype == torch.float8_e4m3fn
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["from_qparam"] == 8 and info["ops"] == {"f8": 8} and info["kept"] == 1
    assert llm.quantization["scheme"] == "Wf8A16KV16"
    base = next(k for k in llm._build.params if mod.removeprefix("model.") in k and k.endswith(".q"))[:-2]
    q, sc = unpack_fp8(llm._build.params[base + ".q"], llm._build.params[base + ".scales"],
                       qp[f"{mod}.qweight"].shape[0])
    assert torch.equal(q.view(torch.uint8), qp[f"{mod}.qweight"].view(torch.uint8))
    assert torch.equal(sc, qp[f"{mod}.weight_scale"][:, 0])
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2], [9, 8, 7]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    llm.shutdown()


def _scales(llm):
    return [t.tolist() for t in llm.kv_cache_scales]


def test_kv8_directory_loads_int8_with_the_file_scales(tiny_models, tmp_path):
    """``--scheme kv8``: the model's files + ``kv_cache_scales.json``; ``LLM(OUT)`` starts an int8 cache with
    exactly those scales (no calibration at start-up) and generates."""
    out = tmp_path / "kv8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "kv8", "--kv-calib-tokens", "600"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["scheme"] == "kv8" and recipe["kv_cache"]["calibration"]["num_tokens"] == 600
    assert not (out / "qformat.yaml").exists() and (out / "config.json").is_file()
    data = json.loads((out / "kv_cache_scales.json").read_text())
    assert data["kv_cache_dtype"] == "int8" and data["recipe"]["margin"] == 1.05
    k, v = torch.tensor(data["k_scale"]), torch.tensor(data["v_scale"])
    assert k.shape == v.shape == (2, 2) and bool((k > 0).all() and (v > 0).all())

    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    assert llm.kv_cache_dtype == "int8" and llm.engine.runner.kv.dtype == torch.int8
    assert _scales(llm) == [data["k_scale"], data["v_scale"]]
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2], [9, 8, 7]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    llm.shutdown()


def test_weight_scheme_plus_kv8_quantizes_both(tiny_models, tmp_path):
    """``w8a16+kv8``: the qformat/qparam of w8a16, and KV scales calibrated on the quantized model."""
    out = tmp_path / "w8kv8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "w8a16+kv8"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["scheme"] == "w8a16+kv8" and recipe["config"] == "W8A16"
    assert recipe["kv_cache"]["calibration"]["num_tokens"] == 1024
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["ops"] == {"w8": 8}
    assert llm.kv_cache_dtype == "int8" and llm.engine.runner.kv.dtype == torch.int8
    data = json.loads((out / "kv_cache_scales.json").read_text())
    assert _scales(llm) == [data["k_scale"], data["v_scale"]]
    llm.shutdown()


@pytest.mark.parametrize("scheme", ["w8a16+kv8", "kv8"])
def test_a_failed_quantization_leaves_no_model_directory(tiny_models, tmp_path, monkeypatch, scheme):
    """OUT is written under a temporary sibling and renamed at the end: a failure in the last step (the KV
    scales' calibration) leaves neither OUT (which LLM(OUT) would load half-written) nor the sibling, and
    an empty OUT given by the user stays as it was."""
    import fxcompiler.quantize_model as qm

    def fail(*args, **kwargs):
        raise RuntimeError("calibration failed")

    monkeypatch.setattr(qm, "_write_kv_scales", fail)
    out = tmp_path / "q"
    with pytest.raises(RuntimeError, match="calibration failed"):
        qm.quantize_model(str(tiny_models["llama"]), out, scheme, cache_dir=None, progress=False)
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    with pytest.raises(RuntimeError, match="calibration failed"):
        qm.quantize_model(str(tiny_models["llama"]), out, scheme, cache_dir=None, progress=False)
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_wf8af8_directory_loads_with_fp8_activations_and_the_file_codes(tiny_models, tmp_path):
    """``--scheme wf8af8`` (once NotImplementedError): the fp8 weights of ``--scheme fp8`` and a qformat saying
    ``--act_dtype fp8 --kv_dtype fp32``; ``LLM(OUT)`` runs every matmul but lm_head as ``fxc::linear_f8f8`` on
    exactly the file's codes and scales."""
    from safetensors.torch import load_file

    from fxcompiler.ops.quant_linear import unpack_fp8

    out = tmp_path / "f8f8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "wf8af8"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["config"] == "Wf8Af8" and recipe["module_scheme"]["weight"] == "fp8" and "kv_cache" not in recipe
    assert (out / "qformat.yaml").read_text().startswith("--weight_dtype fp8 --act_dtype fp8 --kv_dtype fp32")
    assert not (out / "kv_cache_scales.json").exists()
    qp = load_file(str(out / "qparam.safetensors"))
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["from_qparam"] == 8 and info["ops"] == {"f8f8": 8} and info["kept"] == 1
    assert llm.quantization["scheme"] == "Wf8Af8KV32" and llm.kv_cache_dtype == "auto"
    mod = "model.layers.0.self_attn.o_proj"
    base = next(k for k in llm._build.params if mod.removeprefix("model.") in k and k.endswith(".q"))[:-2]
    q, sc = unpack_fp8(llm._build.params[base + ".q"], llm._build.params[base + ".scales"],
                       qp[f"{mod}.qweight"].shape[0])
    assert torch.equal(q.view(torch.uint8), qp[f"{mod}.qweight"].view(torch.uint8))
    assert torch.equal(sc, qp[f"{mod}.weight_scale"][:, 0])
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2], [9, 8, 7]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    llm.shutdown()


def test_gptq_wf8af8_plus_kvf8_with_percentile_scales(tiny_models, tmp_path):
    """``wf8af8+kvf8 --algorithm gptq --w-observer mse --gptq-refit --kv-observer percentile``: GPTQ fp8 weights,
    fp8 activations and an fp8 KV cache whose scales (a percentile of |x|) ``LLM(OUT)`` starts with; the
    recipe records both."""
    out = tmp_path / "f8kv"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "wf8af8+kvf8", "--algorithm", "gptq",
                 "--w-observer", "mse", "--gptq-refit", "--num-samples", "4", "--seq-len", "32",
                 "--kv-observer", "percentile", "--kv-percentile", "99.9", "--kv-calib-tokens", "300"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["config"] == "Wf8Af8" and recipe["gptq"]["observer"] == "mse" and recipe["gptq"]["refit"]
    kv = recipe["kv_cache"]
    assert kv["dtype"] == "fp8" and kv["observer"] == "percentile" and kv["percentile"] == 99.9
    assert kv["qmax"] == 448.0 and kv["calibration"]["num_tokens"] == 300
    data = json.loads((out / "kv_cache_scales.json").read_text())
    assert data["kv_cache_dtype"] == "fp8" and data["recipe"] == kv
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["ops"] == {"f8f8": 8}
    assert llm.kv_cache_dtype == "fp8" and llm.engine.runner.kv.dtype == torch.float8_e4m3fn
    assert _scales(llm) == [data["k_scale"], data["v_scale"]]
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        prompt_token_ids=[[5, 17, 33, 2]])
    assert len(outs[0].outputs[0].token_ids) == 8
    llm.shutdown()


def test_kvf8_directory_loads_an_fp8_cache(tiny_models, tmp_path):
    """``--scheme kvf8``: the model's files + fp8 scales (absmax · 1.05 / 448); LLM(OUT) runs an e4m3 cache."""
    out = tmp_path / "kvf8"
    assert main(["quantize", str(tiny_models["llama"]), str(out), "--scheme", "kvf8", "--kv-calib-tokens", "200"]) == 0
    recipe = json.loads((out / "quantization_recipe.json").read_text())
    assert recipe["scheme"] == "kvf8" and recipe["config"] == "KVf8" and recipe["kv_cache"]["observer"] == "minmax"
    assert not (out / "qformat.yaml").exists()
    data = json.loads((out / "kv_cache_scales.json").read_text())
    assert data["kv_cache_dtype"] == "fp8" and data["recipe"]["qmax"] == 448.0
    llm = LLM(str(out), max_seq_len_to_capture=64, cache_dir=None)
    assert llm.kv_cache_dtype == "fp8" and llm.engine.runner.kv.dtype == torch.float8_e4m3fn
    assert _scales(llm) == [data["k_scale"], data["v_scale"]]
    llm.shutdown()


def test_kv_observers_minmax_and_percentile(tiny_models, monkeypatch):
    """quantize_kv_cache's observers on one float-cache engine: percentile 100 is the absmax (minmax) exactly;
    a lower percentile reads exactly the written slots (num_tokens · head_dim values per layer and KV head,
    the unwritten slots of the last block excluded: its smallest-rank value is no zero) and gives smaller
    scales; fp8 scales are int8's · 127 / 448."""
    import fxcompiler.kv_cache_quant as kq

    llm = LLM(str(tiny_models["llama"]), max_seq_len_to_capture=64, cache_dir=None)
    text = kq.calibration_text(5000)
    k8, v8 = kq.quantize_kv_cache(llm, text, num_tokens=100)
    kf, vf = kq.quantize_kv_cache(llm, text, num_tokens=100, kv_dtype="fp8")
    torch.testing.assert_close(kf * 448, k8 * 127, rtol=1e-6, atol=0)
    k100, v100 = kq.quantize_kv_cache(llm, text, num_tokens=100, observer="percentile", percentile=100)
    assert torch.equal(k100, k8) and torch.equal(v100, v8)
    seen = []
    real = kq._percentile

    def spy(chunks, q):
        seen.append(sum(c.shape[1] for c in chunks))
        return real(chunks, q)

    monkeypatch.setattr(kq, "_percentile", spy)
    head_dim = llm.engine.runner.kv.k[0].shape[3]
    k99, v99 = kq.quantize_kv_cache(llm, text, num_tokens=100, observer="percentile", percentile=99)
    assert set(seen) == {100 * head_dim}
    assert bool((k99 <= k8).all() and (v99 <= v8).all()) and bool((k99 < k8).any())
    kmin, _ = kq.quantize_kv_cache(llm, text, num_tokens=100, observer="percentile", percentile=1e-6)
    assert bool((kmin > 1e-8).all())  # no empty (zero) slot among the values
    with pytest.raises(ValueError, match="--kv-observer must be one of"):
        kq.quantize_kv_cache(llm, text, observer="absmax")
    llm.shutdown()


def test_percentile_is_the_nearest_rank():
    from fxcompiler.kv_cache_quant import _percentile

    x = torch.arange(1.0, 10001.0).flip(0).view(1, -1)
    assert _percentile([x[:, :3000], x[:, 3000:]], 99.99).item() == 9999.0
    assert _percentile([x], 100).item() == 10000.0 and _percentile([x], 50).item() == 5000.0
    assert _percentile([x], 1e-9).item() == 1.0
