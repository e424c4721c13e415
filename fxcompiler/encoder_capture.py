"""Capture an encoder task (question answering, sequence scoring, pooled embeddings) with ``torch.export``.

The decoders' capture (:mod:`fxcompiler.capture`) routes attention through the paged KV cache; an encoder
task runs each request once, so there is no cache: transformers' attention interface is routed to
:func:`fxc_encoder_attention_forward` (registered as ``fxc_encoder``), which builds the padding mask of the
batch from ``seq_lens`` (keys past a row's length are masked), the causal mask for a decoder used as an
embedding model (``module.is_causal``), and a sliding window where the layer has one, then calls SDPA. The
model is exported once with dynamic batch and token dims (training IR, parameters lifted) and goes through
the same pass manager and blockwise supertasks as the decoders.

Graph inputs (after the lifted parameters), in this order, those the task has:
``input_ids[B,T] i64, token_type_ids[B,T] i64 (BERT-style families), seq_lens[B] i64,
pooling_weights[B,T] (embedding only)``; one output:

* question answering: ``[B, T, 2]`` (start, end logits of every token);
* scoring: ``[B, num_labels]`` (the classification head's logits);
* embedding: ``[B, H]`` = ``pooling_weights @ last_hidden_state`` per row. The runner sets the weights:
  CLS = one-hot at 0, LAST = one-hot at ``seq_len - 1``, MEAN = ``1 / seq_len`` on the real tokens, so one
  compiled graph serves every pooling.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass

import torch
from torch.export import Dim

from .capture import CapturedProgram, InputSpec, ModelGeometry
from .encoder_tasks import EMBED, ENCODER_FAMILIES, QA, SCORE

log = logging.getLogger("fxcompiler.capture")

ATTN_IMPLEMENTATION = "fxc_encoder"
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fxc_encoder_inputs", default=None)
_calls: contextvars.ContextVar[list | None] = contextvars.ContextVar("fxc_encoder_calls", default=None)


@dataclass(frozen=True)
class EncoderGeometry(ModelGeometry):
    """:class:`ModelGeometry` plus what the encoder runner needs: the task, the inputs the graph takes, the
    longest request it accepts and the id that pads."""

    task: str = EMBED
    inputs: tuple[str, ...] = ()
    max_tokens: int = 512
    pad_token_id: int = 0
    hidden_size: int = 0
    num_labels: int = 0
    type_vocab_size: int = 0


@contextlib.contextmanager
def encoder_inputs(seq_lens: torch.Tensor):
    """Within the block, ``fxc_encoder`` attention masks by ``seq_lens``."""
    token = _current.set({"seq_lens": seq_lens})
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def counting_attention_calls():
    """Yields a list that gets one entry per ``fxc_encoder`` attention call made within the block."""
    calls: list = []
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def fxc_encoder_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                  sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-interface signature: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``
    → ``[B, T, Hq, D]``. The mask comes from the ``seq_lens`` of the call in progress, not from
    ``attention_mask`` (transformers builds none for a custom implementation)."""
    state = _current.get()
    if state is None:
        raise RuntimeError(f"{type(module).__name__}: fxc_encoder attention called outside the encoder capture")
    calls = _calls.get()
    if calls is not None:
        calls.append(getattr(module, "layer_idx", None))
    seq_lens = state["seq_lens"]
    if softcap or s_aux is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention soft-capping / sinks are not built for "
                                  "encoder tasks")
    t = key.shape[-2]
    k_pos = torch.arange(t, device=query.device)
    mask = (k_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, T]: real keys
    if getattr(module, "is_causal", False):
        q_pos = torch.arange(query.shape[-2], device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < int(sliding_window))
        mask = mask & allowed[None, None]
    if key.shape[1] != query.shape[1]:  # grouped-query attention: repeat the kv heads (transformers' repeat_kv)
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=float(scaling))
    return out.transpose(1, 2).contiguous(), None


def register_encoder_attention() -> str:
    from .models.attention import register_attention_function

    return register_attention_function(ATTN_IMPLEMENTATION, fxc_encoder_attention_forward)


def is_encoder_family(config) -> bool:
    return getattr(config, "model_type", None) in ENCODER_FAMILIES and not getattr(config, "is_decoder", False)


def max_tokens(config) -> int:
    """The longest request the model's position table holds: RoBERTa-style models number positions from
    ``pad_token_id + 1`` (XLM-R's 514 positions hold 512 tokens)."""
    n = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 1 << 16)
    if getattr(config, "model_type", None) in ("roberta", "xlm-roberta"):
        n -= int(config.pad_token_id or 0) + 1
    return n


class EncoderWrapper(torch.nn.Module):
    """The task's forward over padded rows: the model (head included), then the task's output."""

    def __init__(self, model: torch.nn.Module, task: str, decoder: bool):
        super().__init__()
        self.model = model
        self.task = task
        self.decoder = decoder

    def forward(self, input_ids, token_type_ids, seq_lens, pooling_weights):
        kwargs = {"input_ids": input_ids}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        if self.decoder:
            kwargs["use_cache"] = False
        with encoder_inputs(seq_lens):
            out = self.model(**kwargs)
        if self.task == QA:
            return torch.stack([out.start_logits, out.end_logits], dim=-1)
        if self.task == SCORE:
            return out.logits
        hidden = out.last_hidden_state  # [B, T, H]
        return torch.bmm(pooling_weights.to(hidden.dtype).unsqueeze(1), hidden).squeeze(1)


def encoder_input_names(config, task: str) -> tuple[str, ...]:
    names = ["input_ids"]
    if is_encoder_family(config) and getattr(config, "type_vocab_size", 0):
        names.append("token_type_ids")
    names.append("seq_lens")
    if task == EMBED:
        names.append("pooling_weights")
    return tuple(names)


def encoder_geometry(model: torch.nn.Module, task: str) -> EncoderGeometry:
    cfg = model.config
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0))
    heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 1))
    layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0))
    pad = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    dtype = next(model.parameters()).dtype
    return EncoderGeometry(
        num_layers=layers, num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads), vocab_size=int(cfg.vocab_size),
        dtype=dtype, max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 0) or max_tokens(cfg)),
        task=task, inputs=encoder_input_names(cfg, task), max_tokens=max_tokens(cfg), pad_token_id=int(pad),
        hidden_size=hidden, num_labels=int(getattr(cfg, "num_labels", 0) or 0) if task == SCORE else 0,
        type_vocab_size=int(getattr(cfg, "type_vocab_size", 0) or 0))


def example_encoder_inputs(g: EncoderGeometry, *, batch: int = 2, tokens: int = 3, device="cpu") -> dict:
    """Small valid inputs (sizes >= 2 so export keeps the dims dynamic; rows of different lengths)."""
    lens = torch.tensor([tokens] + [max(1, tokens - 1)] * (batch - 1), device=device)
    out = {"input_ids": torch.randint(3, g.vocab_size, (batch, tokens), device=device),
           "token_type_ids": None, "seq_lens": lens, "pooling_weights": None}
    if "token_type_ids" in g.inputs:
        out["token_type_ids"] = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    if "pooling_weights" in g.inputs:
        real = torch.arange(tokens, device=device)[None, :] < lens[:, None]
        out["pooling_weights"] = real.to(g.dtype) / lens[:, None].to(g.dtype)
    return out


def capture_encoder(model: torch.nn.Module, task: str) -> CapturedProgram:
    """Export ``model`` (a transformers encoder with its task head, or a decoder's base model for
    embeddings) for ``task`` into a :class:`CapturedProgram` whose geometry is an :class:`EncoderGeometry`."""
    decoder = not is_encoder_family(model.config)
    geometry = encoder_geometry(model, task)
    previous = model.config._attn_implementation
    register_encoder_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args = example_encoder_inputs(geometry, device=device)
        B = Dim("batch", min=1, max=8192)
        T = Dim("tokens", min=1, max=max(2, geometry.max_tokens))
        shapes = {"input_ids": {0: B, 1: T}, "token_type_ids": {0: B, 1: T} if args["token_type_ids"] is not None
                  else None, "seq_lens": {0: B},
                  "pooling_weights": {0: B, 1: T} if args["pooling_weights"] is not None else None}
        wrapper = EncoderWrapper(model, task, decoder).eval()
        t0 = time.perf_counter()
        from .models.rope import stateless_rope

        with torch.no_grad(), stateless_rope(model), counting_attention_calls() as calls:
            ep = torch.export.export(wrapper, (), kwargs=args, dynamic_shapes=shapes, strict=False)
    finally:
        model.set_attn_implementation(previous)
    seconds = time.perf_counter() - t0
    _check_attention_routed(model, len({c for c in calls if c is not None}) or len(calls), geometry.num_layers)
    log.info("exported %s (%s) in %.1fs (%d nodes)", type(model).__name__, task, seconds, len(ep.graph.nodes))
    return _program(ep, geometry, seconds)


def _check_attention_routed(model, routed: int, num_layers: int) -> None:
    from .models.support_check import UnsupportedModelError

    if routed < num_layers:
        raise UnsupportedModelError(f"{type(model).__name__}: only {routed} of {num_layers} layers' attention went "
                                    "through transformers' attention interface (a custom attention)")


def _program(ep, geometry: EncoderGeometry, seconds: float) -> CapturedProgram:
    from torch.export.graph_signature import InputKind

    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_names = iter(geometry.inputs)
    specs: list[InputSpec] = []
    unused = []
    params: dict[str, torch.Tensor] = {}
    state = ep.state_dict
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = state[spec.target] if spec.target in state else ep.constants[spec.target]
            specs.append(InputSpec(node.name, "param", spec.target))
            params[spec.target] = value.detach()
        elif spec.kind == InputKind.USER_INPUT:
            if spec.arg.name not in geometry.inputs:  # an input the task passes as None (export keeps a placeholder)
                if node.users:
                    raise RuntimeError(f"the captured graph reads {spec.arg.name}, which task {geometry.task} lacks")
                unused.append(node)
                continue
            specs.append(InputSpec(node.name, "user", next(user_names)))
        else:
            raise NotImplementedError(f"unsupported exported input kind {spec.kind} for {node.name}")
    if len(ep.graph_signature.output_specs) != 1:
        raise RuntimeError(f"expected one output, the export has {ep.graph_signature.output_specs}")
    for node in unused:
        gm.graph.erase_node(node)
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    return CapturedProgram(gm, specs, params, geometry, seconds, {"nodes": len(gm.graph.nodes), "task": geometry.task})
