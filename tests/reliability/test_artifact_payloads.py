"""Verify, then execute: planted payloads in an artifact's graphs, pickles and manifest paths never
run (a sentinel file is never created), and every tampering is refused naming the file."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

from fxcompiler.artifacts import ArtifactError, manifest_sha256, read_artifact
from fxcompiler.integrity import sha256_file
from tests._artifact_tampering import payload as _payload, read_manifest as _manifest, write_manifest as _save

from .conftest import make_llm


@pytest.fixture(scope="module")
def artifact(llama_dir, rel_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "tiny-artifact"
    make_llm(llama_dir, rel_cache, artifacts_export_path=path, skip_engine=True)
    return path


@pytest.fixture
def copy(artifact, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(artifact, dst, symlinks=True)
    return dst


def _fx_code(m: dict) -> str:
    return next(e["code"] for e in m["graphs"].values() if e["kind"] == "fx")


def _rehash(root: Path, m: dict, rel: str) -> None:
    m["files"][rel] = {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}


def test_intact_artifact_loads(copy, tmp_path):
    contents = read_artifact(copy, cache_dir=tmp_path / "c")
    assert contents.pipelines


def test_payload_prepended_to_graph_code_never_runs(copy, tmp_path):
    sentinel = tmp_path / "sentinel"
    rel = _fx_code(_manifest(copy))
    (copy / rel).write_text(_payload(sentinel) + (copy / rel).read_text())
    with pytest.raises(ArtifactError, match=r"(size|sha256).*"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    assert not sentinel.exists()


def test_manifest_code_path_escaping_the_artifact_never_runs(copy, tmp_path):
    sentinel = tmp_path / "sentinel"
    outside = copy.parent / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text(_payload(sentinel) + "def forward(self, x):\n    return x\n")
    m = _manifest(copy)
    blob = next(k for k, e in m["graphs"].items() if e["kind"] == "fx")
    m["graphs"][blob]["code"] = "../outside/evil.py"
    m["files"]["../outside/evil.py"] = {"size": (outside / "evil.py").stat().st_size,
                                        "sha256": sha256_file(outside / "evil.py")}
    _save(copy, m)
    with pytest.raises(ArtifactError, match="leaves the folder"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    assert not sentinel.exists()


def test_absolute_manifest_path_is_refused(copy, tmp_path):
    m = _manifest(copy)
    blob = next(k for k, e in m["graphs"].items() if e["kind"] == "fx")
    m["graphs"][blob]["code"] = str(copy / m["graphs"][blob]["code"])
    _save(copy, m)
    with pytest.raises(ArtifactError, match="absolute"):
        read_artifact(copy, cache_dir=tmp_path / "c")


def test_symlink_out_of_the_artifact_never_runs(copy, tmp_path):
    sentinel = tmp_path / "sentinel"
    m = _manifest(copy)
    rel = _fx_code(m)
    evil = tmp_path / "evil.py"
    evil.write_text(_payload(sentinel) + (copy / rel).read_text())
    (copy / rel).unlink()
    (copy / rel).symlink_to(evil)
    _rehash(copy, m, rel)  # the attacker even fixes the hash
    _save(copy, m)
    with pytest.raises(ArtifactError, match="outside the folder"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    assert not sentinel.exists()


def test_code_path_to_an_unlisted_file_is_refused(copy, tmp_path):
    sentinel = tmp_path / "sentinel"
    m = _manifest(copy)
    (copy / "graphs" / "extra.py").write_text(_payload(sentinel))
    blob = next(k for k, e in m["graphs"].items() if e["kind"] == "fx")
    m["graphs"][blob]["code"] = "graphs/extra.py"
    _save(copy, m)
    with pytest.raises(ArtifactError, match="not one of the artifact's listed"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    assert not sentinel.exists()


def test_pipeline_path_escaping_is_refused(copy, tmp_path):
    m = _manifest(copy)
    m["pipelines"][0] = "../" + m["pipelines"][0]
    _save(copy, m)
    with pytest.raises(ArtifactError, match="leaves the folder"):
        read_artifact(copy, cache_dir=tmp_path / "c")


def test_params_path_escaping_is_refused(copy, tmp_path):
    m = _manifest(copy)
    m["params"]["file"] = "/etc/passwd"
    _save(copy, m)
    with pytest.raises(ArtifactError, match="absolute"):
        read_artifact(copy, cache_dir=tmp_path / "c")


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickled_params_payload_never_runs(copy, tmp_path):
    """A .pt parameter file is read with weights_only=True: a pickle payload is refused, not run."""
    sentinel = tmp_path / "sentinel"
    m = _manifest(copy)
    (copy / "params" / "params.pt").write_bytes(pickle.dumps({"w": _Boom(sentinel)}))
    m["params"].update(file="params/params.pt", format="pt")
    _rehash(copy, m, "params/params.pt")
    _save(copy, m)
    with pytest.raises(ArtifactError, match="cannot read parameters"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    assert not sentinel.exists()


def test_manifest_without_geometry_names_the_key(copy, tmp_path):
    m = _manifest(copy)
    del m["geometry"]
    _save(copy, m)
    with pytest.raises(ArtifactError, match=r"manifest lacks \['geometry'\]"):
        read_artifact(copy, cache_dir=tmp_path / "c")


def test_allow_list_refuses_a_rewritten_artifact_before_running_it(copy, tmp_path):
    """Without an allow-list, an attacker who rewrites the manifest hashes too gets code run (an artifact
    is code, docs/security.md); with one, the rewritten manifest's hash is unknown and nothing runs."""
    trusted = {manifest_sha256(copy)}
    read_artifact(copy, cache_dir=tmp_path / "c", trusted_hashes=trusted)
    sentinel = tmp_path / "sentinel"
    m = _manifest(copy)
    rel = _fx_code(m)
    (copy / rel).write_text(_payload(sentinel) + (copy / rel).read_text())
    _rehash(copy, m, rel)
    _save(copy, m)
    with pytest.raises(ArtifactError, match="not in the trusted-artifact allow-list"):
        read_artifact(copy, cache_dir=tmp_path / "c", trusted_hashes=trusted)
    assert not sentinel.exists()


def test_allow_list_from_the_environment(copy, tmp_path, monkeypatch):
    lst = tmp_path / "trusted.txt"
    lst.write_text("# deployment allow-list\n" + "0" * 64 + "\n")
    monkeypatch.setenv("FXCOMPILER_TRUSTED_ARTIFACTS", str(lst))
    with pytest.raises(ArtifactError, match="allow-list"):
        read_artifact(copy, cache_dir=tmp_path / "c")
    lst.write_text(manifest_sha256(copy) + "\n")
    read_artifact(copy, cache_dir=tmp_path / "c")
    with pytest.raises(ArtifactError, match="verify=False cannot be combined"):
        read_artifact(copy, cache_dir=tmp_path / "c", verify=False)


def test_edf_keys_cannot_name_paths(tmp_path):
    from fxcompiler import edf

    for key in ("../../etc/x", "a" * 63 + "/", "A" * 64, ""):
        with pytest.raises(ValueError, match="sha256 hex digest"):
            edf.deserialize(b"zip", key, tmp_path)
    assert not any(tmp_path.rglob("*.pt2"))


def test_edf_package_already_cached_under_the_key_is_replaced_by_the_artifacts_own(tmp_path):
    from fxcompiler import edf

    key = "ab" * 32
    planted = edf.package_dir(tmp_path) / f"{key}.pt2"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"someone else's package")
    pkg = edf.deserialize(b"the artifact's package", key, tmp_path)
    assert Path(pkg.path).read_bytes() == b"the artifact's package"
    assert edf.package_is_intact(pkg.path)
    Path(pkg.path).write_bytes(b"flipped")
    assert not edf.package_is_intact(pkg.path)
