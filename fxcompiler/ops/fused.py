"""Fused elementwise ops the fusion passes target: ``fxc::rms_norm``, ``fxc::silu_mul`` and
``fxc::rope`` (rotary position embedding as transformers' ``apply_rotary_pos_emb`` computes it).

Each has an ATen reference (the exact op sequence transformers emits, so results are
bit-identical wherever no device kernel is installed) and a fake kernel for export;
``backends/cpu`` installs C++ kernels for CPU tensors.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("silu_mul(Tensor gate, Tensor up) -> Tensor")
_lib.define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in (torch.bfloat16, torch.float16):
        # transformers' RMSNorm in a bf16/fp16 model: the variance in fp32, the normalised value cast back
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with rotate_half(x) = cat(-x[..., h:], x[..., :h])."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


_lib.impl("rms_norm", rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("rope", rope_reference, "CompositeExplicitAutograd")
_lib.impl("silu_mul", silu_mul_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::rms_norm", lib=_lib)
def _rms_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("fxc::silu_mul", lib=_lib)
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


@torch.library.register_fake("fxc::rope", lib=_lib)
def _rope_fake(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


rms_norm = torch.ops.fxc.rms_norm.default
rope = torch.ops.fxc.rope.default
silu_mul = torch.ops.fxc.silu_mul.default
