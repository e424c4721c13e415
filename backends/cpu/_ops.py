"""The CPU implementation of the ``fxc::linear`` / ``fxc::linear_w8`` operators.

Schemas, fake kernels and ATen references are IR-level (:mod:`fxcompiler.ops.linear`).
This backend adds the C++ kernels in ``csrc/``, registered by the JIT-built library under
the ``CPU`` dispatch key (``TORCH_LIBRARY_IMPL(fxc, CPU, m)``) and called by the dispatcher
with no Python on the way. Importing this module installs :func:`_build.ensure_loaded` as the
ops' lazy CPU kernel loader: the first CPU call builds/loads the library and re-dispatches to
it, or, when the build is impossible (one warning), keeps computing with the ATen reference.
"""

from __future__ import annotations

from fxcompiler.ops import linear as _linear_ops

from . import _build

linear_aten = _linear_ops.linear_reference
linear_w8_aten = _linear_ops.linear_w8_reference

_linear_ops.set_cpu_kernel_loader(_build.ensure_loaded)
