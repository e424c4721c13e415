"""Speculative decoding in artifacts: the draft is saved inside the target's artifact and loaded back.

Requires: an artifact written by ``fxcompiler/artifacts.py``; the LLM's speculative state as
:func:`fxcompiler.speculative.attach` leaves it (``speculative_llm``, ``num_speculative_tokens``).
Ensures: an artifact of an LLM with a draft model holds the draft's own artifact under
``speculative_model/`` (the same format), and its manifest records

    "speculative": {"method": "draft_model", "path": "speculative_model", "model_id": ...,
                    "num_speculative_tokens": k}
    "speculative": {"method": "ngram", "model": "[ngram]:MIN:MAX", "num_speculative_tokens": k}

The target's ``files`` list every file of the draft too, so verifying the target verifies the
draft before any code of either is run, and one allow-list digest (the target's
``artifact.json``) pins both; the draft's ``artifact.json`` is then read only if it hashes to the
digest the target lists for it. The path of the draft is confined to the artifact and must name
a listed file. Part of the composition root: only ``fxcompiler/llm.py`` imports this.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DRAFT_DIR = "speculative_model"
DRAFT_PARALLEL = ("speculative_draft_data_parallel_size", "speculative_draft_pipeline_parallel_size")


def export_hook(llm, param_saved_format: str) -> Callable[[Path], dict] | None:
    """``export_artifact``'s ``extra``: writes the draft under ``speculative_model/`` (or records
    the n-gram proposer); None when ``llm`` does not speculate."""
    k = llm.__dict__.get("num_speculative_tokens")
    if k is None:
        return None
    ngram = llm.__dict__.get("_speculative_ngram")
    draft = llm.__dict__.get("speculative_llm")

    def write(tmp: Path) -> dict:
        if ngram is not None:
            return {"speculative": {"method": "ngram", "model": ngram, "num_speculative_tokens": k}}
        if draft.__dict__.get("_build") is None:
            raise _not_parallel("exporting a draft served by rank workers")
        draft._export_artifact(tmp / DRAFT_DIR, param_saved_format, speculative=False)
        return {"speculative": {"method": "draft_model", "path": DRAFT_DIR, "model_id": draft.model_id,
                                "num_speculative_tokens": k}}

    return write


def _not_parallel(what: str) -> NotImplementedError:
    from .llm import _later

    return _later(f"speculative decoding with tensor/pipeline/data parallelism ({what})", "speculative-decoding issue")


def refuse_parallel_target() -> NotImplementedError:
    return _not_parallel("a target with rank workers; load the artifact with "
                         "skip_speculative_model_load=True, or from_artifacts(..., "
                         "use_speculative_decoding_if_possible=False), to serve it without speculation")


@dataclass
class DraftLoad:
    """Where the draft of an artifact load comes from, resolved before anything is loaded."""

    source: str  # "artifact" (inside the target's), "path" (another artifact), "llm", "ngram"
    model: Any  # the recorded relative path, a path, an LLM, or the n-gram spec
    num_speculative_tokens: int | None
    bucket_config: Any = None
    paged_attention_num_blocks: int | None = None

    def request(self, cls, target, root: Path, manifest: dict, *, devices, cache_dir, scheduler_config,
                tokenizer_mode):
        """Load the draft (verified like any artifact) and check it against ``target``: the
        :class:`~fxcompiler.speculative.SpeculativeRequest` to attach once the engine runs."""
        from .artifacts import ArtifactError, _file
        from .speculative import _n_predict, check_before_build, parse_request

        model = self.model
        if self.source in ("artifact", "path"):
            trusted = None
            if self.source == "artifact":
                if not isinstance(model, str):
                    raise ArtifactError(f"{root / 'artifact.json'}: malformed 'speculative' entry (path {model!r})")
                rel = f"{model}/artifact.json"
                where = _file(root, manifest, rel, "speculative model manifest").parent  # confined, listed
                trusted = {manifest["files"][rel]["sha256"]}  # verified with the target's files: the chain of trust
            else:
                where = model
            try:
                model = cls._load_artifact_dir(
                    where, devices=devices, data_parallel_size=None, pipeline_parallel_size=None,
                    num_blocks_per_pp_stage=None, bucket_config=self.bucket_config, scheduler_config=scheduler_config,
                    tokenizer=None, tokenizer_mode=tokenizer_mode, seed=None, cache_dir=cache_dir, skip_engine=True,
                    paged_attention_num_blocks=self.paged_attention_num_blocks, _trusted_hashes=trusted)
            except ArtifactError as exc:
                if self.source == "path":
                    raise ArtifactError(f"speculative_model={os.fspath(self.model)!r}: {exc}") from None
                raise
        req = parse_request(model, self.num_speculative_tokens)
        check_before_build(target, req)
        if not req.is_ngram and req.num_speculative_tokens is None and _n_predict(
                model.model_config, target.model_config) is None:
            raise ValueError("num_speculative_tokens is required: neither the draft's nor the target's config "
                             "has n_predict")
        return req


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _record(path) -> Any:
    """The manifest's ``speculative`` entry (JSON data: only used to decide what to load; the
    files it names are verified with the rest); None where ``path`` is no one-process artifact
    (the loader reports why)."""
    from .artifacts import ArtifactError, read_manifest

    try:
        return read_manifest(path).get("speculative")
    except (ArtifactError, TypeError):
        return None


def plan_load(path, *, speculative_model=None, num_speculative_tokens=None, enabled: bool = True,
              opt_out: str = "skip_speculative_model_load=True", draft_parallel: dict | None = None,
              bucket_config=None, paged_attention_num_blocks=None) -> DraftLoad | None:
    """The draft an artifact load attaches: an explicit ``speculative_model`` (an ``LLM``, an
    artifact path or ``"[ngram]"``), else the one the artifact records; None without speculation.
    Argument errors are raised here, before anything is read but the manifest."""
    from .artifacts import ArtifactError
    from .config import BucketConfig
    from .llm import LLM
    from .speculative import NGRAM_KEYWORDS, _ngram_sizes

    _positive("num_speculative_tokens", num_speculative_tokens)
    _positive("speculative_model_paged_attention_num_blocks", paged_attention_num_blocks)
    if bucket_config is not None and not isinstance(bucket_config, BucketConfig):
        raise TypeError(f"speculative_model_bucket_config must be a BucketConfig (ManualBucketConfig, MinimalBucketConfig or DefaultBucketConfig), "
                        f"got {type(bucket_config).__name__}")
    draft_parallel = {k: v for k, v in (draft_parallel or {}).items() if v is not None}
    for name in DRAFT_PARALLEL:
        _positive(name, draft_parallel.get(name))
    extras = {"num_speculative_tokens": num_speculative_tokens, "speculative_model_bucket_config": bucket_config,
              "speculative_model_paged_attention_num_blocks": paged_attention_num_blocks, **draft_parallel}
    given = sorted(k for k, v in extras.items() if v is not None)
    if not enabled:
        if speculative_model is not None or given:
            raise ValueError(f"{', '.join(['speculative_model'] * (speculative_model is not None) + given)} given "
                             f"with {opt_out} (which loads the artifact without speculative decoding)")
        return None
    record = _record(path)
    if speculative_model is None:
        if record is None:
            if given:
                raise ValueError(f"{', '.join(given)} given, but the artifact {os.fspath(path)!r} carries no draft "
                                 "and no speculative_model was given")
            return None
        if not isinstance(record, dict) or record.get("method") not in ("draft_model", "ngram"):
            raise ArtifactError(f"{Path(path) / 'artifact.json'}: malformed 'speculative' entry {record!r}")
        k = record.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ArtifactError(f"{Path(path) / 'artifact.json'}: malformed 'speculative' entry "
                                f"(num_speculative_tokens {k!r})")
        k = num_speculative_tokens or k
        if record["method"] == "ngram":
            spec = record.get("model")
            if not isinstance(spec, str) or spec.split(":")[0].strip().lower() not in NGRAM_KEYWORDS:
                raise ArtifactError(f"{Path(path) / 'artifact.json'}: malformed 'speculative' entry {record!r}")
            _ngram_sizes(spec)
            return DraftLoad("ngram", spec, k)
        source, model = "artifact", record.get("path")
    else:
        k = num_speculative_tokens
        if k is None:  # the artifact's k, chosen when it was built
            k = record.get("num_speculative_tokens") if isinstance(record, dict) else None
            k = k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None
        if isinstance(speculative_model, LLM):
            return DraftLoad("llm", speculative_model, k)  # used as it is (its parallel sizes are its own)
        if isinstance(speculative_model, str) and speculative_model.split(":")[0].strip().lower() in NGRAM_KEYWORDS:
            _ngram_sizes(speculative_model)
            return DraftLoad("ngram", speculative_model, k)
        if not isinstance(speculative_model, (str, os.PathLike)):
            raise TypeError(f"speculative_model must be an artifact path, an LLM or '[ngram]', got "
                            f"{type(speculative_model).__name__}")
        source, model = "path", speculative_model
    blocks = draft_parallel.get("speculative_draft_num_blocks_per_pp_stage")
    if any(draft_parallel.get(n, 1) > 1 for n in DRAFT_PARALLEL) or (blocks is not None and len(list(blocks)) > 1):
        raise _not_parallel("a draft over several processes: " + ", ".join(
            f"{n}={draft_parallel[n]!r}" for n in (*DRAFT_PARALLEL, "speculative_draft_num_blocks_per_pp_stage")
            if n in draft_parallel))
    return DraftLoad(source, model, k, bucket_config, paged_attention_num_blocks)
