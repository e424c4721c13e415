"""fxcompiler: an LLM inference stack built as a graph compiler on torch.export / torch.fx.

The public API is exported lazily (PEP 562) so that ``import fxcompiler.pipeline`` from a
lower layer never imports the runtime, transformers or the backends.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "fxcompiler.llm",
    "SamplingParams": "fxcompiler.sampling_params",
    "RequestOutputKind": "fxcompiler.sampling_params",
    "GuidedDecodingParams": "fxcompiler.guided_decoding",
    "RequestOutput": "fxcompiler.outputs",
    "CompletionOutput": "fxcompiler.outputs",
    "Logprob": "fxcompiler.outputs",
    "Bucket": "fxcompiler.pipeline",
    "Device": "fxcompiler.pipeline",
    "Pipeline": "fxcompiler.pipeline",
    "SchedulerConfig": "fxcompiler.config",
    "ManualBucketConfig": "fxcompiler.config",
    "MinimalBucketConfig": "fxcompiler.config",
    "DefaultBucketConfig": "fxcompiler.config",
    "KvCacheSharingAcrossBeamsConfig": "fxcompiler.config",
    "LLMConfig": "fxcompiler.config",
    "OptimizationConfig": "fxcompiler.config",
    "QuantizationConfig": "fxcompiler.config",
    "QDtype": "fxcompiler.config",
    "LLMBackend": "fxcompiler.config",
    "PassManager": "fxcompiler.pass_manager",
    "PassResult": "fxcompiler.pass_manager",
    "register_pass": "fxcompiler.pass_manager",
}

__all__ = sorted(_EXPORTS) + ["__version__", "full_version"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fxcompiler' has no attribute {name!r}")


def full_version() -> str:
    import torch
    import transformers

    return f"fxcompiler {__version__} (torch {torch.__version__}, transformers {transformers.__version__})"
