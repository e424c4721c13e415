"""``fxc::linear`` / ``fxc::linear_w8``: matmuls on weights prepacked at build time.

IR level (this module, importable by passes and backends alike):

* the schemas, defined with ``torch.library`` so ``torch.export`` and fx graphs keep each
  call as one node, with fake kernels (dynamic M works);
* ATen references for every device (unpack or dequantise, then ``F.linear`` in fp32), which
  run wherever no device kernel is installed;
* the packing functions that produce the weights the ops read (pure PyTorch), so a lowering
  pass can prepack at build time without importing a backend;
* the contract a backend's autotuner offers a lowering pass (:class:`LinearKernelTuner`).

``fxc::linear(Tensor x, Tensor w_packed, Tensor? bias, int n) -> Tensor``
    x ``[..., K]`` fp32 or bf16, ``w_packed`` from :func:`pack_linear_weight` (fp32 or bf16
    weights), returns ``[..., n]`` in x's dtype, fp32 accumulation.
``fxc::linear_w8(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size) -> Tensor``
    int8 weight-only, per-channel (``group_size`` -1 or K) or per-group scales, from
    :func:`quantize_linear_weight_int8`.
``fxc::linear_w8_add(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, Tensor residual, int n,
int group_size)``
    ``residual + fxc::linear_w8(...)`` as one op (an output projection and its residual add; the sum formed in the
    linear's epilogue), bit for bit the two ops.
``fxc::linear_w8_silu_mul(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size)``
    ``fxc::silu_mul`` of the halves of ``fxc::linear_w8(...)`` with ``n = 2H``, ``H`` a multiple of 32 (a fused
    gate/up projection and its product as one op; decode rows never write the ``2H``-wide intermediate), bit for
    bit the graph it replaces. Both are emitted by ``passes/fusion.py`` after ``quantize``.
``fxc::linear_add(Tensor x, Tensor w_packed, Tensor? bias, Tensor residual, int n) -> Tensor``
    ``residual + fxc::linear(...)`` as one op (the sum formed in the linear's output loop), bit for bit the two ops;
    emitted by ``passes/fusion.py`` (``fuse_linear_add``) like ``fxc::linear_w8_add``.
``fxc::linear_by_m(Tensor x, Tensor w_packed, Tensor w_dense, bool w_kn, Tensor? bias, int n, int[] fxc_m) -> Tensor``
    the per-M-range choice of ``passes/lower_cpu_kernels``: with ``M = x.numel() / K`` rows inside one of the
    inclusive ranges ``fxc_m = [lo0, hi0, lo1, hi1, ...]`` (``hi = -1``: unbounded) it is ``fxc::linear(x,
    w_packed, bias, n)``; otherwise the ATen op it replaced on the unpacked weight ``w_dense`` (``[K, N]``
    with ``w_kn``: ``x @ w_dense (+ bias)``; else ``[N, K]``: ``F.linear``). A node holds both layouts.
``fxc::linear_by_m_add(Tensor x, Tensor w_packed, Tensor w_dense, bool w_kn, Tensor? bias, Tensor residual, int n,
int[] fxc_m) -> Tensor``
    ``residual + fxc::linear_by_m(...)``: ``fxc::linear_add`` in the fxc ranges, the ATen op and an add elsewhere.

Layouts (``NB = 32`` output columns per panel, ``P = ceil(N / 32)``, tail zero padded; each panel
is contiguous, so a kernel thread streams its panels once):

* fp32: ``float32 [P, K, 32]`` with ``packed[p, k, j] = W[32 p + j, k]``
* bf16: ``bfloat16 [P, ceil(K/2), 32, 2]`` with ``packed[p, q, j, s] = W[32 p + j, 2 q + s]``
* int8: ``int8 [P, K, 32]`` (same as fp32) and fp32 scales, ``[P*32]`` per output channel or
  ``[P, K/group_size, 32]`` per group along K. Symmetric, ``q = round(w / s)`` clamped to
  [-127, 127], ``s = absmax / 127``.

The fast CPU kernels live in ``backends/cpu`` (C++, registered under the ``CPU`` dispatch key
when its library is loaded). A backend may also install a *lazy loader* with
:func:`set_cpu_kernel_loader`: the ``CompositeExplicitAutograd`` implementation below then calls
it on the first CPU call and re-dispatches to the freshly registered kernel, so that calling
the op is enough to build the kernels; without a loader (or when it returns False) the ATen
reference runs.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from .fused import silu_mul_reference  # (and defines fxc::silu_mul, which linear_w8_silu_mul's reference calls)

__all__ = [
    "NB", "LinearKernelTuner", "LinearTimings", "dequantize_linear_weight_int8", "linear", "linear_reference",
    "linear_w8", "linear_w8_add", "linear_w8_add_aten", "linear_w8_add_reference", "linear_w8_reference",
    "linear_w8_silu_mul", "linear_w8_silu_mul_aten", "linear_w8_silu_mul_reference", "check_residual",
    "check_silu_mul_width", "silu_mul_out",
    "pack_linear_weight", "quantize_linear_weight_int8",
    "set_cpu_kernel_loader", "unpack_linear_weight", "linear_by_m", "linear_by_m_reference", "m_in_ranges",
    "linear_add", "linear_add_aten", "linear_add_reference", "linear_by_m_add", "linear_by_m_add_dense",
    "linear_by_m_add_reference",
]

NB = 32  # output columns per panel

# FRAGMENT: the fxc namespace is shared with the other fxcompiler ops (fxc::paged_attention, ...).
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor w_packed, Tensor? bias, int n) -> Tensor")
_lib.define("linear_w8(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size) -> Tensor")
_lib.define("linear_w8_add(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, Tensor residual, int n, "
            "int group_size) -> Tensor")
_lib.define("linear_w8_silu_mul(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size) "
            "-> Tensor")
_lib.define("linear_by_m(Tensor x, Tensor w_packed, Tensor w_dense, bool w_kn, Tensor? bias, int n, int[] fxc_m) "
            "-> Tensor")
_lib.define("linear_add(Tensor x, Tensor w_packed, Tensor? bias, Tensor residual, int n) -> Tensor")
_lib.define("linear_by_m_add(Tensor x, Tensor w_packed, Tensor w_dense, bool w_kn, Tensor? bias, Tensor residual, "
            "int n, int[] fxc_m) -> Tensor")


# ---------------------------------------------------------------------------
# Packing (build time)
# ---------------------------------------------------------------------------
def _panels(n: int) -> int:
    return (n + NB - 1) // NB


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    pad = w.new_zeros((rows - w.shape[0],) + tuple(w.shape[1:]))
    return torch.cat([w, pad], 0)


def pack_linear_weight(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pack a ``[N, K]`` linear weight for ``fxc::linear`` (dtype float32 or bfloat16).

    ``w`` may be a transposed view of a ``[K, N]`` matmul weight (``w_kn.t()``): the packing
    reads it through strides, one copy."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    dtype = w.dtype if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_linear_weight supports float32 and bfloat16, got {dtype}")
    w = w.detach().to(device="cpu", dtype=dtype)
    n, k = w.shape
    p = _panels(n)
    wp = _pad_rows(w, p * NB).reshape(p, NB, k)  # [P, 32, K]
    if dtype == torch.float32:
        return wp.permute(0, 2, 1).contiguous()  # [P, K, 32]
    if k % 2:
        wp = torch.cat([wp, wp.new_zeros(p, NB, 1)], 2)
    kp = wp.shape[2]
    # [P, 32, Kp/2, 2] -> [P, Kp/2, 32, 2]
    return wp.reshape(p, NB, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_linear_weight`: the ``[n, k]`` weight in the packed dtype."""
    if packed.dtype == torch.float32 and packed.dim() == 3:
        p = packed.shape[0]
        return packed.permute(0, 2, 1).reshape(p * NB, k)[:n]
    if packed.dtype == torch.bfloat16 and packed.dim() == 4:
        p, q = packed.shape[0], packed.shape[1]
        return packed.permute(0, 2, 1, 3).reshape(p * NB, 2 * q)[:n, :k]
    raise ValueError(f"not a packed fxc weight: dtype {packed.dtype}, shape {tuple(packed.shape)}")


def _is_per_channel(group_size: int | None, k: int) -> bool:
    return group_size is None or group_size <= 0 or group_size == k


def quantize_linear_weight_int8(w: torch.Tensor, group_size: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weight-only quantization of a ``[N, K]`` weight, packed for ``fxc::linear_w8``.

    ``group_size`` -1 (or K) gives one scale per output channel; otherwise K must be a
    multiple of ``group_size`` (32, 64, 128 are the intended values) and there is one
    scale per output channel per group of ``group_size`` along K.
    Returns ``(packed_int8, scales)``.
    """
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    n, k = w.shape
    p = _panels(n)
    if _is_per_channel(group_size, k):
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        scales = _pad_rows(scale, p * NB).contiguous()
    else:
        if k % group_size:
            raise ValueError(f"group_size {group_size} must divide K={k}")
        g = k // group_size
        wg = w.reshape(n, g, group_size)
        amax = wg.abs().amax(dim=2)  # [N, G]
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(wg / scale[:, :, None]), -127, 127).to(torch.int8).reshape(n, k)
        scales = _pad_rows(scale, p * NB).reshape(p, NB, g).permute(0, 2, 1).contiguous()  # [P, G, 32]
    packed = _pad_rows(q, p * NB).reshape(p, NB, k).permute(0, 2, 1).contiguous()  # [P, K, 32]
    return packed, scales


def dequantize_linear_weight_int8(packed: torch.Tensor, scales: torch.Tensor, n: int, group_size: int = -1
                                  ) -> torch.Tensor:
    """The fp32 ``[n, K]`` weight that ``fxc::linear_w8`` multiplies by (reference / fallback)."""
    p, k, nb = packed.shape
    q = packed.permute(0, 2, 1).reshape(p * nb, k).float()
    if scales.dim() == 1:
        w = q * scales[:, None]
    else:
        g = scales.shape[1]
        s = scales.permute(0, 2, 1).reshape(p * nb, g)
        w = (q.reshape(p * nb, g, k // g) * s[:, :, None]).reshape(p * nb, k)
    return w[:n]


# ---------------------------------------------------------------------------
# Fake kernels (export, shape propagation)
# ---------------------------------------------------------------------------
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


def check_residual(op: str, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A fused ``residual + linear`` op's fake: ``residual`` must have the linear output ``y``'s shape and dtype."""
    torch._check(tuple(residual.shape) == tuple(y.shape) and residual.dtype == y.dtype,
                 lambda: f"{op}: residual must be {y.dtype} {tuple(y.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    return y


def silu_mul_out(op: str, n: int, panel: int, y: torch.Tensor) -> torch.Tensor:
    """A fused gate/up op's fake: ``n = 2 H`` with ``H`` a multiple of ``panel``; the ``[..., H]`` product of the
    linear output ``y``'s halves."""
    torch._check(n > 0 and n % (2 * panel) == 0,
                 lambda: f"{op}: n={n} must be 2 * H with H a multiple of {panel}")
    return y.new_empty(tuple(y.shape[:-1]) + (n // 2,))


@torch.library.register_fake("fxc::linear_w8_add", lib=_lib)
def _linear_w8_add_fake(x, w_int8_packed, scales, bias, residual, n, group_size):
    y = _linear_w8_fake(x, w_int8_packed, scales, bias, n, group_size)
    return check_residual("fxc::linear_w8_add", y, residual)


def check_silu_mul_width(n: int, op: str = "fxc::linear_w8_silu_mul") -> None:
    """A fused gate/up op's ``n``: ``2 H`` with ``H`` a multiple of ``NB`` (the halves on whole panels)."""
    if n <= 0 or n % (2 * NB):
        raise ValueError(f"{op} needs n = 2 * H with H a multiple of {NB}, got n={n}")


@torch.library.register_fake("fxc::linear_w8_silu_mul", lib=_lib)
def _linear_w8_silu_mul_fake(x, w_int8_packed, scales, bias, n, group_size):
    y = _linear_w8_fake(x, w_int8_packed, scales, bias, n, group_size)
    return silu_mul_out("fxc::linear_w8_silu_mul", n, NB, y)


@torch.library.register_fake("fxc::linear_by_m", lib=_lib)
def _linear_by_m_fake(x, w_packed, w_dense, w_kn, bias, n, fxc_m):
    _check_linear(x, w_packed, n)
    k = x.shape[-1]
    torch._check(w_dense.dim() == 2 and tuple(w_dense.shape) == ((k, n) if w_kn else (n, k)),
                 lambda: f"fxc::linear_by_m: dense weight {tuple(w_dense.shape)} does not match K={k}, n={n}")
    torch._check(len(fxc_m) % 2 == 0, lambda: "fxc::linear_by_m: fxc_m holds [lo, hi] pairs")
    return x.new_empty(_out_shape(x, n))


@torch.library.register_fake("fxc::linear_add", lib=_lib)
def _linear_add_fake(x, w_packed, bias, residual, n):
    return check_residual("fxc::linear_add", _linear_fake(x, w_packed, bias, n), residual)


@torch.library.register_fake("fxc::linear_by_m_add", lib=_lib)
def _linear_by_m_add_fake(x, w_packed, w_dense, w_kn, bias, residual, n, fxc_m):
    y = _linear_by_m_fake(x, w_packed, w_dense, w_kn, bias, n, fxc_m)
    return check_residual("fxc::linear_by_m_add", y, residual)


# ---------------------------------------------------------------------------
# ATen references (every device)
# ---------------------------------------------------------------------------
def linear_reference(x, w_packed, bias, n):
    """ATen implementation of ``fxc::linear`` (fp32 accumulation, output in x's dtype)."""
    w = unpack_linear_weight(w_packed, n, x.shape[-1]).to(device=x.device, dtype=torch.float32)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def linear_w8_reference(x, w_int8_packed, scales, bias, n, group_size):
    """ATen implementation of ``fxc::linear_w8``: dequantise, then fp32 matmul."""
    w = dequantize_linear_weight_int8(w_int8_packed, scales, n, group_size).to(x.device)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def linear_w8_add_reference(x, w_int8_packed, scales, bias, residual, n, group_size):
    """``residual + fxc::linear_w8(x, ...)``: the graph ``fxc::linear_w8_add`` replaces."""
    return residual + torch.ops.fxc.linear_w8.default(x, w_int8_packed, scales, bias, n, group_size)


def linear_w8_add_aten(x, w_int8_packed, scales, bias, residual, n, group_size):
    """``fxc::linear_w8_add`` in ATen ops only (edf off the CPU)."""
    return residual + linear_w8_reference(x, w_int8_packed, scales, bias, n, group_size)


def linear_w8_silu_mul_reference(x, w_int8_packed, scales, bias, n, group_size):
    """``fxc::silu_mul`` of the halves of ``fxc::linear_w8(x, ...)``: the graph ``fxc::linear_w8_silu_mul`` replaces."""
    check_silu_mul_width(n)
    y = torch.ops.fxc.linear_w8.default(x, w_int8_packed, scales, bias, n, group_size)
    return torch.ops.fxc.silu_mul.default(y[..., : n // 2], y[..., n // 2:])


def linear_w8_silu_mul_aten(x, w_int8_packed, scales, bias, n, group_size):
    """``fxc::linear_w8_silu_mul`` in ATen ops only (edf off the CPU)."""
    check_silu_mul_width(n)
    y = linear_w8_reference(x, w_int8_packed, scales, bias, n, group_size)
    return silu_mul_reference(y[..., : n // 2], y[..., n // 2:])


def m_in_ranges(m: int, fxc_m: Sequence[int]) -> bool:
    """Whether ``m`` rows fall in one of the inclusive ``[lo, hi]`` pairs of ``fxc_m`` (``hi = -1``: unbounded)."""
    return any(m >= lo and (hi < 0 or m <= hi) for lo, hi in zip(fxc_m[0::2], fxc_m[1::2]))


def linear_by_m_dense(x, w_packed, w_dense, w_kn, bias, n, fxc_m):
    """The ATen op ``fxc::linear_by_m`` chooses outside its fxc ranges, for every M (ATen only: what
    a kind that rewrites fxc ops to ATen, e.g. ``edf`` off the CPU, traces)."""
    if not w_kn:
        return F.linear(x, w_dense, bias)
    y = torch.matmul(x, w_dense)
    return y if bias is None else y + bias


def linear_by_m_reference(x, w_packed, w_dense, w_kn, bias, n, fxc_m):
    """``fxc::linear_by_m`` without its CPU kernel: the same choice, ``fxc::linear`` or the ATen op."""
    k = x.shape[-1]
    if m_in_ranges(x.numel() // k if k else 0, fxc_m):
        return torch.ops.fxc.linear.default(x, w_packed, bias, n)
    return linear_by_m_dense(x, w_packed, w_dense, w_kn, bias, n, fxc_m)


def linear_add_reference(x, w_packed, bias, residual, n):
    """``residual + fxc::linear(x, ...)``: the graph ``fxc::linear_add`` replaces."""
    return residual + torch.ops.fxc.linear.default(x, w_packed, bias, n)


def linear_add_aten(x, w_packed, bias, residual, n):
    """``fxc::linear_add`` in ATen ops only (edf off the CPU)."""
    return residual + linear_reference(x, w_packed, bias, n)


def linear_by_m_add_reference(x, w_packed, w_dense, w_kn, bias, residual, n, fxc_m):
    """``residual + fxc::linear_by_m(...)``: the graph ``fxc::linear_by_m_add`` replaces."""
    return residual + torch.ops.fxc.linear_by_m.default(x, w_packed, w_dense, w_kn, bias, n, fxc_m)


def linear_by_m_add_dense(x, w_packed, w_dense, w_kn, bias, residual, n, fxc_m):
    """``fxc::linear_by_m_add`` with the ATen op for every M (what a kind that rewrites fxc ops to ATen traces)."""
    return residual + linear_by_m_dense(x, w_packed, w_dense, w_kn, bias, n, fxc_m)


_cpu_kernel_loader: Callable[[], bool] | None = None
_reentry = threading.local()


def set_cpu_kernel_loader(loader: Callable[[], bool] | None) -> None:
    """Install a backend's ``loader() -> bool``: called on the first CPU call of these ops; True
    means a faster kernel is now registered under the ``CPU`` dispatch key (the call is then
    re-dispatched to it), False that the ATen reference stays in use."""
    global _cpu_kernel_loader
    _cpu_kernel_loader = loader


def _composite(op, reference, get_loader=lambda: _cpu_kernel_loader):
    """The op's composite implementation: the ATen ``reference``, unless the backend's loader (``get_loader()``)
    registers a CPU kernel, which is then dispatched to once. ``get_loader`` is read per call (installed late)."""
    def impl(*args):
        x = args[0]
        loader = get_loader()
        if loader is not None and x.device.type == "cpu" and not getattr(_reentry, "active", False) and loader():
            # The loader registered a CPU kernel, which takes precedence over this one: re-dispatch once.
            _reentry.active = True
            try:
                return op(*args)
            finally:
                _reentry.active = False
        return reference(*args)

    return impl


_lib.impl("linear", _composite(torch.ops.fxc.linear.default, linear_reference), "CompositeExplicitAutograd")
_lib.impl("linear_w8", _composite(torch.ops.fxc.linear_w8.default, linear_w8_reference), "CompositeExplicitAutograd")
_lib.impl("linear_w8_add", _composite(torch.ops.fxc.linear_w8_add.default, linear_w8_add_reference),
          "CompositeExplicitAutograd")
_lib.impl("linear_w8_silu_mul", _composite(torch.ops.fxc.linear_w8_silu_mul.default, linear_w8_silu_mul_reference),
          "CompositeExplicitAutograd")

_lib.impl("linear_add", _composite(torch.ops.fxc.linear_add.default, linear_add_reference),
          "CompositeExplicitAutograd")

# No loader step: the references call fxc::linear, whose first CPU call loads the library (which registers
# the C++ kernels of these ops too).
_lib.impl("linear_by_m", linear_by_m_reference, "CompositeExplicitAutograd")
_lib.impl("linear_by_m_add", linear_by_m_add_reference, "CompositeExplicitAutograd")

linear = torch.ops.fxc.linear.default
linear_by_m = torch.ops.fxc.linear_by_m.default
linear_add = torch.ops.fxc.linear_add.default
linear_by_m_add = torch.ops.fxc.linear_by_m_add.default
linear_w8 = torch.ops.fxc.linear_w8.default
linear_w8_add = torch.ops.fxc.linear_w8_add.default
linear_w8_silu_mul = torch.ops.fxc.linear_w8_silu_mul.default


# ---------------------------------------------------------------------------
# The autotuner contract (a backend measures, a lowering pass decides)
# ---------------------------------------------------------------------------
@dataclass
class LinearTimings:
    """Seconds per call at each measured M (rows of x), for ``fxc::linear`` and the ATen op it
    would replace; ``cached`` when read from the tuning cache rather than measured now."""

    fxc: dict[int, float]
    aten: dict[int, float]
    cached: bool = False
    info: dict = field(default_factory=dict)


@runtime_checkable
class LinearKernelTuner(Protocol):
    """What a backend hands to ``passes/lower_cpu_kernels`` through ``ctx.options['kernel_tuner']``.

    ``isa()``: the ISA the kernels run with (e.g. ``'avx512+amx'``), or ``'aten'`` when no
    kernel is available (no compiler, ``FXCOMPILER_CPU_ISA=aten``): the pass then does not lower.
    ``measure(k, n, weight_dtype, baseline, ms)``: timings of ``fxc::linear`` on a prepacked
    ``[N, K]`` weight vs the ATen ``baseline`` (``'matmul'``: x @ W[K, N] contiguous, what
    ``weight_layout`` emits; ``'linear'``: F.linear with W[N, K]) with activations of the
    weight's dtype, at each M in ``ms``.
    """

    def isa(self) -> str: ...

    def measure(self, k: int, n: int, weight_dtype: torch.dtype, baseline: str,
                ms: Sequence[int]) -> LinearTimings: ...
