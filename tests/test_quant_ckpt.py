"""Pre-quantised HF checkpoints (fxcompiler/quant_ckpt.py): compressed-tensors pack-quantized, GPTQ and AWQ.

The checkpoints are written by this file's own reference packers from known integer weights (bit by bit with
Python ints, not the formats' packing code). Checked: the unpacked codes/scales/mins dequantise bit for bit to
the exact value ``s·(q − z)``; ``LLM(dir)`` and ``LLM(model, quant_ckpt_file_path=...)`` compute with exactly
those codes and give the dequantised fp32 model's greedy tokens; bad input names the tensor or field."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from fxcompiler.quant_ckpt import AWQ_ORDER, QuantCheckpointError, unpack_checkpoint

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[5, 17, 33, 2], [9, 8, 7]]


# -- reference packers (independent of the formats' code: one Python int per 32-bit word) ---------------------
def _word(fields, bits: int) -> int:
    v = 0
    for i, f in enumerate(fields):
        assert 0 <= f < (1 << bits)
        v |= int(f) << (bits * i)
    return v - (1 << 32) if v >= 1 << 31 else v  # as a signed int32


def pack_rows(u: torch.Tensor, bits: int) -> torch.Tensor:
    """``u [R, C]`` unsigned → int32 ``[R, ceil(C/f)]``: word j of a row holds columns j·f .. j·f+f−1."""
    f = 32 // bits
    rows = []
    for r in u.tolist():
        r = r + [0] * (-len(r) % f)
        rows.append([_word(r[j:j + f], bits) for j in range(0, len(r), f)])
    return torch.tensor(rows, dtype=torch.int32)


def pack_cols(u: torch.Tensor, bits: int) -> torch.Tensor:
    """``u [R, C]`` unsigned → int32 ``[ceil(R/f), C]``: word i of a column holds rows i·f .. i·f+f−1."""
    return pack_rows(u.t().contiguous(), bits).t().contiguous()


def pack_awq(u: torch.Tensor) -> torch.Tensor:
    """``u [R, C]`` 4-bit → int32 ``[R, C/8]``, nibble i of word c = column 8c + AWQ_ORDER[i]."""
    rows = []
    for r in u.tolist():
        rows.append([_word([r[8 * c + AWQ_ORDER[i]] for i in range(8)], 4) for c in range(len(r) // 8)])
    return torch.tensor(rows, dtype=torch.int32)


# -- tiny checkpoints from known integer weights ----------------------------------------------------------------
def _known(n: int, k: int, bits: int, group: int, sym: bool, gen, scale_dtype=torch.float16):
    """Integer codes ``q`` [N, K] (unsigned, [0, 2^bits)), zeros ``z`` [N, G] (unsigned domain) and fp16 scales
    [N, G]; the exact value is ``s·(q − z)``."""
    g = 1 if group == -1 else -(-k // group)
    top = 1 << bits
    q = torch.randint(0, top, (n, k), generator=gen)
    z = torch.full((n, g), top // 2) if sym else torch.randint(0, top, (n, g), generator=gen)
    s = (torch.rand(n, g, generator=gen) * 0.04 + 0.01).to(scale_dtype)
    idx = torch.arange(k) // (k if group == -1 else group)
    exact = ((q - z[:, idx]).double() * s.double()[:, idx]).float()
    return q, z, s, exact


def _write(path, base, qc: dict, tensors: dict):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _float_tensors(base) -> dict:
    from safetensors.torch import load_file

    return load_file(str(base / "model.safetensors"))


def make_checkpoint(kind: str, base, path, seed: int = 0, **kw):
    """A tiny llama checkpoint in format ``kind``; returns (dir, {module: exact fp32 weight}, qc)."""
    gen = torch.Generator().manual_seed(seed)
    fl = _float_tensors(base)
    tensors = {k: v for k, v in fl.items() if not any(k.endswith(f"{lin}.weight") for lin in LINEARS)}
    exact: dict[str, torch.Tensor] = {}
    if kind == "ct":  # compressed-tensors: attention int4 (group or channel, sym or asym), mlp int8 sym
        attn = kw.get("attn", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32})
        mlp = kw.get("mlp", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"})
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["re:.*self_attn.*"], "weights": attn},
                                "group_1": {"targets": ["re:.*mlp.*"], "weights": mlp}}}
        for name, w in fl.items():
            lin = next((x for x in LINEARS if name.endswith(f"{x}.weight")), None)
            if lin is None:
                continue
            m = name.removesuffix(".weight")
            args = attn if "self_attn" in lin else mlp
            bits, sym = args["num_bits"], args["symmetric"]
            group = args.get("group_size", -1) if args["strategy"] == "group" else -1
            n, k = w.shape
            q, z, s, exact[m] = _known(n, k, bits, group, sym, gen, torch.bfloat16 if bits == 8 else torch.float16)
            # the format stores signed values plus 2^(bits-1): our unsigned q and z are those stored fields, and
            # s·(q − z) is the same in either domain
            tensors[f"{m}.weight_packed"] = pack_rows(q, bits)
            tensors[f"{m}.weight_scale"] = s
            tensors[f"{m}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                tensors[f"{m}.weight_zero_point"] = pack_cols(z, bits)  # packed along N
    else:  # gptq (v1 / v2) or awq, 4-bit group 32
        group, sym = kw.get("group", 32), kw.get("sym", False)
        if kind == "awq":
            qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        else:
            qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
                  "checkpoint_format": "gptq_v2" if kind == "gptq_v2" else "gptq"}
        for name, w in fl.items():
            lin = next((x for x in LINEARS if name.endswith(f"{x}.weight")), None)
            if lin is None:
                continue
            m = name.removesuffix(".weight")
            n, k = w.shape
            q, z, s, exact[m] = _known(n, k, 4, group, sym, gen)
            if kind == "gptq":
                z = z.clamp(min=1)  # v1 stores z − 1 (a zero of 0 is not representable)
                exact[m] = ((q - z[:, torch.arange(k) // group]).double() * s.double()[:, torch.arange(k) // group]
                            ).float()
                stored_z = z - 1
            else:
                stored_z = z
            if kind == "awq":
                tensors[f"{m}.qweight"] = pack_awq(q.t().contiguous())      # [K, N/8]
                tensors[f"{m}.qzeros"] = pack_awq(stored_z.t().contiguous())  # [G, N/8]
            else:
                tensors[f"{m}.qweight"] = pack_cols(q.t().contiguous(), 4)    # [K/8, N]
                tensors[f"{m}.qzeros"] = pack_rows(stored_z.t().contiguous(), 4)  # [G, N/8]
                tensors[f"{m}.g_idx"] = (torch.arange(k) // group).to(torch.int32)
            tensors[f"{m}.scales"] = s.t().contiguous()  # [G, N]
    return _write(path, base, qc, tensors), exact, qc


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# -- (a) unpacking is exact, every variant ------------------------------------------------------------------------
VARIANTS = [
    ("ct", {}),
    ("ct", {"attn": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}),
    ("ct", {"attn": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"},
            "mlp": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}),
    ("ct", {"mlp": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}),
    ("gptq", {}), ("gptq", {"sym": True}), ("gptq", {"group": 64}), ("gptq_v2", {}), ("awq", {}),
    ("awq", {"group": 64}),
]


@pytest.mark.parametrize("kind, kw", VARIANTS)
def test_unpacked_values_dequantise_exactly(tiny_models, tmp_path, kind, kw):
    path, exact, qc = make_checkpoint(kind, tiny_models["llama"], tmp_path / "ckpt", **kw)
    linears, rest = unpack_checkpoint(_tensors(path), qc)
    assert sorted(linears) == sorted(exact) and len(linears) == 14
    for m, lin in linears.items():
        assert lin.dequantize().shape == exact[m].shape
        assert torch.equal(lin.dequantize(), exact[m]), m
        if lin.bits == 4:
            assert lin.codes.dtype == torch.uint8 and int(lin.codes.max()) <= 15
    assert "lm_head.weight" in rest and "model.embed_tokens.weight" in rest
    assert not any(k.endswith((".qweight", ".qzeros", ".weight_packed", ".g_idx")) for k in rest)


# -- (b) LLM(dir) and quant_ckpt_file_path compute with exactly those codes -----------------------------------------
def _greedy_reference(base, exact: dict, steps: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        mods = dict(model.named_modules())
        for m, w in exact.items():
            mods[m].weight.copy_(w)
        outs = []
        for p in PROMPTS:
            ids = torch.tensor([p])
            for _ in range(steps):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def qcache(tmp_path_factory):
    return tmp_path_factory.mktemp("qckpt-cache")


@pytest.mark.parametrize("kind", ["ct", "gptq", "awq"])
def test_llm_loads_checkpoint_and_matches_dequantised_model(tiny_models, tmp_path, qcache, kind):
    from fxcompiler import LLM, SamplingParams
    from fxcompiler.ops.quant_linear import unpack_int4

    base = tiny_models["llama"]
    path, exact, _ = make_checkpoint(kind, base, tmp_path / kind, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    if kind == "gptq":  # furiosa's argument: the model gives config/tokenizer, the file the quantized weights
        float_dir = tmp_path / "float"
        shutil.copytree(base, float_dir)
        ckpt_file = tmp_path / "bare" / "gptq.safetensors"
        ckpt_file.parent.mkdir()
        shutil.copy(path / "model.safetensors", ckpt_file)
        (ckpt_file.parent / "config.json").write_text((path / "config.json").read_text())
        llm = LLM(str(float_dir), quant_ckpt_file_path=str(ckpt_file), max_seq_len_to_capture=64, cache_dir=qcache)
    else:
        llm = LLM(str(path), max_seq_len_to_capture=64, cache_dir=qcache)
    info = next(h for h in llm.pass_history if h["pass"] == "quantize")
    assert info["from_qparam"] == 8 and info["kept"] == 1  # 2 x (qkv, o, gate_up, down); lm_head float
    assert info["ops"] == ({"w4": 4, "w8": 4} if kind == "ct" else {"w4": 8})
    # the engine's packed attention output projection dequantises to the exact checkpoint values
    mod = "model.layers.1.self_attn.o_proj"
    base_name = next(k for k in llm._build.params if "layers.1.self_attn.o_proj" in k and k.endswith(".q"))[:-2]
    p = llm._build.params
    q, s, m = unpack_int4(p[base_name + ".q"], p[base_name + ".scales"], p[base_name + ".mins"], 64)
    from fxcompiler.gptq import dequantize_codes

    assert torch.equal(dequantize_codes(q, s, m, 32), exact[mod])
    got = [list(o.outputs[0].token_ids) for o in llm.generate(None, sp, prompt_token_ids=PROMPTS)]
    llm.shutdown()
    assert got == _greedy_reference(base, exact, 6)


# -- bad input names the culprit -----------------------------------------------------------------------------------
def _gptq_tensors(tiny_models, tmp_path, **kw):
    path, _, qc = make_checkpoint("gptq", tiny_models["llama"], tmp_path / "c", **kw)
    return _tensors(path), qc


def test_missing_qzeros_names_the_tensor(tiny_models, tmp_path):
    t, qc = _gptq_tensors(tiny_models, tmp_path)
    del t["model.layers.0.self_attn.k_proj.qzeros"]
    with pytest.raises(QuantCheckpointError, match=r"'model.layers.0.self_attn.k_proj.qzeros' is missing"):
        unpack_checkpoint(t, qc)


@pytest.mark.parametrize("change, exc, match", [
    ({"bits": 5}, QuantCheckpointError, r"quantization_config.bits=5: not a bit width"),
    ({"bits": 8}, NotImplementedError, r"quantization_config.bits=8: only 4-bit"),
    ({"quant_method": "bitsandbytes"}, NotImplementedError, r"quantization_config.quant_method='bitsandbytes'"),
    ({"checkpoint_format": "marlin"}, NotImplementedError, r"quantization_config.checkpoint_format='marlin'"),
    ({"group_size": 33}, QuantCheckpointError, r"quantization_config.group_size=33"),
])
def test_bad_gptq_config_fields(tiny_models, tmp_path, change, exc, match):
    t, qc = _gptq_tensors(tiny_models, tmp_path)
    with pytest.raises(exc, match=match):
        unpack_checkpoint(t, {**qc, **change})


def test_gptq_act_order_g_idx_is_refused(tiny_models, tmp_path):
    t, qc = _gptq_tensors(tiny_models, tmp_path)
    t["model.layers.1.mlp.up_proj.g_idx"] = torch.randperm(64).to(torch.int32) // 32
    with pytest.raises(NotImplementedError, match=r"'model.layers.1.mlp.up_proj.g_idx' is an act-order g_idx"):
        unpack_checkpoint(t, qc)


def test_gptq_misshapen_and_orphan_tensors(tiny_models, tmp_path):
    t, qc = _gptq_tensors(tiny_models, tmp_path)
    t["model.layers.0.mlp.down_proj.qzeros"] = t["model.layers.0.mlp.down_proj.qzeros"][:1]
    with pytest.raises(QuantCheckpointError, match=r"model.layers.0.mlp.down_proj.qzeros is \[1, 8\], expected \[4, 8\]"):
        unpack_checkpoint(t, qc)
    t, qc = _gptq_tensors(tiny_models, tmp_path / "2")
    t["model.layers.0.mlp.nope.scales"] = torch.ones(2, 64, dtype=torch.float16)
    with pytest.raises(QuantCheckpointError, match=r"'model.layers.0.mlp.nope.scales' has no model.layers.0.mlp.nope.qweight"):
        unpack_checkpoint(t, qc)
    t, qc = _gptq_tensors(tiny_models, tmp_path / "3")
    t["model.layers.0.mlp.up_proj.scales"] = t["model.layers.0.mlp.up_proj.scales"].to(torch.int32)
    with pytest.raises(QuantCheckpointError, match=r"'model.layers.0.mlp.up_proj.scales' is torch.int32"):
        unpack_checkpoint(t, qc)


@pytest.mark.parametrize("qc_change, match, exc", [
    ({"format": "marlin-24"}, r"quantization_config.format='marlin-24'", NotImplementedError),
    ({"format": "float-quantized"}, r"quantization_config.format='float-quantized'.*fp8", NotImplementedError),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": False,
                                                                "strategy": "channel"}}}},
     r"config_groups.g.weights.symmetric=false with num_bits=8", NotImplementedError),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 6, "type": "int", "strategy": "channel"}}}},
     r"config_groups.g.weights.num_bits=6: not a bit width", QuantCheckpointError),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "input_activations": {"num_bits": 8}}}},
     r"config_groups.g.input_activations.*W8A8", NotImplementedError),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                "strategy": "channel"}}}},
     r"config_groups.g.weights.type='float'", NotImplementedError),
])
def test_bad_compressed_tensors_config(tiny_models, tmp_path, qc_change, match, exc):
    path, _, qc = make_checkpoint("ct", tiny_models["llama"], tmp_path / "c")
    with pytest.raises(exc, match=match):
        unpack_checkpoint(_tensors(path), {**qc, **qc_change})


def test_compressed_tensors_missing_zero_point_and_awq_version(tiny_models, tmp_path):
    path, _, qc = make_checkpoint("ct", tiny_models["llama"], tmp_path / "c")
    t = _tensors(path)
    del t["model.layers.1.self_attn.v_proj.weight_zero_point"]
    with pytest.raises(QuantCheckpointError, match=r"'model.layers.1.self_attn.v_proj.weight_zero_point' is missing"):
        unpack_checkpoint(t, qc)
    path, _, qc = make_checkpoint("awq", tiny_models["llama"], tmp_path / "a")
    with pytest.raises(NotImplementedError, match=r"quantization_config.version='gemv'"):
        unpack_checkpoint(_tensors(path), {**qc, "version": "gemv"})


def test_llm_reports_a_bad_checkpoint_before_building(tiny_models, tmp_path):
    from fxcompiler import LLM

    path, _, qc = make_checkpoint("awq", tiny_models["llama"], tmp_path / "a")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match=r"quantization_config.bits=3: only 4-bit"):
        LLM(str(path), max_seq_len_to_capture=64, cache_dir=None)
    with pytest.raises(ValueError, match=r"quant_ckpt_file_path='.*nope' does not exist"):
        LLM(str(tiny_models["llama"]), quant_ckpt_file_path=str(tmp_path / "nope"))


def test_conversion_cache_is_verified_and_rebuilt_when_damaged(tiny_models, tmp_path, caplog):
    from fxcompiler.quant_ckpt import convert_quant_checkpoint

    path, _, _ = make_checkpoint("gptq", tiny_models["llama"], tmp_path / "ckpt")
    cache = tmp_path / "cache"
    first = convert_quant_checkpoint(path, cache_dir=cache)
    good = (first / "qparam.safetensors").read_bytes()
    assert convert_quant_checkpoint(path, cache_dir=cache) == first  # a verified hit
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF  # a flipped byte inside the tensor data: still parses, wrong codes
    (first / "qparam.safetensors").write_bytes(bytes(damaged))
    with caplog.at_level("WARNING", logger="fxcompiler"):
        again = convert_quant_checkpoint(path, cache_dir=cache)
    assert again == first and (again / "qparam.safetensors").read_bytes() == good
    assert any("damaged" in r.getMessage() for r in caplog.records)
