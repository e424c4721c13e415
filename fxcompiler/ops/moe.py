"""``fxc::moe``: a mixture-of-experts block (router, top-k weights, expert MLPs) as one op.

    moe(hidden[T, H], router_weight[E, H], router_bias[E]?, gate_up[E, 2I, H] (or [E, H, 2I]),
        gate_up_bias[E, 2I]?, down[E, H, I] (or [E, I, H]), down_bias[E, H]?,
        top_k, scoring, normalize, fp32_weights, activation, transposed, alpha, limit) -> [T, H]

* ``scoring``: :data:`SOFTMAX_TOPK` (softmax over all experts in float32, then the top-k: Mixtral,
  Qwen3-MoE) or :data:`TOPK_SOFTMAX` (top-k of the logits, softmax over those: GPT-OSS);
  ``normalize`` divides the top-k weights by their sum; ``fp32_weights`` keeps them in float32
  (Mixtral) instead of casting back to the input dtype (Qwen3-MoE).
* ``activation``: :data:`SILU_GLU` (``[gate; up]`` halves, ``silu(gate) * up``) or
  :data:`CLAMPED_SWIGLU` (GPT-OSS: interleaved gate/up, clamped at ``limit``, ``(up + 1) * gate *
  sigmoid(alpha * gate)``); ``transposed``: expert weights stored ``[E, in, out]`` (GPT-OSS).

The ATen reference (every device, and what ``edf`` packages inline) is transformers' ``batched_mm``
experts: it gathers each (token, expert) pair's weights, so only the selected experts are read. The CPU
kernel loops over the experts that some token selected and multiplies their tokens with that expert's
weights only (one weight read per selected expert, whatever the expert count); for up to a backend's
``max_tokens`` tokens (decode, speculative verify) it hands the experts to the backend's C++ kernel
(``fxc::moe_experts_cpu``, installed by :func:`set_moe_kernel_loader`) after the ATen router and top-k.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

SOFTMAX_TOPK, TOPK_SOFTMAX = 0, 1
SILU_GLU, CLAMPED_SWIGLU = 0, 1

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("moe(Tensor hidden, Tensor router_weight, Tensor? router_bias, Tensor gate_up, Tensor? gate_up_bias, "
            "Tensor down, Tensor? down_bias, int top_k, int scoring, bool normalize, bool fp32_weights, "
            "int activation, bool transposed, float alpha=1.702, float limit=7.0) -> Tensor")


def route(hidden, router_weight, router_bias, top_k: int, scoring: int, normalize: bool, fp32_weights: bool):
    """``(weights[T, k], experts[T, k])`` exactly as transformers' routers compute them."""
    logits = torch.nn.functional.linear(hidden, router_weight, router_bias)
    if scoring == TOPK_SOFTMAX:
        top, idx = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), idx
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if fp32_weights else top.to(logits.dtype)), idx


def _gate(x, activation: int, alpha: float, limit: float):
    if activation == CLAMPED_SWIGLU:
        gate, up = x[..., ::2], x[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def moe_reference(hidden, router_weight, router_bias, gate_up, gate_up_bias, down, down_bias, top_k: int,
                  scoring: int, normalize: bool, fp32_weights: bool, activation: int, transposed: bool,
                  alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """transformers' ``batched_mm`` experts after its router: per (token, expert) pair, gathered weights."""
    weights, idx = route(hidden, router_weight, router_bias, top_k, scoring, normalize, fp32_weights)
    T, H = hidden.shape
    x = hidden.repeat_interleave(top_k, dim=0)
    e = idx.reshape(-1)

    def proj(inp, w, b):
        out = torch.bmm(inp.unsqueeze(1), w[e]).squeeze(1) if transposed else torch.bmm(w[e], inp.unsqueeze(-1)).squeeze(-1)
        return out if b is None else out + b[e]

    h = _gate(proj(x, gate_up, gate_up_bias), activation, alpha, limit)
    out = proj(h, down, down_bias) * weights.reshape(-1).unsqueeze(-1)
    return out.view(T, top_k, H).sum(dim=1).to(hidden.dtype)


_kernel: dict = {"loader": None, "max_tokens": 0}
# How often moe_cpu took each path in this process ("kernel": the C++ experts, "aten": grouped matmuls).
dispatch_counts = {"kernel": 0, "aten": 0}
_counts_lock = threading.Lock()


def set_moe_kernel_loader(loader: Callable[[], bool] | None, max_tokens: int = 0) -> None:
    """Install a backend's ``loader() -> bool`` (True: ``fxc::moe_experts_cpu`` is registered) and the
    largest token count that should run it."""
    _kernel["loader"], _kernel["max_tokens"] = loader, int(max_tokens)


def _count(path: str) -> None:
    with _counts_lock:
        dispatch_counts[path] += 1


def _use_kernel(hidden, gate_up) -> bool:
    loader = _kernel["loader"]
    return (loader is not None and hidden.shape[0] <= _kernel["max_tokens"] and hidden.dtype in _KERNEL_DTYPES
            and gate_up.dtype in _KERNEL_DTYPES and loader())


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def moe_cpu(hidden, router_weight, router_bias, gate_up, gate_up_bias, down, down_bias, top_k: int, scoring: int,
            normalize: bool, fp32_weights: bool, activation: int, transposed: bool, alpha: float = 1.702,
            limit: float = 7.0) -> torch.Tensor:
    """CPU kernel: the C++ experts for a few tokens, else one grouped matmul per *selected* expert over
    the tokens that chose it."""
    weights, idx = route(hidden, router_weight, router_bias, top_k, scoring, normalize, fp32_weights)
    if _use_kernel(hidden, gate_up):
        _count("kernel")
        gub = None if gate_up_bias is None else gate_up_bias.to(gate_up.dtype)
        db = None if down_bias is None else down_bias.to(gate_up.dtype)
        out = torch.ops.fxc.moe_experts_cpu(hidden.float(), weights.float(), idx, gate_up, gub, down.to(gate_up.dtype),
                                            db, activation, transposed, alpha, limit)
        return out.to(hidden.dtype)
    _count("aten")
    T, H = hidden.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // top_k
    w_of = weights.reshape(-1)[order]
    out = torch.zeros(T, H, dtype=torch.promote_types(hidden.dtype, weights.dtype), device=hidden.device)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        rows = token_of[start:start + count]
        x = hidden.index_select(0, rows)
        wu, wd = gate_up[expert], down[expert]
        h = x @ wu if transposed else x @ wu.t()
        if gate_up_bias is not None:
            h = h + gate_up_bias[expert]
        h = _gate(h, activation, alpha, limit)
        y = h @ wd if transposed else h @ wd.t()
        if down_bias is not None:
            y = y + down_bias[expert]
        out.index_add_(0, rows, y * w_of[start:start + count].unsqueeze(-1))
        start += count
    return out.to(hidden.dtype)


_lib.impl("moe", moe_reference, "CompositeExplicitAutograd")
_lib.impl("moe", moe_cpu, "CPU")


@torch.library.register_fake("fxc::moe", lib=_lib)
def _moe_fake(hidden, router_weight, router_bias, gate_up, gate_up_bias, down, down_bias, top_k, scoring, normalize,
              fp32_weights, activation, transposed, alpha=1.702, limit=7.0):
    return torch.empty_like(hidden)


moe = torch.ops.fxc.moe.default
