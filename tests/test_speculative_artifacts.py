"""Artifacts and speculative decoding on tiny float64 models: an artifact of a target with a draft
model carries the draft under ``speculative_model/`` and loads back speculating (greedy output
identical to plain decoding, the saving LLM's proposals reproduced); the loaders' opt-outs and
overrides (an ``LLM``, an artifact path, ``"[ngram]"``); the n-gram proposer recorded without
files; a tampered draft and a draft path escaping the artifact refused before any code runs (a
sentinel file is never created), also under an allow-list that names only the target; and the
argument errors (different vocabulary, parallel drafts)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fxcompiler import LLM, ManualBucketConfig, SamplingParams, cli
from fxcompiler.artifacts import ArtifactError, manifest_sha256
from fxcompiler.integrity import sha256_file
from tests._artifact_tampering import payload as _payload, read_manifest as _manifest, write_manifest as _save
from tests.conftest import save_tiny_model
from tests.test_speculative import GREEDY, K, PROMPTS, all_free, make_llm, run_checked

SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BUCKETS = ManualBucketConfig([(1, 128)], [(1, 128), (8, 128)])
DRAFT = "speculative_model"


def _tokens(llm, sp=GREEDY) -> list[list[int]]:
    """Greedy tokens of the 8 prompts in one batch (speculating: block invariants checked every step)."""
    if llm.engine.speculator is None:
        return [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=PROMPTS)]
    tokens = [o.outputs[0].token_ids for o in run_checked(llm, PROMPTS, sp)]
    all_free(llm)
    return tokens


def _rehash(root: Path, m: dict, rel: str) -> None:
    m["files"][rel] = {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}


def _load(path, cache_dir, **kw):
    return LLM.load_artifact(path, cache_dir=cache_dir, **kw)


@pytest.fixture(scope="module")
def saved(tiny_models, cache_dir, tmp_path_factory):
    """The tiny Llama with a draft (a different random model: one layer, other weights) exported
    together; the saving LLM's greedy tokens and proposal counts."""
    root = tmp_path_factory.mktemp("spec-art")
    draft = save_tiny_model(root / "draft-model", "llama", seed=1, num_hidden_layers=1)
    path = root / "artifact"
    llm = make_llm(tiny_models["llama"], cache_dir, bucket_config=BUCKETS, speculative_model=str(draft),
                   paged_attention_block_size=16,  # `fxcompiler build`'s default: its build below hits the caches
                   speculative_model_bucket_config=BUCKETS, num_speculative_tokens=K, artifacts_export_path=path)
    tokens = _tokens(llm)
    st = llm.engine.stats
    counts = (st.spec_proposed_tokens, st.spec_accepted_tokens)
    llm.shutdown()
    return path, tokens, counts


def test_artifact_carries_the_draft_and_loads_speculating(saved, cache_dir, capsys):
    path, ref, (proposed, accepted) = saved
    m = _manifest(path)
    assert m["speculative"]["method"] == "draft_model" and m["speculative"]["path"] == DRAFT
    assert m["speculative"]["num_speculative_tokens"] == K
    assert cli.main(["inspect", str(path), "--verify"]) == 0
    assert f"speculative: draft_model {m['speculative']['model_id']} in {DRAFT}/, num_speculative_tokens {K}" \
        in capsys.readouterr().out
    inner = _manifest(path / DRAFT)
    assert "speculative" not in inner and inner["geometry"]["num_layers"] == 1
    # the target's file list covers every file of the draft (one verification, one allow-list digest)
    assert {f"{DRAFT}/{f}" for f in inner["files"]} | {f"{DRAFT}/artifact.json"} == {
        f for f in m["files"] if f.startswith(f"{DRAFT}/")}

    llm = _load(path, cache_dir, speculative_draft_data_parallel_size=1, speculative_draft_pipeline_parallel_size=1)
    assert llm.num_speculative_tokens == K and llm.speculative_llm.geometry.num_layers == 1
    assert _tokens(llm) == ref
    st = llm.engine.stats
    assert proposed > 0 and accepted < proposed  # a different model: drafts rejected, output still the target's
    assert (st.spec_proposed_tokens, st.spec_accepted_tokens) == (proposed, accepted)  # the same draft came back
    llm.shutdown()
    with _load(path, cache_dir, data_parallel_size=2) as dp:  # replicas of the artifact, a speculator each
        assert [o.outputs[0].token_ids for o in dp.generate(None, GREEDY, prompt_token_ids=PROMPTS)] == ref
        assert all(r.speculator is not None and r.stats.spec_verify_steps > 0 for r in dp.engine.replicas)
    llm.shutdown()

    plain = _load(path, cache_dir, skip_speculative_model_load=True)
    assert plain.speculative_llm is None and plain.num_speculative_tokens is None and plain.engine.speculator is None
    assert _tokens(plain) == ref and plain.engine.stats.spec_proposed_tokens == 0
    plain.shutdown()
    off = LLM.from_artifacts(path, cache_dir=cache_dir, use_speculative_decoding_if_possible=False, skip_engine=True)
    assert off.speculative_llm is None and off.num_speculative_tokens is None
    on = LLM.from_artifacts(path, cache_dir=cache_dir, num_speculative_tokens=2, skip_engine=True)
    assert on.num_speculative_tokens == 2 and on.speculative_llm.geometry.num_layers == 1


def test_overrides_and_the_ngram_proposer_recorded(saved, tiny_models, cache_dir, tmp_path, capsys):
    path, ref, _ = saved
    short = [r[:SHORT.max_tokens] for r in ref]  # greedy: a shorter run is a prefix of the longer one
    # an LLM override: the draft artifact loaded on its own, drafting for the target
    draft = LLM.load_artifact(path / DRAFT, cache_dir=cache_dir, skip_engine=True)
    llm = _load(path, cache_dir, speculative_model=draft)
    assert llm.speculative_llm is draft and llm.num_speculative_tokens == K  # k: the artifact's
    assert _tokens(llm, SHORT) == short and llm.engine.stats.spec_proposed_tokens > 0
    llm.shutdown()
    # "[ngram]" override: no draft model, the artifact's draft is not loaded
    llm = LLM.from_artifacts(path, cache_dir=cache_dir, speculative_model="[ngram]", num_speculative_tokens=2)
    assert llm.speculative_llm is None and llm.num_speculative_tokens == 2
    assert _tokens(llm) == ref and llm.engine.stats.spec_accepted_tokens > 0
    llm.shutdown()
    # `fxcompiler build --speculative-model '[ngram]:2:3'` records the proposer and its sizes, no model files
    ng = tmp_path / "ngram"
    argv = ["build", str(tiny_models["llama"]), str(ng), "--dtype", "float64", "--max-seq-len-to-capture", "128",
            "-pb", "1,128", "-db", "1,128", "-db", "8,128", "--cache-dir", str(cache_dir),
            "--speculative-model", "[ngram]:2:3", "--num-speculative-tokens", "2"]
    assert cli.main(argv) == 0
    assert "speculative: [ngram]:2:3, num_speculative_tokens=2" in capsys.readouterr().out
    assert _manifest(ng)["speculative"] == {"method": "ngram", "model": "[ngram]:2:3", "num_speculative_tokens": 2}
    assert not (ng / DRAFT).exists()
    llm = _load(ng, cache_dir)
    prop = llm.engine.speculator.proposer
    assert (type(prop).__name__, prop.min_n, prop.max_n, llm.num_speculative_tokens) == ("NgramProposer", 2, 3, 2)
    assert _tokens(llm) == ref and llm.engine.stats.spec_accepted_tokens > 0
    llm.shutdown()


def test_tampered_draft_never_runs(saved, cache_dir, tmp_path, monkeypatch):
    src = saved[0]
    sentinel = tmp_path / "sentinel"
    a = shutil.copytree(src, tmp_path / "a")
    graph = next((a / DRAFT / "graphs").glob("*.py"))
    graph.write_text(_payload(sentinel) + graph.read_text())
    for kw in ({}, {"skip_speculative_model_load": True}):  # the target's verification covers the draft
        with pytest.raises(ArtifactError, match=rf"{DRAFT}/graphs/{graph.name}: (size|sha256)"):
            _load(a, cache_dir, **kw)
    # the draft's own manifest fixed up too: its artifact.json no longer matches the target's record
    rel = f"graphs/{graph.name}"
    inner = _manifest(a / DRAFT)
    _rehash(a / DRAFT, inner, rel)
    _save(a / DRAFT, inner)
    outer = _manifest(a)
    _rehash(a, outer, f"{DRAFT}/{rel}")
    _save(a, outer)
    with pytest.raises(ArtifactError, match=rf"{DRAFT}/artifact.json: (size|sha256)"):
        _load(a, cache_dir)
    # every hash rewritten: only an allow-list catches that; one that names the target covers its draft
    allow = tmp_path / "trusted.txt"
    allow.write_text(manifest_sha256(src) + "\n")
    monkeypatch.setenv("FXCOMPILER_TRUSTED_ARTIFACTS", str(allow))
    _rehash(a, outer, f"{DRAFT}/artifact.json")
    _save(a, outer)
    with pytest.raises(ArtifactError, match="not in the trusted-artifact allow-list"):
        _load(a, cache_dir)
    assert not sentinel.exists()
    intact = _load(src, cache_dir, skip_engine=True)  # the draft loads through the target's digest
    assert intact.speculative_llm is not None


def test_draft_path_escaping_the_artifact_never_runs(saved, cache_dir, tmp_path):
    src = saved[0]
    sentinel = tmp_path / "sentinel"
    a = shutil.copytree(src, tmp_path / "a")
    outside = shutil.copytree(src / DRAFT, tmp_path / "outside")  # a self-consistent planted draft
    graph = next((outside / "graphs").glob("*.py"))
    graph.write_text(_payload(sentinel) + graph.read_text())
    inner = _manifest(outside)
    _rehash(outside, inner, f"graphs/{graph.name}")
    _save(outside, inner)
    m = _manifest(a)
    m["speculative"]["path"] = f"{DRAFT}/../../outside"
    _save(a, m)
    with pytest.raises(ArtifactError, match="leaves the folder"):
        _load(a, cache_dir)
    m["files"][f"{DRAFT}/../../outside/artifact.json"] = {"size": (outside / "artifact.json").stat().st_size,
                                                          "sha256": sha256_file(outside / "artifact.json")}
    _save(a, m)
    with pytest.raises(ArtifactError, match="leaves the folder"):
        _load(a, cache_dir, skip_engine=True)
    m["speculative"]["path"] = "."  # the target itself is no draft: its manifest is not a listed file
    del m["files"][f"{DRAFT}/../../outside/artifact.json"]
    _save(a, m)
    with pytest.raises(ArtifactError, match="not one of the artifact's listed"):
        _load(a, cache_dir, skip_engine=True)
    assert not sentinel.exists()


def test_bad_drafts_and_arguments(saved, cache_dir, tmp_path):
    path = saved[0]
    other = tmp_path / "v300"
    v300 = LLM(str(save_tiny_model(tmp_path / "m300", "llama", vocab_size=300, num_hidden_layers=1)),
               dtype="float64", cache_dir=cache_dir, bucket_config=BUCKETS, max_seq_len_to_capture=128,
               skip_engine=True, artifacts_export_path=other)
    vocab = r"vocabulary \(300 tokens\) differs from the target's \(256\)"
    with pytest.raises(ValueError, match=vocab):
        _load(path, cache_dir, speculative_model=v300)
    with pytest.raises(ValueError, match=vocab):
        LLM.from_artifacts(path, cache_dir=cache_dir, speculative_model=other)
    with pytest.raises(ArtifactError, match=r"speculative_model='.*nowhere'.*not a directory"):
        _load(path, cache_dir, speculative_model=str(tmp_path / "nowhere"), skip_engine=True)
    parallel = "speculative decoding with tensor/pipeline/data parallelism"
    for kw in (dict(speculative_draft_data_parallel_size=2), dict(speculative_draft_pipeline_parallel_size=2),
               dict(speculative_draft_num_blocks_per_pp_stage=[1, 1])):
        with pytest.raises(NotImplementedError, match=parallel):
            _load(path, cache_dir, **kw)
    with pytest.raises(ValueError, match="given with skip_speculative_model_load=True"):
        _load(path, cache_dir, speculative_model="[ngram]", skip_speculative_model_load=True)
    with pytest.raises(ValueError, match="given with use_speculative_decoding_if_possible=False"):
        LLM.from_artifacts(path, num_speculative_tokens=2, use_speculative_decoding_if_possible=False)
    with pytest.raises(ValueError, match="carries no draft"):
        _load(path / DRAFT, cache_dir, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
        LLM.from_artifacts(path, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_draft_data_parallel_size must be a positive int"):
        _load(path, cache_dir, speculative_draft_data_parallel_size=0)
    with pytest.raises(TypeError, match="speculative_model must be an artifact path"):
        _load(path, cache_dir, speculative_model=3)
    with pytest.raises(TypeError, match="skip_speculative_model_load must be a bool"):
        _load(path, cache_dir, skip_speculative_model_load=1)
