"""furiosa's speculative-decoding arguments: validation, the draft model, the engine's speculator.

``speculative_model`` selects the proposer:

* ``"[ngram]"`` (vLLM's keyword; ``"ngram"`` too): prompt lookup, no model. Optional sizes:
  ``"[ngram]:MIN:MAX"`` (default 2 and 4 tokens);
* a model id / local path / ``.gguf`` file: built as an :class:`~fxcompiler.LLM` with the
  ``speculative_model_*`` arguments, the target's devices, block size and context. The draft runs
  in the ``LLM`` process (a tensor/pipeline-parallel target's verify steps run in its rank workers),
  or, with ``speculative_draft_tensor_parallel_size`` / ``_pipeline_parallel_size`` /
  ``_num_blocks_per_pp_stage``, in rank workers of its own (their KV cache is the draft's; the
  target shuts them down); ``speculative_draft_data_parallel_size`` is the target's (a draft
  runner per replica);
* an :class:`~fxcompiler.LLM` (e.g. a bf16 or quantized copy of the target): used as it is (the
  ``speculative_draft_*`` and ``speculative_model_*`` arguments are ignored).

The draft always gets its own KV cache and block manager (its pipelines are shared with the LLM
that built them); with ``data_parallel_size > 1`` every replica gets its own speculator and draft
KV cache, so each replica verifies its own requests. Part of the composition root: only ``fxcompiler/llm.py`` imports this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NGRAM_KEYWORDS = ("[ngram]", "ngram")


def _is_llm(obj) -> bool:
    from .llm import LLM

    return isinstance(obj, LLM)
DRAFT_PARALLEL_SIZES = ("speculative_draft_tensor_parallel_size", "speculative_draft_pipeline_parallel_size",
                        "speculative_draft_data_parallel_size")


@dataclass
class SpeculativeRequest:
    """The speculative arguments of one ``LLM(...)`` call, validated."""

    model: Any
    num_speculative_tokens: int | None
    llm_kwargs: dict = field(default_factory=dict)  # for building a draft from an id/path
    target_defaults: dict = field(default_factory=dict)  # the target's devices and parallel sizes

    @property
    def is_parallel_draft(self) -> bool:
        """A draft built from an id/path over several processes (tp or pp > 1, or several pp stages)."""
        kw = self.llm_kwargs
        stages = kw.get("speculative_draft_num_blocks_per_pp_stage")
        return not self.is_ngram and not _is_llm(self.model) and (
            (kw.get("speculative_draft_tensor_parallel_size") or 1) > 1
            or (kw.get("speculative_draft_pipeline_parallel_size") or 1) > 1
            or (stages is not None and len(list(stages)) > 1))

    @property
    def is_ngram(self) -> bool:
        return isinstance(self.model, str) and self.model.split(":")[0].strip().lower() in NGRAM_KEYWORDS


def parse_request(speculative_model, num_speculative_tokens, target_defaults: dict | None = None,
                  **llm_kwargs) -> SpeculativeRequest | None:
    """None when speculative decoding is not asked for; errors name the argument."""
    extras = {k: v for k, v in llm_kwargs.items() if v not in (None, {})}
    if speculative_model is None:
        if num_speculative_tokens is not None or extras:
            named = sorted(extras) + (["num_speculative_tokens"] if num_speculative_tokens is not None else [])
            raise ValueError(f"{', '.join(named)} given without speculative_model (a draft model, an LLM, or "
                             "'[ngram]' for prompt lookup)")
        return None
    from .llm import LLM

    if not isinstance(speculative_model, (str, LLM)) and not hasattr(speculative_model, "__fspath__"):
        raise TypeError(f"speculative_model must be a model id/path, an LLM or '[ngram]', got "
                        f"{type(speculative_model).__name__}")
    if num_speculative_tokens is not None and (isinstance(num_speculative_tokens, bool)
                                               or not isinstance(num_speculative_tokens, int)
                                               or num_speculative_tokens <= 0):
        raise ValueError(f"num_speculative_tokens must be a positive int, got {num_speculative_tokens!r}")
    req = SpeculativeRequest(speculative_model, num_speculative_tokens, llm_kwargs, dict(target_defaults or {}))
    for k in DRAFT_PARALLEL_SIZES:
        v = llm_kwargs.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    dp = llm_kwargs.get("speculative_draft_data_parallel_size")
    if dp not in (None, 1) and dp != req.target_defaults.get("dp") and not isinstance(speculative_model, LLM) \
            and not req.is_ngram:
        from .llm import _later

        raise _later(f"speculative_draft_data_parallel_size={dp!r} other than the target's data_parallel_size="
                     f"{req.target_defaults.get('dp')!r} (every data-parallel replica of the target gets a draft "
                     "runner of its own: the draft's data-parallel size is the target's)", "speculative-decoding issue")
    if req.is_ngram:
        _ngram_sizes(speculative_model)
    elif not isinstance(speculative_model, LLM):
        _refuse_kv8_draft(llm_kwargs)
    return req


def _refuse_kv8_draft(llm_kwargs: dict) -> None:
    """A draft built here keeps a float KV cache (its engine starts without the build-time KV8 calibration):
    a ``*KV8`` / ``*KVf8`` draft config or a draft qformat with ``--kv_dtype int8`` / ``fp8`` is refused before
    anything is built."""
    from .quant_config import QDtype
    from .quant_options import quantized_kv_dtype

    cfg = llm_kwargs.get("speculative_model_llm_config")
    kv = quantized_kv_dtype(getattr(cfg, "quantization_config", None), llm_kwargs.get("speculative_model_qformat_path"))
    if kv in (QDtype.INT8, QDtype.FP8):
        raise NotImplementedError(
            f"speculative_model_llm_config / speculative_model_qformat_path name an {kv.value} KV cache "
            f"({'KV8' if kv == QDtype.INT8 else 'KVf8'}) for the draft: "
            "a draft keeps a float KV cache of its own (the target's may be int8 or fp8); give the draft its weight "
            "scheme without KV8 / KVf8 (e.g. W8A16)")


def _ngram_sizes(spec: str) -> tuple[int, int]:
    parts = spec.split(":")[1:]
    if not parts:
        return 2, 4
    try:
        lo, hi = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (int(parts[0]), int(parts[0]))
    except ValueError:
        raise ValueError(f"speculative_model={spec!r}: expected '[ngram]' or '[ngram]:MIN:MAX'") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"speculative_model={spec!r}: n-gram sizes must satisfy 1 <= MIN <= MAX")
    return lo, hi


def _n_predict(*configs) -> int | None:
    for cfg in configs:
        v = getattr(cfg, "n_predict", None) if cfg is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def _require_k(req: SpeculativeRequest, draft_config, target_config) -> None:
    """A draft model needs ``num_speculative_tokens`` or an ``n_predict`` in the draft's or the target's config."""
    if req.num_speculative_tokens is None and _n_predict(draft_config, target_config) is None:
        raise ValueError("num_speculative_tokens is required: neither the draft's nor the target's config "
                         "has n_predict")


def build_draft(target, req: SpeculativeRequest):
    """The draft :class:`LLM` (built from an id/path with the target's devices, block size and context)."""
    from .llm import LLM

    if isinstance(req.model, LLM):
        return req.model
    kw = dict(req.llm_kwargs)
    tgt = req.target_defaults
    hf = kw.pop("speculative_model_config", None) or {}
    common = dict(llm_config=kw.get("speculative_model_llm_config"),
                  qformat_path=kw.get("speculative_model_qformat_path"),
                  qparam_path=kw.get("speculative_model_qparam_path"),
                  quant_ckpt_file_path=kw.get("speculative_model_quant_ckpt_file_path"),
                  hf_overrides=dict(hf), bucket_config=kw.get("speculative_model_bucket_config"),
                  max_seq_len_to_capture=target.max_seq_len_to_capture,
                  paged_attention_block_size=target.paged_attention_block_size, cache_dir=target.cache_dir,
                  scheduler_config=target.scheduler_config)
    if req.is_parallel_draft:  # its own rank workers (and an engine whose runner drives them)
        stages = kw.get("speculative_draft_num_blocks_per_pp_stage")
        stages = list(stages) if stages is not None else None
        common.update(tensor_parallel_size=kw.get("speculative_draft_tensor_parallel_size") or 1,
                      pipeline_parallel_size=kw.get("speculative_draft_pipeline_parallel_size") or len(stages or [1]),
                      num_blocks_per_pp_stage=stages)
    else:  # steps run in this process, on the target's first device
        common.update(devices=_draft_devices(tgt.get("devices")), skip_engine=True)
    try:
        return LLM(str(req.model) if not isinstance(req.model, str) else req.model, **common)
    except ValueError as exc:
        if "max_position_embeddings" in str(exc):
            raise ValueError(f"speculative_model={req.model!r}: the draft's context limit is shorter than the "
                             f"target's max_seq_len_to_capture={target.max_seq_len_to_capture} ({exc})") from exc
        raise


def _draft_devices(devices):
    """The first of the target's devices: the draft is one process (a target's ``"cpu:0,cpu:1"`` is its ranks')."""
    if isinstance(devices, str) and "," in devices:
        return devices.split(",")[0].strip()
    if isinstance(devices, (list, tuple)) and len(devices) > 1:
        return devices[0]
    return devices


def check_compatible(target, draft) -> None:
    """The draft must share the target's tokenizer and vocabulary and hold at least its context."""
    tv = getattr(target.model_config, "vocab_size", None)
    dv = getattr(draft.model_config, "vocab_size", None)
    if tv != dv:
        raise ValueError(f"speculative_model: the draft's vocabulary ({dv} tokens) differs from the target's "
                         f"({tv}); draft and target must share one tokenizer")
    tt, dt = target.tokenizer, draft.tokenizer
    if (tt is None) != (dt is None) or (tt is not None and (len(tt) != len(dt) or tt.get_vocab() != dt.get_vocab())):
        raise ValueError("speculative_model: the draft's tokenizer differs from the target's (token ids would "
                         "mean different text); use a draft of the same model family")
    if draft.max_seq_len_to_capture < target.max_seq_len_to_capture:
        raise ValueError(f"speculative_model: the draft's context limit ({draft.max_seq_len_to_capture} tokens) is "
                         f"shorter than the target's max_seq_len_to_capture ({target.max_seq_len_to_capture})")


def check_before_build(target, req: SpeculativeRequest) -> None:
    """Fail fast, before the target is compiled: an :class:`LLM` draft is checked whole, a draft
    id/path by its config and tokenizer (vocabulary, tokenizer, context limit). ``target`` needs
    ``model_config``, ``tokenizer`` and ``max_seq_len_to_capture``."""
    from types import SimpleNamespace

    from .llm import LLM
    from .models.loader import load_model_info, load_tokenizer
    from .models.sources import resolve_model_source

    if req.is_ngram:
        if req.num_speculative_tokens is None and _n_predict(target.model_config) is None:
            raise ValueError("num_speculative_tokens is required with speculative_model='[ngram]' (the model "
                             "config has no n_predict)")
        return
    if isinstance(req.model, LLM):
        _require_k(req, req.model.model_config, target.model_config)
        check_compatible(target, req.model)
        return
    hf = dict(req.llm_kwargs.get("speculative_model_config") or {})
    info = load_model_info(resolve_model_source(str(req.model)), cache_dir=target.cache_dir, hf_overrides=hf)
    cfg = info.config
    _require_k(req, cfg, target.model_config)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    check_compatible(target, SimpleNamespace(model_config=cfg, tokenizer=load_tokenizer(info.model_dir),
                                             max_seq_len_to_capture=limit or target.max_seq_len_to_capture))


def _draft_runner(draft, owned: bool = False):
    """A model runner over the draft's executables with a KV cache and block manager of its own
    (an LLM draft that has an engine lends its compiled executables; nothing is compiled twice).
    A draft with rank workers that this target ``owned`` (built for it) lends its engine's runner:
    the ranks hold its KV cache, and its engine runs nothing else."""
    from runtime.block_manager import BlockManager, PagedKVCache
    from runtime.model_runner import ModelRunner

    if draft.__dict__.get("_workers") is not None:
        if not owned:
            raise NotImplementedError(
                "speculative_model: an LLM with rank workers (tensor/pipeline parallel) as the draft: its ranks hold "
                "one KV cache, which its own engine uses; pass the draft's path with "
                "speculative_draft_tensor_parallel_size / speculative_draft_pipeline_parallel_size instead")
        return draft.engine.runner
    if draft.engine is None:
        from .build import start_engine

        return start_engine(draft.geometry, draft._build, prefill_buckets=draft._prefill_buckets,
                            decode_buckets=draft._decode_buckets, scheduler_config=draft.scheduler_config,
                            kv=draft.kv_cache_plan, device=draft._device, tokenizer=None,
                            eos_token_ids=frozenset(), max_context=draft.max_seq_len_to_capture).runner
    g, kv = draft.geometry, draft.kv_cache_plan
    cache = PagedKVCache(g.num_layers, kv.num_blocks, kv.block_size, g.num_kv_heads, g.head_dim, g.dtype,
                         draft._device)
    blocks = BlockManager(kv.num_blocks, kv.block_size, kv.max_seqs, kv.max_blocks_per_seq)
    return ModelRunner(draft.engine.runner.executables, cache, blocks, draft._device)


def attach(target, req: SpeculativeRequest) -> None:
    """Build the proposer and install the engine's speculator (``target.engine`` may be None)."""
    from runtime.proposers import DraftModelProposer, NgramProposer
    from runtime.speculative import SpeculativeConfig, SpeculativeDecoder

    if req.is_ngram:
        draft = None
        k = req.num_speculative_tokens or _n_predict(target.model_config)
        if k is None:
            raise ValueError("num_speculative_tokens is required with speculative_model='[ngram]' (the model "
                             "config has no n_predict)")
    else:
        draft = build_draft(target, req)
        check_compatible(target, draft)
        _require_k(req, draft.model_config, target.model_config)
        k = req.num_speculative_tokens or _n_predict(draft.model_config, target.model_config)
    target.speculative_llm = draft
    target.num_speculative_tokens = k
    target._speculative_ngram = "[ngram]:%d:%d" % _ngram_sizes(req.model) if req.is_ngram else None  # for artifacts
    if req.is_parallel_draft:
        target._owned_draft = draft  # shut down with the target (its rank workers)
    # data-parallel replicas: a speculator each (a draft runner with its own KV cache per replica)
    engines = [] if target.engine is None else list(getattr(target.engine, "replicas", [target.engine]))
    if req.is_parallel_draft and len(engines) > 1:
        from .llm import _later

        raise _later(f"a tensor/pipeline-parallel draft with data_parallel_size={len(engines)} (one rank-worker "
                     "group serves one replica's draft)", "speculative-decoding issue")
    for engine in engines:
        proposer = NgramProposer(*_ngram_sizes(req.model)) if req.is_ngram else \
            DraftModelProposer(_draft_runner(draft, owned=req.is_parallel_draft))
        engine.speculator = SpeculativeDecoder(proposer, SpeculativeConfig(k))
