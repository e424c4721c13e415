"""``qparam`` files: the quantization parameters of the matmuls a qformat quantizes, without pickle.

A safetensors file (or an ``.npz`` read with ``allow_pickle=False``) with, per quantized module ``M``
(transformers' name, e.g. ``model.layers.0.mlp.down_proj``; weight ``[N, K]``, ``G`` groups along K):

* ``M.weight_scale`` float32 ``[N, G]`` (``G = 1`` per channel): int8 and fp8 ``w = s·q``; int4 ``w = s·q + m``;
* ``M.weight_min`` float32 ``[N, G]``: int4 asymmetric only (Q4_1-style min; symmetric int4 has
  ``m = −8·s``);
* ``M.qweight`` (optional): the codes, int8 ``[N, K]`` (−128 included, as compressed-tensors' symmetric
  int8 has it), uint8 ``[N, K]`` in [0, 15], or float8_e4m3fn ``[N, K]`` (fp8, no NaN); absent, the
  ``quantize`` pass rounds the checkpoint's float weight onto the given scales.

* ``M.smooth_factor`` float32 ``[K]`` (W8A8 SmoothQuant only, :mod:`fxcompiler.smoothquant`): the per-input-channel
  factor ``s`` the module's weight columns were multiplied by (and its input divided by); the codes and scales
  are those of the smoothed weight. Checked (shape, positive, finite) and recorded; a file carrying them
  for a scheme without int8 activations is refused rather than silently ignored. Pickle-based formats (``.pt``, ``.bin``,
``.pkl``, or a file starting with a pickle opcode) are refused.
"""
from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["SUFFIXES", "QParamSet", "load_qparam", "qparam_digest", "save_qparam"]

SUFFIXES = ("weight_scale", "weight_min", "qweight", "smooth_factor")
_PICKLE_EXT = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def qparam_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _err(path: str, msg: str) -> ValueError:
    return ValueError(f"qparam_path={path!r}: {msg}")


def load_qparam(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a qparam file (safetensors or ``.npz``), refusing pickle."""
    path = os.fspath(path)
    if path.lower().endswith(_PICKLE_EXT):
        raise _err(path, "pickle-based files are refused (they can execute code); write the scales as "
                         "safetensors (safetensors.torch.save_file)")
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        raise _err(path, f"cannot be read: {exc}") from None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise _err(path, "the file is a pickle; pickle-based qparam files are refused (use safetensors)")
    if path.lower().endswith((".npz", ".npy")):
        return _load_numpy(path)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise _err(path, f"not a safetensors file ({exc})") from None
    return tensors


def _load_numpy(path: str) -> dict[str, torch.Tensor]:
    import zipfile

    import numpy as np

    if path.lower().endswith(".npy"):
        raise _err(path, "a single .npy array has no tensor names; use safetensors or an .npz of named arrays")
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {}
            for name in z.files:
                try:
                    out[name] = torch.from_numpy(np.ascontiguousarray(z[name]))
                except ValueError as exc:  # object arrays need pickle
                    raise _err(path, f"array {name!r} needs pickle to be read ({exc}); refused") from None
            return out
    except (zipfile.BadZipFile, OSError) as exc:
        raise _err(path, f"not an .npz file ({exc})") from None


def save_qparam(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                ) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, os.fspath(path), metadata=metadata)


class QParamSet:
    """A loaded qparam file as the ``quantize`` pass consumes it: per module the codes, scales and
    mins of its weight, validated against the weight's shape; every tensor must be used."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tensors = load_qparam(self.path)
        self.used: set[str] = set()

    def _get(self, key: str, what: str) -> torch.Tensor:
        if key not in self.tensors:
            raise _err(self.path, f"missing tensor {key!r} ({what})")
        self.used.add(key)
        return self.tensors[key]

    def _scales(self, key: str, n_rows: int | None, groups: int, what: str, positive: bool | None) -> torch.Tensor:
        t = self._get(key, what)
        if not t.is_floating_point():
            raise _err(self.path, f"tensor {key!r} must be floating point, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != groups or (n_rows is not None and t.shape[0] != n_rows):
            rows = "N" if n_rows is None else n_rows
            raise _err(self.path, f"tensor {key!r} has shape {list(t.shape)}, expected [{rows}, {groups}] ({what})")
        t = t.to(torch.float32)
        bad = ~torch.isfinite(t)
        if positive is not None:
            bad |= (t <= 0) if positive else (t < 0)
        if bool(bad.any()):
            rule = "" if positive is None else f" or {'non-positive' if positive else 'negative'}"
            raise _err(self.path, f"tensor {key!r} has {int(bad.sum())} non-finite{rule} values")
        return t

    def codes_for(self, modules: list[str], w: torch.Tensor, weight: str, group: int, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(codes [N, K], scales [N, G], mins [N, G] | None)`` of the (fused) weight ``w [N, K]`` whose
        row blocks are ``modules`` in order; codes from ``M.qweight`` or rounded onto the scales."""
        n, k = w.shape
        groups = 1 if group == -1 else -(-k // group)
        if weight == "int8" and group != -1 and k % group:
            raise _err(self.path, f"int8 group_size={group} does not divide K={k} of {', '.join(modules)}")
        if weight == "fp8" and group != -1:
            raise _err(self.path, f"fp8 weights have one scale per output channel, got group_size={group}")
        what = f"int8 scale per {'channel' if group == -1 else f'group of {group}'}" if weight == "int8" \
            else "fp8 scale per channel" if weight == "fp8" else f"int4 scale per group of {group}"
        # int8/fp8: s > 0; asymmetric int4: s >= 0 (0 for a constant group); symmetric int4 (Q4_0): any sign
        sign = True if weight in ("int8", "fp8") else (None if symmetric else False)
        scales = [self._scales(f"{m}.weight_scale", None if len(modules) > 1 else n, groups, what, sign)
                  for m in modules]
        rows = [s.shape[0] for s in scales]
        if sum(rows) != n:
            raise _err(self.path, "tensors " + ", ".join(f"{m}.weight_scale [{r}]" for m, r in zip(modules, rows))
                       + f" give {sum(rows)} output rows, the weight has {n}")
        asym = weight == "int4" and not symmetric
        for m in modules:
            if not asym and f"{m}.weight_min" in self.tensors:
                raise _err(self.path, f"unexpected tensor {m}.weight_min: the scheme of {m} is "
                                      f"{weight if weight != 'int4' else 'symmetric int4'} (no min)")
        mins = [self._scales(f"{m}.weight_min", r, groups, "int4 min per group", None) if asym else
                (-8.0 * s if weight == "int4" else None) for m, s, r in zip(modules, scales, rows)]
        codes, start = [], 0
        for m, s, mn, r in zip(modules, scales, mins, rows):
            part = w[start:start + r].detach().to(torch.float32)
            start += r
            key = f"{m}.qweight"
            if key in self.tensors:
                q = self._get(key, "codes")
                if weight == "fp8":
                    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (r, k):
                        raise _err(self.path, f"tensor {key!r} is {q.dtype} {list(q.shape)}, expected "
                                              f"torch.float8_e4m3fn [{r}, {k}]")
                    if not bool(torch.isfinite(q.to(torch.float32)).all()):
                        raise _err(self.path, f"tensor {key!r} has NaN fp8 codes")
                    codes.append(q)
                    continue
                lo, hi, dtype = (-128, 127, torch.int8) if weight == "int8" else (0, 15, torch.uint8)
                if q.dtype != dtype or tuple(q.shape) != (r, k):
                    raise _err(self.path, f"tensor {key!r} is {q.dtype} {list(q.shape)}, expected {dtype} [{r}, {k}]")
                if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
                    raise _err(self.path, f"tensor {key!r} has codes outside [{lo}, {hi}]")
                codes.append(q)
                continue
            idx = torch.arange(k) // (k if group == -1 else group)
            se = s[:, idx]
            safe = torch.where(se != 0, se, torch.ones_like(se))
            if weight == "fp8":
                codes.append(torch.clamp(part / safe, -448.0, 448.0).to(torch.float8_e4m3fn))
            elif weight == "int8":
                codes.append(torch.clamp(torch.round(part / safe), -127, 127).to(torch.int8))
            else:
                codes.append(torch.clamp(torch.round((part - mn[:, idx]) / safe), 0, 15).to(torch.uint8))
        if weight == "fp8":  # float8 has no cat on every build: through its bytes
            return (torch.cat([c.view(torch.uint8) for c in codes], 0).view(torch.float8_e4m3fn),
                    torch.cat(scales, 0), None)
        return (torch.cat(codes, 0), torch.cat(scales, 0), None if weight == "int8" else torch.cat(mins, 0))

    def smooth_factors(self, modules: list[str], k: int) -> torch.Tensor:
        """The shared ``M.smooth_factor`` ``[k]`` of the (fused) ``modules``: present, float, ``[k]``, positive and
        finite, and equal across modules fused into one matmul (they read one input)."""
        out = None
        for m in modules:
            key = f"{m}.smooth_factor"
            t = self._get(key, "SmoothQuant factor per input channel; the qformat's algorithm is smoothquant")
            if not t.is_floating_point() or tuple(t.shape) != (k,):
                raise _err(self.path, f"tensor {key!r} is {t.dtype} {list(t.shape)}, expected float32 [{k}]")
            t = t.to(torch.float32)
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                raise _err(self.path, f"tensor {key!r} has non-finite or non-positive values")
            if out is not None and not torch.equal(out, t):
                raise _err(self.path, f"tensor {key!r} differs from {modules[0]}.smooth_factor; modules fused "
                                      "into one matmul read one input and need one factor")
            out = t
        return out

    def check_all_used(self) -> None:
        extra = sorted(set(self.tensors) - self.used)
        if not extra:
            return
        smooth = [e for e in extra if e.endswith(".smooth_factor")]
        if smooth:
            raise NotImplementedError(f"qparam_path={self.path!r}: {smooth[0]!r} is a SmoothQuant factor; only W8A8 "
                                      "(int8 activations, qformat --algorithm smoothquant) takes smoothing factors")
        raise _err(self.path, f"{len(extra)} tensors no quantized module uses, e.g. {extra[0]!r} (a module the "
                              "qformat keeps in float, a misspelt name, or a suffix other than "
                              f"{', '.join(SUFFIXES)})")
