"""Definition of the ``fxc`` operators: schema, fake kernels and ATen fallback.

The schemas are defined here with ``torch.library`` (so ``torch.export`` sees each
op as one node with a fake kernel, without compiling anything).  Two
implementations exist for CPU tensors:

* the C++ kernels in ``csrc/`` registered by the JIT-built library under the
  ``CPU`` dispatch key (``TORCH_LIBRARY_IMPL(fxc, CPU, m)``), called directly by
  the dispatcher with no Python on the way;
* this module's ``CompositeExplicitAutograd`` implementation, which is what runs
  until the library is loaded: on its first call it builds/loads the library and
  re-dispatches (from then on the ``CPU`` kernel has precedence), or, when the
  build is impossible, computes the result with ATen (dequantise/unpack, then
  ``F.linear`` in fp32).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import _build
from .packing import NB, dequantize_linear_weight_int8, unpack_linear_weight

# FRAGMENT: the fxc namespace is shared with other fxcompiler ops (fxc::paged_attention).
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor w_packed, Tensor? bias, int n) -> Tensor")
_lib.define("linear_w8(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size) -> Tensor")


def _out_shape(x: torch.Tensor, n: int):
    return tuple(x.shape[:-1]) + (n,)


def _check_linear(x, w, n):
    k = x.shape[-1]
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear: x dtype {x.dtype}")
    if w.dtype == torch.float32:
        torch._check(w.dim() == 3 and w.shape[1] == k and w.shape[2] == NB,
                     lambda: f"fxc::linear: fp32 packed weight must be [P, K={k}, 32], got {tuple(w.shape)}")
    elif w.dtype == torch.bfloat16:
        torch._check(w.dim() == 4 and w.shape[1] == (k + 1) // 2 and w.shape[2] == NB and w.shape[3] == 2,
                     lambda: f"fxc::linear: bf16 packed weight must be [P, ceil(K/2), 32, 2], got {tuple(w.shape)}")
    else:
        torch._check(False, lambda: f"fxc::linear: packed weight dtype {w.dtype}")
    torch._check(n <= w.shape[0] * NB, lambda: f"fxc::linear: n={n} larger than the packed panels")


@torch.library.register_fake("fxc::linear", lib=_lib)
def _linear_fake(x, w_packed, bias, n):
    _check_linear(x, w_packed, n)
    return x.new_empty(_out_shape(x, n))


@torch.library.register_fake("fxc::linear_w8", lib=_lib)
def _linear_w8_fake(x, w_int8_packed, scales, bias, n, group_size):
    torch._check(w_int8_packed.dtype == torch.int8 and w_int8_packed.dim() == 3,
                 lambda: "fxc::linear_w8: packed weight must be int8 [P, K, 32]")
    torch._check(w_int8_packed.shape[1] == x.shape[-1], lambda: "fxc::linear_w8: K mismatch")
    return x.new_empty(_out_shape(x, n))


# ---------------------------------------------------------------------------
# ATen reference / fallback
# ---------------------------------------------------------------------------
def linear_aten(x, w_packed, bias, n):
    """ATen implementation of ``fxc::linear`` (fp32 accumulation)."""
    w = unpack_linear_weight(w_packed, n, x.shape[-1]).float()
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def linear_w8_aten(x, w_int8_packed, scales, bias, n, group_size):
    """ATen implementation of ``fxc::linear_w8``: dequantise, then fp32 matmul."""
    w = dequantize_linear_weight_int8(w_int8_packed, scales, n, group_size)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


_reentry = threading.local()


def _bootstrap(op, fallback):
    def impl(*args):
        x = args[0]
        if x.device.type == "cpu" and not getattr(_reentry, "active", False) and _build.ensure_loaded():
            # The library is now loaded and its CPU kernel takes precedence: re-dispatch once.
            _reentry.active = True
            try:
                return op(*args)
            finally:
                _reentry.active = False
        return fallback(*args)

    return impl


_lib.impl("linear", _bootstrap(torch.ops.fxc.linear.default, linear_aten), "CompositeExplicitAutograd")
_lib.impl("linear_w8", _bootstrap(torch.ops.fxc.linear_w8.default, linear_w8_aten), "CompositeExplicitAutograd")
