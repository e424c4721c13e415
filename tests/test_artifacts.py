"""Artifacts: build once, load anywhere (round trips in fresh processes, every loader keyword,
and tampered directories that must fail with an error naming the file)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxcompiler import LLM, ManualBucketConfig, SamplingParams
from fxcompiler.artifacts import ArtifactError
from fxcompiler.pass_manager import DEFAULT_PASSES

from .conftest import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 40]]
SP = SamplingParams(max_tokens=10, temperature=0)
BUCKETS = ManualBucketConfig([(1, 32), (4, 32)], [(1, 64), (4, 64)])

LOAD_AND_GENERATE = """
import json, sys
from fxcompiler import LLM, SamplingParams
prompts = json.loads(sys.argv[1])
for path in sys.argv[3:]:
    llm = LLM.load_artifact(path)
    outs = llm.generate(None, SamplingParams(max_tokens=int(sys.argv[2]), temperature=0), prompt_token_ids=prompts)
    print("RESULT", json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "info": llm.build_info}))
"""


def _tokens(llm, prompts=PROMPTS, sp=SP):
    return [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]


def load_in_fresh_process(paths, prompts, max_tokens) -> list[dict]:
    """Load each artifact in one new Python process and generate greedily; results in order."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, json.dumps(prompts), str(max_tokens),
                           *map(str, paths)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("art") / "llama", "llama")


@pytest.fixture(scope="module")
def built(llama, tmp_path_factory):
    """A blockwise tiny-Llama artifact and the greedy tokens of the LLM that wrote it."""
    path = tmp_path_factory.mktemp("built") / "artifact"
    llm = LLM(str(llama), bucket_config=BUCKETS, max_seq_len_to_capture=64, cache_dir=None,
              artifacts_export_path=path)
    return path, _tokens(llm)


VARIANTS = {"blockwise": {}, "one-supertask": {"use_blockwise_compile": False},
            "embedded-constants": {"embed_all_constants_into_graph": True},
            "bf16": {"auto_bfloat16_cast": True, "dtype": "float32"},
            "dfg": {"comp_supertask_kind": "dfg"}}


def test_round_trip_in_a_fresh_process(llama, tmp_path):
    paths, expected = [], []
    for name, kw in VARIANTS.items():
        path = tmp_path / name
        llm = LLM(str(llama), bucket_config=BUCKETS, max_seq_len_to_capture=64, cache_dir=None,
                  artifacts_export_path=path, **kw)
        expected.append(_tokens(llm))
        paths.append(path)
        manifest = json.loads((path / "artifact.json").read_text())
        assert set(manifest["files"]) >= {"model/config.json", "params/params.safetensors"}
        assert len(manifest["pipelines"]) == len(llm.pipelines) == 4
        assert set(manifest["graphs"]) == {b.id for p in llm.pipelines for b in p.blobs.values()}
        if kw.get("embed_all_constants_into_graph"):
            assert any("constants" in g for g in manifest["graphs"].values())
        for f in path.rglob("*.json"):  # relocatable: no absolute paths of the build machine inside
            text = f.read_text()
            assert str(tmp_path) not in text and str(llama) not in text, f
    results = load_in_fresh_process(paths, PROMPTS, SP.max_tokens)
    assert [r["tokens"] for r in results] == expected
    names = list(VARIANTS)
    assert expected[names.index("dfg")] == expected[names.index("blockwise")]  # same weights, ONNX blobs
    dfg = json.loads((tmp_path / "dfg" / "artifact.json").read_text())
    assert dfg["supertask_kind"] == ["dfg"] and all(g["code"].endswith(".onnx") for g in dfg["graphs"].values())
    assert all(r["info"]["compile_cache"] == "artifact" for r in results)


def test_loaders_and_their_keywords(built):
    path, expected = built
    llm = LLM.load_artifact(path, paged_attention_num_blocks=40, seed=3)
    assert llm.kv_cache_plan.num_blocks == 40
    assert _tokens(llm) == expected
    llm = LLM.from_artifacts(path, paged_attention_num_blocks=30, backend="TORCH_PIPELINE_RUNNER")
    assert llm.kv_cache_plan.num_blocks == 30 and _tokens(llm) == expected
    with pytest.warns(DeprecationWarning, match="load_artifact"):
        llm = LLM.load_artifacts(path)
    assert _tokens(llm) == expected
    subset = LLM.load_artifact(path, bucket_config=ManualBucketConfig([(4, 32)], [(4, 64)]))
    assert sorted(p.bucket.batch_size for p in subset.pipelines) == [4, 4]
    assert _tokens(subset) == expected
    bare = LLM.load_artifact(path, skip_engine=True)
    assert bare.engine is None and len(bare.pipelines) == 4


def test_bad_loader_arguments(built, tmp_path):
    path, _ = built
    with pytest.raises(ArtifactError, match=r"not built with.*\('decode', 8, 64\).*built prefill buckets"):
        LLM.load_artifact(path, bucket_config=ManualBucketConfig([(1, 32)], [(8, 64)]))
    with pytest.raises(ValueError, match="revision"):
        LLM.load_artifact(path, revision="main")
    with pytest.raises(ValueError, match="carries no draft"):  # tests/test_speculative_artifacts.py
        LLM.load_artifact(path, num_speculative_tokens=2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM.load_artifact(path, no_such_option=1)
    with pytest.raises(TypeError, match="scheduler_config"):
        LLM.load_artifact(path, scheduler_config={"max_processing_samples": 4})
    with pytest.raises(ArtifactError, match="missing manifest"):
        LLM.load_artifact(tmp_path)
    with pytest.raises(ArtifactError, match="not a directory"):
        LLM.load_artifact(tmp_path / "nowhere")


def test_export_refuses_a_non_empty_directory(llama, tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="artifacts_export_path"):
        LLM(str(llama), bucket_config=BUCKETS, max_seq_len_to_capture=64, cache_dir=None, skip_engine=True,
            artifacts_export_path=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_manifest(path: Path, fn) -> None:
    m = json.loads((path / "artifact.json").read_text())
    fn(m)
    (path / "artifact.json").write_text(json.dumps(m))


def test_tampered_artifacts_fail_naming_the_file(built, tmp_path, caplog):
    src, expected = built
    a = _copy(src, tmp_path / "missing")
    graph = next((a / "graphs").glob("*.py"))
    graph.unlink()
    with pytest.raises(ArtifactError, match=rf"{graph.name}: missing"):
        LLM.load_artifact(a)

    b = _copy(src, tmp_path / "truncated")
    params = b / "params" / "params.safetensors"
    params.write_bytes(params.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match=r"params.safetensors: size .* \(truncated or replaced\)"):
        LLM.load_artifact(b)

    c = _copy(src, tmp_path / "modified")
    graph = next((c / "graphs").glob("*.py"))
    text = graph.read_text()
    graph.write_text(text.replace("forward", "forwarx", 1))
    with pytest.raises(ArtifactError, match=rf"{graph.name}: sha256 differs"):
        LLM.load_artifact(c)

    d = _copy(src, tmp_path / "newer")
    _edit_manifest(d, lambda m: m.update(schema_version="2.0"))
    with pytest.raises(ArtifactError, match="schema 2.0 is newer"):
        LLM.load_artifact(d)
    _edit_manifest(d, lambda m: m.update(schema_version="1.99"))
    with pytest.raises(ArtifactError, match="schema 1.99 is newer"):
        LLM.load_artifact(d)

    e = _copy(src, tmp_path / "othertorch")
    _edit_manifest(e, lambda m: m["versions"].update(torch="1.0.0"))
    with caplog.at_level(logging.WARNING, logger="fxcompiler.artifacts"):
        llm = LLM.load_artifact(e)
    assert "built with torch 1.0.0" in caplog.text
    assert _tokens(llm) == expected

    f = _copy(src, tmp_path / "badparams")
    params = f / "params" / "params.safetensors"
    raw = bytearray(params.read_bytes())
    raw[8:12] = b"XXXX"  # header damaged, size unchanged; sha256 fixed up to reach the reader
    params.write_bytes(bytes(raw))
    import hashlib

    _edit_manifest(f, lambda m: m["files"]["params/params.safetensors"].update(
        sha256=hashlib.sha256(bytes(raw)).hexdigest()))
    with pytest.raises(ArtifactError, match="params.safetensors: cannot read parameters"):
        LLM.load_artifact(f)


def test_cli_build_and_inspect(llama, tmp_path):
    out = tmp_path / "artifact"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fxcompiler.cli"]
    spec = {"disable": ["cse"], "insert": [{"pass": "examples.count_matmul_flops:count_matmul_flops",
                                              "after": "fuse_projections"}]}
    (tmp_path / "passes.json").write_text(json.dumps(spec))
    proc = subprocess.run(cmd + ["build", str(llama), str(out), "-pb", "1,32", "-db", "2,64",
                                 "--max-seq-len-to-capture", "64", "--num-blocks-per-supertask", "2",
                                 "--passes-json", f"@{tmp_path / 'passes.json'}"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipelines: 2" in proc.stdout
    manifest = json.loads((out / "artifact.json").read_text())  # the artifact records the passes override
    assert manifest["settings"]["passes_override"] == spec
    assert "cse" not in [p["pass"] for p in manifest["passes"]] and len(manifest["passes"]) == len(DEFAULT_PASSES)
    assert next(p for p in manifest["passes"] if p["pass"] == "count_matmul_flops")["per_layer"]["layer0"] > 0
    dot = tmp_path / "decode.dot"
    proc = subprocess.run(cmd + ["inspect", str(out), "--verify", "--dot", str(dot)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "graph blobs:" in proc.stdout and "2 pipelines" in proc.stdout and "(2 block(s) per supertask)" in proc.stdout
    text = dot.read_text()
    assert text.startswith("digraph") and text.count("->") >= 3 and "fillcolor=lightblue" in text  # input→emb→block→head→output
    proc = subprocess.run(cmd + ["build", str(llama), str(tmp_path / "x"), "-pb", "1,32"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2 and "-db/--decode-buckets" in proc.stderr
    proc = subprocess.run(cmd + ["inspect", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert proc.returncode == 2 and "missing manifest" in proc.stderr


@pytest.mark.slow
def test_smollm2_artifact_round_trip(tmp_path):
    """The embedded SmolLM2 (fp32): an artifact loaded in a fresh process generates the same greedy tokens."""
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    path = tmp_path / "smollm2"
    llm = LLM(DEFAULT_MODEL_ID, bucket_config=ManualBucketConfig([(1, 64), (4, 64)], [(4, 128)]),
              max_seq_len_to_capture=128, artifacts_export_path=path)
    prompts = [llm.tokenizer(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):",
                                                       "Paged attention keeps the KV cache in")]
    sp = SamplingParams(max_tokens=24, temperature=0)
    expected = _tokens(llm, prompts, sp)
    (result,) = load_in_fresh_process([path], prompts, sp.max_tokens)
    assert result["tokens"] == expected
    assert result["info"]["compile_cache"] == "artifact"
