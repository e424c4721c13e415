"""Capture a transformers causal LM with ``torch.export`` into an ATen-level FX graph.

The real transformers model runs under ``torch.export(strict=False)`` with its
attention routed through ``fxc::paged_attention`` (one node per layer). The program
is exported once with dynamic batch, token, block-table, logits-row and cache-size
dims, in the training IR (no functionalisation, so cache writes stay in place), and
then specialised per bucket by the pipeline builder. Parameters and buffers are
lifted to graph inputs; the output is the logits of the rows named by ``logits_indices``
(the ``logits_slice`` pass makes only those rows reach ``lm_head``).

Graph inputs (after the lifted parameters), in this order:
``input_ids[B,T] i64, position_ids[B,T] i64, k_cache_0..L-1, v_cache_0..L-1,
block_table[B,MB] i64, slot_mapping[B,T] i64, seq_lens[B] i64, logits_indices[N] i64``;
output: ``logits[N, vocab]``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
from torch.export import Dim

from .models.attention import paged_inputs, use_paged_attention
from .models.moe import fxc_moe_blocks
from .models.rope import stateless_rope
from .models.support_check import check_attention_routed

log = logging.getLogger("fxcompiler.capture")

USER_INPUTS = ("input_ids", "position_ids", "k_caches", "v_caches", "block_table", "slot_mapping",
               "seq_lens", "logits_indices")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel",
    "Qwen3ForCausalLM", "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    # the rest of fxcompiler.model_zoo (tests/test_model_coverage.py)
    "GPTJForCausalLM", "Exaone4ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
    "StableLmForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
)


@dataclass(frozen=True)
class ModelGeometry:
    """What the runtime needs to know about the captured model to size its inputs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    max_position_embeddings: int


@dataclass(frozen=True)
class InputSpec:
    """One placeholder of a captured graph: a lifted parameter/buffer or a user input."""

    name: str  # placeholder name in the graph
    kind: str  # "param" | "user"
    target: str  # parameter FQN, or the user input name (k_cache_3, block_table, ...)


@dataclass
class CapturedProgram:
    """An ATen GraphModule whose placeholders are described by ``input_specs``."""

    graph_module: torch.fx.GraphModule
    input_specs: list[InputSpec]
    params: dict[str, torch.Tensor]  # FQN -> tensor, for every "param" spec
    geometry: ModelGeometry
    export_seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def user_inputs(self) -> list[str]:
        return [s.target for s in self.input_specs if s.kind == "user"]

    @property
    def param_names(self) -> list[str]:
        return [s.target for s in self.input_specs if s.kind == "param"]


class CaptureWrapper(torch.nn.Module):
    """Calls the base model with the paged-KV metadata, then lm_head on the selected rows."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.final_logit_softcapping = getattr(model.config, "final_logit_softcapping", None)
        self.logits_scaling = getattr(model.config, "logits_scaling", None)  # Granite divides the logits by it

    def forward(self, input_ids, position_ids, k_caches, v_caches, block_table, slot_mapping, seq_lens,
                logits_indices):
        paged = dict(fxc_k_caches=k_caches, fxc_v_caches=v_caches, fxc_block_table=block_table,
                     fxc_slot_mapping=slot_mapping, fxc_query_pos=position_ids, fxc_seq_lens=seq_lens)
        with paged_inputs(paged):  # for decoder layers that do not pass their kwargs on (StableLM)
            out = self.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **paged)
        hidden = out[0]
        # Logits of every row, then the sampled ones: the ``logits_slice`` pass moves the
        # selection in front of lm_head (and the final norm), so only those rows are computed.
        logits = self.model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1]))
        logits = logits.index_select(0, logits_indices)
        if self.logits_scaling and self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits


def model_geometry(model: torch.nn.Module) -> ModelGeometry:
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_layers = getattr(text_cfg, "num_hidden_layers", None) or getattr(text_cfg, "n_layer")
    n_heads = getattr(text_cfg, "num_attention_heads", None) or getattr(text_cfg, "n_head")
    n_kv = getattr(text_cfg, "num_key_value_heads", None) or n_heads
    hidden = getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd")
    head_dim = getattr(text_cfg, "head_dim", None) or hidden // n_heads
    max_pos = (getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
               or 1 << 20)
    dtype = next(model.parameters()).dtype
    return ModelGeometry(int(n_layers), int(n_kv), int(head_dim), int(text_cfg.vocab_size), dtype, int(max_pos))


def example_inputs(geometry: ModelGeometry, *, batch: int = 2, tokens: int = 3, blocks: int = 3,
                   block_size: int = 16, num_blocks: int = 8, rows: int = 2, device="cpu"):
    """Small, valid example inputs (sizes ≥ 2 so export does not specialise dims to 0/1)."""
    g = geometry
    cache_shape = (num_blocks, block_size, g.num_kv_heads, g.head_dim)
    k = [torch.zeros(cache_shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
    v = [torch.zeros(cache_shape, dtype=g.dtype, device=device) for _ in range(g.num_layers)]
    ids = torch.randint(0, g.vocab_size, (batch, tokens), device=device)
    pos = torch.arange(tokens, device=device).repeat(batch, 1)
    table = torch.arange(1, 1 + batch * blocks, device=device).remainder(num_blocks - 1).add(1).view(batch, blocks)
    slots = table[:, :1] * block_size + torch.arange(tokens, device=device)
    seq_lens = torch.full((batch,), tokens, dtype=torch.long, device=device)
    logits_idx = torch.arange(rows, device=device) * tokens + (tokens - 1)
    return (ids, pos, k, v, table, slots, seq_lens, logits_idx)


def _dynamic_shapes(num_layers: int):
    B = Dim("batch", min=1, max=8192)
    T = Dim("tokens", min=1, max=1 << 16)
    MB = Dim("table_blocks", min=1, max=1 << 16)
    NB = Dim("cache_blocks", min=2, max=1 << 24)
    N = Dim("logit_rows", min=1, max=1 << 20)
    cache = [{0: NB} for _ in range(num_layers)]
    return {
        "input_ids": {0: B, 1: T}, "position_ids": {0: B, 1: T},
        "k_caches": cache, "v_caches": [dict(c) for c in cache],
        "block_table": {0: B, 1: MB}, "slot_mapping": {0: B, 1: T},
        "seq_lens": {0: B}, "logits_indices": {0: N},
    }


def check_architecture(model: torch.nn.Module) -> None:
    name = type(model).__name__
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise NotImplementedError(f"{name}: only causal language models with an output embedding can be captured")
    if name not in SUPPORTED_ARCHITECTURES:
        log.warning("%s is not in the tested architecture list %s; capture will be attempted",
                    name, SUPPORTED_ARCHITECTURES)


def capture(model: torch.nn.Module, *, block_size: int = 16, moe_op: bool = True) -> CapturedProgram:
    """Export ``model`` (a transformers causal LM) into a :class:`CapturedProgram` (``moe_op``: recognised
    MoE blocks as one ``fxc::moe`` node each, else transformers' ``batched_mm`` experts)."""
    check_architecture(model)
    previous = model.config._attn_implementation
    previous_experts = getattr(model.config, "_experts_implementation", None)
    use_paged_attention(model)
    if previous_experts is not None:
        # Exportable in every dtype (grouped_mm has no fp64 CPU kernel), and it gathers only the
        # selected experts' weights per token.
        model.set_experts_implementation("batched_mm")
    try:
        geometry = model_geometry(model)
        wrapper = CaptureWrapper(model).eval()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        args = example_inputs(geometry, block_size=block_size, device=device)  # on the model's device
        t0 = time.perf_counter()
        moe_blocks = fxc_moe_blocks(model) if moe_op else contextlib.nullcontext(0)
        with torch.no_grad(), stateless_rope(model), moe_blocks:
            ep = torch.export.export(wrapper, args, dynamic_shapes=_dynamic_shapes(geometry.num_layers),
                                     strict=False)
    finally:
        model.set_attn_implementation(previous)  # leave the user's model as it was
        if previous_experts is not None:
            model.set_experts_implementation(previous_experts)
    seconds = time.perf_counter() - t0
    check_attention_routed(model, ep.graph_module, geometry.num_layers)
    log.info("exported %s in %.1fs (%d nodes)", type(model).__name__, seconds, len(ep.graph.nodes))
    return _from_exported_program(ep, geometry, seconds)


def _user_input_names(num_layers: int) -> list[str]:
    return (["input_ids", "position_ids"] + [f"k_cache_{i}" for i in range(num_layers)]
            + [f"v_cache_{i}" for i in range(num_layers)]
            + ["block_table", "slot_mapping", "seq_lens", "logits_indices"])


def _from_exported_program(ep, geometry: ModelGeometry, seconds: float) -> CapturedProgram:
    from torch.export.graph_signature import InputKind

    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_names = iter(_user_input_names(geometry.num_layers))
    specs: list[InputSpec] = []
    params: dict[str, torch.Tensor] = {}
    state = ep.state_dict
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            target = spec.target
            value = state[target] if target in state else ep.constants[target]
            specs.append(InputSpec(node.name, "param", target))
            params[target] = value.detach()
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            specs.append(InputSpec(node.name, "param", spec.target))
            params[spec.target] = ep.constants[spec.target].detach()
        elif spec.kind == InputKind.USER_INPUT:
            specs.append(InputSpec(node.name, "user", next(user_names)))
        else:
            raise NotImplementedError(f"unsupported exported input kind {spec.kind} for {node.name}")
    outputs = ep.graph_signature.output_specs
    if len(outputs) != 1:
        raise RuntimeError(f"expected one logits output, the export has {len(outputs)}: {outputs}")
    # Forget the export's pytree codegen: the graph is called with flat placeholders.
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    return CapturedProgram(gm, specs, params, geometry, seconds, {"nodes": len(gm.graph.nodes)})
