"""Model sources: local HF directories, GGUF files, the embedded default model, random weights."""
from .sources import DEFAULT_MODEL_ID, ModelSource, resolve_model_source

__all__ = ["DEFAULT_MODEL_ID", "ModelSource", "resolve_model_source"]
