"""SmoothQuant (Xiao et al., 2023) for W8A8: move activation outliers into the weights before quantizing.

Per input channel j of a matmul (group) reading one input::

    s_j = max|X_j|^α / max|W_j|^(1−α)      (α = ``smoothquant_alpha``, default 0.5, in (0, 1])

with ``max|X_j|`` over the calibration tokens (windows of the calibration half of ``pydoc_data.topics``,
:func:`fxcompiler.calibration.calibration_samples`, as GPTQ's) and ``max|W_j|`` over the group's weight
columns. The weight columns are multiplied by ``s`` and ``1/s`` is folded into what produces the input, so the
float function is unchanged (up to fp32 rounding) while the per-token int8 activation grid sees flatter
channels. Per Llama-style decoder layer (llama, qwen2, mistral: ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, RMSNorm weights):

* q/k/v (one input, one factor): ``1/s`` into ``input_layernorm``'s weight;
* gate/up: ``1/s`` into ``post_attention_layernorm``'s weight;
* o_proj (no norm before it): ``1/s`` into v_proj's output rows (and bias). The attention output channel
  ``(h, d)`` is a mix of v channel ``(h // group, d)`` only, so the factor is shared by the query heads of one
  KV head (GQA): its activation and weight maxima are taken over those heads;
* down_proj (no norm before it): ``1/s`` into up_proj's output rows (and bias): ``act(gate)·(up/s) = (act(gate)·up)/s``.

The factors are computed from the original model (its calibration maxima and weights) and then applied
together; each is exact in real arithmetic, so their order does not matter. Other layouts raise
``NotImplementedError`` naming what is missing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SmoothGroup", "check_alpha", "collect_input_absmax", "smooth_groups", "smooth_model",
           "smoothing_factors"]

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class SmoothGroup:
    """Linear ``modules`` (transformers' names) reading one input, produced by ``source``: an RMSNorm
    (``kind="norm"``: its weight is divided by ``s``) or a linear (``kind="linear"``: its output rows are;
    ``kv_group`` > 1: the attention's query heads per KV head, ``head_dim`` its head size)."""

    source: str
    modules: tuple[str, ...]
    kind: str = "norm"
    kv_group: int = 1
    head_dim: int = 0


def check_alpha(alpha: float) -> float:
    """``alpha`` as a float, or ``ValueError`` naming the option when it is not a number in (0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"smoothquant_alpha (--smoothquant-alpha) must be a number in (0, 1], got {alpha!r}")
    return float(alpha)


def smooth_groups(model: torch.nn.Module, fold_into_linear: bool = True) -> list[SmoothGroup]:
    """The smoothing groups of every decoder layer of a Llama-style model (see the module docstring;
    ``fold_into_linear=False``: the two norm groups only)."""
    mods = dict(model.named_modules())
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", "?")
    layers = sorted({n.rsplit(".self_attn", 1)[0] for n in mods if n.endswith(".self_attn")})
    if not layers:
        raise NotImplementedError(f"SmoothQuant (--algorithm smoothquant): model type {mtype!r} has no Llama-style "
                                  "decoder layers (self_attn with q/k/v/o_proj, mlp with gate/up/down_proj, RMSNorm)")
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    out = []
    for layer in layers:
        specs = [("input_layernorm", _ATTN), ("post_attention_layernorm", _MLP)]
        names = [f"{layer}.{n}" for n in ("input_layernorm", "post_attention_layernorm", *_ATTN, *_MLP)]
        if fold_into_linear:
            names += [f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"]
        missing = [n for n in names if n not in mods]
        if missing:
            raise NotImplementedError(f"SmoothQuant (--algorithm smoothquant): {missing[0]!r} is missing in model "
                                      f"type {mtype!r} (Llama-style decoder layers only)")
        for norm, group in specs:
            nmod = mods[f"{layer}.{norm}"]
            if isinstance(getattr(nmod, "bias", None), torch.Tensor) or not isinstance(getattr(nmod, "weight", None),
                                                                                        torch.Tensor):
                raise NotImplementedError(f"SmoothQuant (--algorithm smoothquant): {layer}.{norm} is not an RMSNorm "
                                          "with a weight only")
            out.append(SmoothGroup(f"{layer}.{norm}", tuple(f"{layer}.{n}" for n in group)))
        if fold_into_linear:
            if not heads or not head_dim or heads % kv_heads:
                raise NotImplementedError(f"SmoothQuant: model type {mtype!r} has no num_attention_heads / "
                                          "num_key_value_heads / head_dim to fold o_proj's factor into v_proj")
            out.append(SmoothGroup(f"{layer}.self_attn.v_proj", (f"{layer}.self_attn.o_proj",), "linear",
                                   heads // kv_heads, head_dim))
            out.append(SmoothGroup(f"{layer}.mlp.up_proj", (f"{layer}.mlp.down_proj",), "linear"))
    return out


@torch.no_grad()
def collect_input_absmax(model: torch.nn.Module, samples: list[torch.Tensor], modules: list[str]
                         ) -> dict[str, torch.Tensor]:
    """``max |x_j|`` over every calibration token of each module's input (fp32 ``[K]``)."""
    mods = dict(model.named_modules())
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            amax[name] = torch.maximum(amax[name], x) if name in amax else x
        return fn

    handles = [mods[m].register_forward_pre_hook(hook(m)) for m in modules]
    try:
        for ids in samples:
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return amax


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                      kv_group: int = 1, head_dim: int = 0) -> torch.Tensor:
    """``s_j = max|X_j|^α / max|W_j|^(1−α)`` (fp32 ``[K]``); 1 where a channel is all zero (in X or W).
    ``kv_group > 1``: channels ``(h, d)`` of heads ``h`` sharing a KV head get one factor (maxima over them)."""
    alpha = check_alpha(alpha)
    w_amax = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    a = act_absmax.float()
    if a.shape != w_amax.shape:
        raise ValueError(f"SmoothQuant: activation max has {tuple(a.shape)} channels, the weights "
                         f"{tuple(w_amax.shape)}")
    if kv_group > 1:
        k = a.shape[0]
        if k % (kv_group * head_dim):
            raise ValueError(f"SmoothQuant: {k} channels are not heads of {head_dim} in groups of {kv_group}")
        shape = (k // (kv_group * head_dim), kv_group, head_dim)
        a = a.reshape(shape).amax(1, keepdim=True).expand(shape).reshape(k)
        w_amax = w_amax.reshape(shape).amax(1, keepdim=True).expand(shape).reshape(k)
    ok = (a > 0) & (w_amax > 0)
    s = a.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1.0 - alpha)
    s = torch.where(ok & torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return s.clamp(min=1e-5, max=1e5).contiguous()


@torch.no_grad()
def smooth_model(model: torch.nn.Module, samples: list[torch.Tensor], alpha: float = 0.5,
                 fold_into_linear: bool = True) -> dict[str, torch.Tensor]:
    """Smooth ``model`` in place; returns ``{linear module name: s [K]}`` for every smoothed module (the
    modules of one group share their factor)."""
    alpha = check_alpha(alpha)
    groups = smooth_groups(model, fold_into_linear)
    mods = dict(model.named_modules())
    amax = collect_input_absmax(model, samples, [m for g in groups for m in g.modules])
    todo = [(g, smoothing_factors(amax[g.modules[0]], [mods[m].weight for m in g.modules], alpha, g.kv_group,
                                  g.head_dim)) for g in groups]
    factors: dict[str, torch.Tensor] = {}
    for g, s in todo:
        src = mods[g.source]
        if g.kind == "norm":
            src.weight.div_(s.to(src.weight.dtype))
        else:
            rows = s
            if g.kv_group > 1:  # o_proj's channels (h, d) -> v_proj's rows (h // group, d)
                rows = s.reshape(-1, g.kv_group, g.head_dim)[:, 0, :].reshape(-1)
            if src.weight.shape[0] != rows.shape[0]:
                raise ValueError(f"SmoothQuant: {g.source} has {src.weight.shape[0]} output rows, "
                                 f"{g.modules[0]} {rows.shape[0]} smoothed input channels")
            src.weight.div_(rows.to(src.weight.dtype)[:, None])
            if getattr(src, "bias", None) is not None:
                src.bias.div_(rows.to(src.bias.dtype))
        for m in g.modules:
            mods[m].weight.mul_(s.to(mods[m].weight.dtype)[None, :])
            factors[m] = s.clone()
    return factors
