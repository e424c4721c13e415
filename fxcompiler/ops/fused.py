"""Fused elementwise ops the fusion passes target: ``fxc::rms_norm`` and ``fxc::silu_mul``.

Each has an ATen reference (the exact op sequence transformers emits, so results are
bit-identical wherever no device kernel is installed) and a fake kernel for export;
``backends/cpu`` installs C++ kernels for CPU tensors.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("silu_mul(Tensor gate, Tensor up) -> Tensor")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


_lib.impl("rms_norm", rms_norm_reference, "CompositeExplicitAutograd")
_lib.impl("silu_mul", silu_mul_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::rms_norm", lib=_lib)
def _rms_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("fxc::silu_mul", lib=_lib)
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


rms_norm = torch.ops.fxc.rms_norm.default
silu_mul = torch.ops.fxc.silu_mul.default
