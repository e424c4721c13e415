"""The ``LLM`` façade of the encoder tasks: ``LLM(model, task_type=...)`` for question answering, embeddings and
scoring, and the methods ``bert_forward`` (furiosa), ``embed`` and ``score`` (vLLM).

``init_encoder`` is what ``LLM.__init__`` runs for an encoder task: it loads the task's model, builds it
(:mod:`fxcompiler.encoder_build`: capture → passes → blockwise fx supertasks, no KV cache) and starts an
:class:`runtime.encoder_runner.EncoderRunner` over the fx executable. Options that belong to generation
(speculative decoding, beams, chunked prefill, parallelism, quantisation, artifacts, ``dfg``/``edf``)
raise ``NotImplementedError`` naming the option.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .encoder_tasks import (EMBED, QA, SCORE, ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                            EmbeddingRequestOutput, PoolerConfig, PoolingParams, QuestionAnsweringOutput,
                            ScoringOutput, ScoringRequestOutput, sentence_transformers_pooling)
from .outputs import CompletionOutput, RequestOutput

_DEFAULT_MAX_SEQ_LEN = 2048  # LLM's max_seq_len_to_capture default: an encoder then takes its model's maximum

# LLM arguments an encoder task does not build, with the value that means "not asked for"
_GENERATION_ONLY = {
    "speculative_model": None, "num_speculative_tokens": None, "kv_cache_sharing_across_beams_config": None,
    "prefill_chunk_size": None, "qformat_path": None, "qparam_path": None, "quant_ckpt_file_path": None,
    "artifacts_export_path": None, "param_file_path": None, "auto_bfloat16_cast": None,
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": None,
    "num_blocks_per_pp_stage": None, "enable_chunked_prefill": None, "max_num_batched_tokens": None,
    "keep_gguf_quantization": False, "quantize_lm_head": False, "quantization_group_size": None,
}


@dataclass(repr=False)
class QARequestOutput(RequestOutput):
    """furiosa's ``bert_forward`` result (a ``RequestOutput`` whose completion is the answer span's text and
    token ids) with the span and the start/end logits in ``answer``."""

    answer: QuestionAnsweringOutput | None = None


@dataclass
class EncoderState:
    task: str
    runner: Any  # runtime.encoder_runner.EncoderRunner, or None with skip_engine
    pooler: PoolerConfig
    activation: str  # scoring: "sigmoid" | "identity" | "tanh"


def _check_supported(args: dict, task: str) -> None:
    for name, unset in _GENERATION_ONLY.items():
        value = args.get(name, unset)
        if value in (unset, None, False) or (name.endswith("parallel_size") and value == 1):
            continue
        raise NotImplementedError(f"{name}={value!r} with task {task!r}: encoder tasks are built in one "
                                  "process, unquantised, as fx supertasks, with no KV cache; this option "
                                  "belongs to text generation")
    llm_config = args.get("llm_config")
    if llm_config is not None and getattr(llm_config, "quantization_config", None) is not None:
        raise NotImplementedError(f"llm_config.quantization_config with task {task!r}: encoder tasks are "
                                  "not quantised")
    if args.get("comp_supertask_kind") not in (None, "fx"):
        raise NotImplementedError(f"comp_supertask_kind={args['comp_supertask_kind']!r} with task {task!r}: "
                                  "encoder tasks are built as fx supertasks only")


def _max_len(config, args: dict) -> int:
    from .encoder_capture import max_tokens

    limit = max_tokens(config)
    cap = args.get("max_seq_len_to_capture", _DEFAULT_MAX_SEQ_LEN)
    if cap > limit:
        if cap != _DEFAULT_MAX_SEQ_LEN:
            raise ValueError(f"max_seq_len_to_capture={cap} exceeds what the model's max_position_embeddings="
                             f"{config.max_position_embeddings} holds ({limit} tokens)")
        cap = limit
    prompt = args.get("max_prompt_len")
    if prompt is not None:
        if prompt > cap:
            raise ValueError(f"max_prompt_len={prompt} exceeds max_seq_len_to_capture={cap}")
        cap = prompt
    return cap


def _buckets(bucket_config, cap: int):
    from .config import DefaultBucketConfig, ManualBucketConfig, MinimalBucketConfig
    from .pipeline import Bucket

    if isinstance(bucket_config, ManualBucketConfig):
        buckets = [Bucket.prefill(b, a) for b, a in bucket_config.prefill_buckets]
        too_long = [b.attention_size for b in buckets if b.attention_size > cap]
        if too_long:
            raise ValueError(f"bucket_config has prefill buckets of attention {too_long}, longer than the "
                             f"model accepts ({cap} tokens)")
    elif isinstance(bucket_config, MinimalBucketConfig):
        buckets = [Bucket.prefill(1, min(cap, bucket_config.max_seq_len))]
    else:
        buckets = DefaultBucketConfig().buckets(cap, cap)[0]
    if not buckets:
        raise ValueError("bucket_config has no prefill buckets: an encoder task runs in (batch, attention) "
                         "prefill buckets")
    return buckets


def _activation(config) -> str:
    """vLLM's cross-encoder activation: the sentence-transformers one the config names, else sigmoid."""
    name = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(config, "sbert_ce_default_activation_function", None)
    if name is None:
        return "sigmoid"
    for key in ("identity", "sigmoid", "tanh"):
        if str(name).lower().endswith(key):
            return key
    raise NotImplementedError(f"cross-encoder activation {name!r}: only Identity, Sigmoid and Tanh are built")


def init_encoder(llm, task: str, args: dict) -> None:
    """Build ``llm`` (an ``LLM`` being constructed) for the encoder ``task``; ``args`` are its constructor's."""
    from .encoder_build import build_encoder, check_task_model, load_task_model
    from .models.loader import load_config, load_tokenizer, model_directory, parse_dtype
    from .models.sources import resolve_model_source

    _check_supported(args, task)
    pooler = args.get("override_pooler_config")
    if pooler is not None and not isinstance(pooler, PoolerConfig):
        raise TypeError(f"override_pooler_config must be a PoolerConfig, got {type(pooler).__name__}")
    if pooler is not None and task != EMBED:
        raise ValueError(f"override_pooler_config is for embedding models (task_type='embed'), not {task!r}")
    seed = args.get("seed")
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    llm.seed = seed
    cache_dir = args.get("cache_dir")
    llm.cache_dir = Path(cache_dir) if cache_dir is not None else None
    if llm.cache_dir is not None:
        from .integrity import check_private_dir

        check_private_dir(llm.cache_dir)
    source = resolve_model_source(args["model"])
    model_dir = model_directory(source, llm.cache_dir)
    trust = bool(args.get("trust_remote_code", False))
    config = load_config(model_dir, args.get("hf_overrides") or {}, trust)
    check_task_model(config, task)
    llm.model_id = source.model_id
    llm.model_config = config
    llm.generation_config = None
    llm.tokenizer = load_tokenizer(model_dir, args.get("tokenizer"), args.get("tokenizer_mode", "auto"), trust)
    llm.task = task
    llm.is_generative_model = False
    llm.comp_supertask_kind = "fx"
    llm.use_blockwise_compile = args.get("use_blockwise_compile", True)
    llm.num_blocks_per_supertask = args.get("num_blocks_per_supertask", 1)
    llm.scheduler_config = args.get("scheduler_config")
    llm.artifact_id = args.get("_artifact_id", "NO_ARTIFACT_ID")
    llm.engine, llm.kv_cache_plan, llm.parallel_plan, llm._workers = None, None, None, None
    llm.speculative_llm, llm.num_speculative_tokens = None, None
    cap = _max_len(config, args)
    llm.max_seq_len_to_capture = llm.prompt_max_seq_len = cap
    llm.buckets = _buckets(args.get("bucket_config"), cap)
    model = load_task_model(model_dir, config, task, dtype=parse_dtype(args.get("dtype", "auto")),
                            use_random_weight=bool(args.get("use_random_weight")), seed=seed, trust_remote_code=trust)
    options = dict(args.get("compiler_config_overrides") or {})
    if args.get("embed_all_constants_into_graph"):
        options["embed_all_constants_into_graph"] = True
    if args.get("do_decompositions_for_model_rewrite"):
        options["do_decompositions_for_model_rewrite"] = True
    options.update(use_blockwise_compile=llm.use_blockwise_compile, num_blocks_per_supertask=llm.num_blocks_per_supertask)
    build = build_encoder(model, task, llm.model_id, llm.buckets, device=llm._device, options=options)
    del model
    llm._build = build
    llm.geometry = build.geometry
    llm.pipelines = build.pipelines
    llm.pipelines_with_meta = [(p, {"output_logits_size": 0}) for p in llm.pipelines]
    llm.build_info = build.info
    if task == EMBED:
        from .encoder_capture import is_encoder_family

        default = PoolerConfig("CLS" if is_encoder_family(config) else "LAST", True)  # vLLM's defaults
        declared = sentence_transformers_pooling(model_dir)
        chosen = pooler or PoolerConfig()
        pooler = PoolerConfig(chosen.pooling_type or declared.pooling_type or default.pooling_type,
                              chosen.normalize if chosen.normalize is not None else
                              declared.normalize if declared.pooling_type is not None else default.normalize)
    else:
        pooler = PoolerConfig()
    runner = None
    if not args.get("skip_engine"):
        from backends import get_backend
        from runtime.encoder_runner import EncoderRunner

        pipe = build.pipelines[0]  # every bucket's pipeline shares these blobs: one executable serves them all
        exe = get_backend("fx", llm._device.type)(pipe, build.params, llm._device)
        order = [pipe.metadata["inputs"][name] for name in exe.user_inputs]
        runner = EncoderRunner(exe, build.geometry, llm.buckets, llm._device, order)
        runner.warm_up()
    llm._encoder = EncoderState(task, runner, pooler, _activation(config) if task == SCORE else "identity")


# -- requests ---------------------------------------------------------------------------------------------
def _state(llm, method: str, tasks: tuple[str, ...]) -> EncoderState:
    state = llm.__dict__.get("_encoder")
    task = state.task if state is not None else llm.__dict__.get("task", "text-generation")
    if state is None or task not in tasks:
        names = {QA: "task_type='question-answering' (a *ForQuestionAnswering checkpoint)",
                 EMBED: "task_type='embed' (an embedding model)",
                 SCORE: "task_type='score' (a *ForSequenceClassification cross-encoder)"}
        raise ValueError(f"LLM.{method} needs an LLM built with " + " or ".join(names[t] for t in tasks)
                         + f"; this LLM's task is {task!r}")
    if llm.__dict__.get("_shut_down"):
        raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new LLM")
    if state.runner is None:
        raise RuntimeError("this LLM was built with skip_engine=True; it has nothing to run with")
    return state


def _as_list(value, name: str) -> tuple[list, bool]:
    if isinstance(value, (str, dict)):
        return [value], True
    if isinstance(value, (list, tuple)) and value:
        return list(value), False
    raise TypeError(f"{name} must be a str, a {{'prompt_token_ids': [...]}} dict or a non-empty list of them")


def _encode_one(llm, prompt, pair=None) -> tuple[list[int], list[int] | None]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError("a dict prompt must hold 'prompt_token_ids'")
        ids = [int(t) for t in prompt["prompt_token_ids"]]
        types = prompt.get("token_type_ids")
        return ids, [int(t) for t in types] if types is not None else None
    if not isinstance(prompt, str):
        raise TypeError(f"prompts must be str or {{'prompt_token_ids': [...]}} dicts, got {type(prompt).__name__}")
    if llm.tokenizer is None:
        raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
    enc = llm.tokenizer(prompt, pair) if pair is not None else llm.tokenizer(prompt)
    types = enc.get("token_type_ids")
    return list(enc["input_ids"]), list(types) if types is not None else None


def _rows(llm, encoded: list[tuple[list[int], list[int] | None]], pooling: list[str | None] | None = None):
    from runtime.encoder_runner import EncoderRow

    # segment ids where the model has more than one (XLM-R's single token type: zeros, whatever the tokenizer says)
    wants_types = "token_type_ids" in llm.geometry.inputs and llm.geometry.type_vocab_size > 1
    return [EncoderRow(ids, types if wants_types else None, pooling[i] if pooling else None)
            for i, (ids, types) in enumerate(encoded)]


def _pooled(llm, state: EncoderState, prompts: list, params: list[PoolingParams]) -> tuple[list, list[torch.Tensor]]:
    encoded = [_encode_one(llm, p) for p in prompts]
    pooling = [p.pooling_type or state.pooler.pooling_type for p in params]
    return encoded, state.runner.run(_rows(llm, encoded, pooling))


def embed(llm, prompts, pooling_params=None) -> list[EmbeddingRequestOutput]:
    """vLLM's ``LLM.embed``: one :class:`EmbeddingRequestOutput` per prompt (``.outputs.embedding``)."""
    state = _state(llm, "embed", (EMBED,))
    items, _ = _as_list(prompts, "prompts")
    if pooling_params is None:
        params = [PoolingParams()] * len(items)
    elif isinstance(pooling_params, PoolingParams):
        params = [pooling_params] * len(items)
    elif isinstance(pooling_params, (list, tuple)) and all(isinstance(p, PoolingParams) for p in pooling_params):
        if len(pooling_params) != len(items):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(items)} prompts")
        params = list(pooling_params)
    else:
        raise TypeError("pooling_params must be a PoolingParams or a list of them")
    encoded, pooled = _pooled(llm, state, items, params)
    outs = []
    for prompt, (ids, _), vec, p in zip(items, encoded, pooled, params):
        if p.dimensions is not None:
            if p.dimensions > vec.shape[-1]:
                raise ValueError(f"PoolingParams.dimensions={p.dimensions} exceeds the hidden size {vec.shape[-1]}")
            vec = vec[:p.dimensions]
        if p.normalize if p.normalize is not None else state.pooler.normalize:
            vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
        outs.append(EmbeddingRequestOutput(uuid.uuid4().hex, EmbeddingOutput(vec.tolist()), ids,
                                           prompt=prompt if isinstance(prompt, str) else None))
    return outs


def _pairs(text_1, text_2) -> list[tuple[Any, Any]]:
    a, _ = _as_list(text_1, "text_1")
    b, _ = _as_list(text_2, "text_2")
    if len(a) == 1:
        return [(a[0], y) for y in b]
    if len(a) != len(b):
        raise ValueError(f"text_1 has {len(a)} texts and text_2 {len(b)}: give one text_1, or as many as text_2")
    return list(zip(a, b))


def score(llm, text_1, text_2) -> list[ScoringRequestOutput]:
    """vLLM's ``LLM.score``: a cross-encoder's relevance of each (text_1, text_2) pair (its activation on the
    classifier logit), or the cosine similarity of an embedding model's pooled vectors."""
    state = _state(llm, "score", (SCORE, EMBED))
    pairs = _pairs(text_1, text_2)
    outs = []
    if state.task == EMBED:
        left, right = [p[0] for p in pairs], [p[1] for p in pairs]
        params = [PoolingParams()] * (2 * len(pairs))
        encoded, pooled = _pooled(llm, state, left + right, params)
        n = len(pairs)
        for i in range(n):
            sim = torch.nn.functional.cosine_similarity(pooled[i], pooled[n + i], dim=-1)
            outs.append(ScoringRequestOutput(uuid.uuid4().hex, ScoringOutput(float(sim)),
                                             encoded[i][0] + encoded[n + i][0]))
        return outs
    if llm.geometry.num_labels != 1:
        raise ValueError(f"LLM.score needs a cross-encoder with one label; this model has num_labels="
                         f"{llm.geometry.num_labels} (LLM.classify gives its class probabilities)")
    encoded = []
    for a, b in pairs:
        if isinstance(a, dict) or isinstance(b, dict):
            raise TypeError("LLM.score of a cross-encoder takes text pairs (strings)")
        encoded.append(_encode_one(llm, a, b))
    logits = state.runner.run(_rows(llm, encoded))
    act = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "identity": lambda x: x}[state.activation]
    for (ids, _), logit in zip(encoded, logits):
        outs.append(ScoringRequestOutput(uuid.uuid4().hex, ScoringOutput(float(act(logit[0]))), ids))
    return outs


def classify(llm, prompts) -> list[ClassificationRequestOutput]:
    """vLLM's ``LLM.classify``: the class probabilities of each input of a ``*ForSequenceClassification``
    checkpoint (``task_type='score'``): softmax over its labels, or the model's activation on the one logit of a
    one-label model (as ``score``). ``prompts``: strings or ``{'prompt_token_ids': [...]}`` dicts."""
    state = _state(llm, "classify", (SCORE,))
    items, _ = _as_list(prompts, "prompts")
    encoded = [_encode_one(llm, p) for p in items]
    logits = state.runner.run(_rows(llm, encoded))
    act = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "identity": lambda x: x}[state.activation]
    outs = []
    for (ids, _), logit in zip(encoded, logits):
        probs = act(logit) if logit.shape[-1] == 1 else torch.softmax(logit.double(), dim=-1)
        outs.append(ClassificationRequestOutput(uuid.uuid4().hex, ClassificationOutput(probs.tolist()), ids))
    return outs


def _context_positions(llm, ids: list[int], types: list[int] | None, enc, i: int) -> list[int]:
    """Token positions of the context (the pair's second sequence), special tokens excluded."""
    seq_ids = None
    if enc is not None and hasattr(enc, "sequence_ids"):
        try:
            seq_ids = enc.sequence_ids(i)
        except (ValueError, AttributeError):  # a slow tokenizer
            seq_ids = None
    if seq_ids is not None:
        return [j for j, s in enumerate(seq_ids) if s == 1]
    special = set(llm.tokenizer.all_special_ids) if llm.tokenizer is not None else set()
    if types is not None and any(types):
        return [j for j, t in enumerate(types) if t == 1 and ids[j] not in special]
    return [j for j, t in enumerate(ids) if t not in special]


def best_span(start: torch.Tensor, end: torch.Tensor, positions: Sequence[int], max_answer_len: int) -> tuple[int, int, float]:
    """The (start, end) among ``positions`` (start <= end < start + max_answer_len) maximising
    ``start_logits[start] + end_logits[end]``; (0, 0) (the CLS token, "no answer") when there is none."""
    if not positions:
        return 0, 0, float(start[0] + end[0])
    pos = torch.tensor(list(positions))
    s, e = start[pos], end[pos]
    total = s[:, None] + e[None, :]
    dist = pos[None, :] - pos[:, None]
    total = total.masked_fill((dist < 0) | (dist >= max_answer_len), float("-inf"))
    flat = int(torch.argmax(total))
    i, j = divmod(flat, len(positions))
    return int(pos[i]), int(pos[j]), float(total[i, j])


def bert_forward(llm, prompts, contexts, max_answer_len: int = 30):
    """furiosa's ``bert_forward``: tokenise (question, context) pairs, run the QA model once over the batch and
    return a ``RequestOutput`` per pair whose completion is the best answer span (a str prompt gives one)."""
    state = _state(llm, "bert_forward", (QA,))
    if isinstance(max_answer_len, bool) or not isinstance(max_answer_len, int) or max_answer_len < 1:
        raise ValueError(f"max_answer_len must be a positive int, got {max_answer_len!r}")
    single = isinstance(prompts, str)
    qs, _ = _as_list(prompts, "prompts")
    cs, _ = _as_list(contexts, "contexts")
    if len(qs) != len(cs):
        raise ValueError(f"got {len(qs)} prompts and {len(cs)} contexts; bert_forward pairs them one to one")
    if not all(isinstance(x, str) for x in qs + cs):
        raise TypeError("bert_forward takes str prompts (questions) and str contexts")
    if llm.tokenizer is None:
        raise ValueError("bert_forward needs a tokenizer (this model has none): pass tokenizer=...")
    enc = llm.tokenizer(qs, cs)
    types_all = enc.get("token_type_ids")
    encoded = [(list(enc["input_ids"][i]), list(types_all[i]) if types_all is not None else None)
               for i in range(len(qs))]
    logits = state.runner.run(_rows(llm, encoded))
    outs = []
    for i, ((ids, types), out) in enumerate(zip(encoded, logits)):
        start, end = out[:, 0], out[:, 1]
        s, e, best = best_span(start, end, _context_positions(llm, ids, types, enc, i), max_answer_len)
        span = ids[s:e + 1] if (s, e) != (0, 0) else []
        text = llm.tokenizer.decode(span, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        outs.append(QARequestOutput(uuid.uuid4().hex, qs[i], ids, [CompletionOutput(0, text, span,
                                                                                     finish_reason="stop")],
                                    True, answer=QuestionAnsweringOutput(s, e, best, start.tolist(), end.tolist())))
    return outs[0] if single else outs


def describe(llm) -> str:
    return (f"LLM(model={llm.model_id!r}, task={llm.task!r}, device={llm._device}, buckets={len(llm.buckets)})")


__all__ = ["init_encoder", "embed", "score", "bert_forward", "best_span", "QARequestOutput"]
