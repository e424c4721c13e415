"""Pre-quantised HF checkpoints (a ``quantization_config`` in config.json) into fxcompiler's int4/int8 layouts.

Read, unpacked in this module (no GPU-only dependency), and mapped onto the codes/scales/mins of
``fxc::linear_w4`` (``w = fl(s·q) + m``, q in [0, 15], a scale and a min per group) and ``fxc::linear_w8``
(``w = s·q``, q int8, a scale per channel or group):

* **compressed-tensors** ``pack-quantized`` (llm-compressor): ``M.weight_packed`` int32 ``[N, ceil(K/f)]``
  (``f = 32/bits`` values per int32 along K, lowest bits first, each stored as ``q + 2^(bits−1)``),
  ``M.weight_scale`` ``[N, G]`` (``G = 1``: channel), ``M.weight_zero_point`` (asymmetric: packed the same way
  along N, ``[ceil(N/f), G]``), ``M.weight_shape``; value ``(q − z)·s``. int4 (sym and asym, group and
  channel) → ``linear_w4`` with codes ``q + 8`` and ``m = −s·(8 + z)``; int8 symmetric → ``linear_w8``
  (codes in [−128, 127]); int8 asymmetric raises ``NotImplementedError`` (``linear_w8`` has no zero point).
* **GPTQ** (AutoGPTQ / gptqmodel, ``quant_method: gptq``, 4 bits): ``M.qweight`` int32 ``[K/8, N]`` (8 values
  along K per int32, lowest bits first), ``M.qzeros`` int32 ``[G, N/8]`` (along N), ``M.scales`` ``[G, N]``,
  ``M.g_idx`` ``[K]``; value ``s·(q − z)`` with ``z = stored + 1`` for ``checkpoint_format: gptq`` (v1, the
  default; what the v1 kernels compute, so a stored 15 is a zero of 16) and ``z = stored`` for ``gptq_v2``.
  An act-order ``g_idx`` (not ``k // group_size``) raises ``NotImplementedError``: its groups are not
  contiguous, and ``linear_w4`` has contiguous groups only.
* **AWQ** (AutoAWQ ``version: gemm``, 4 bits): ``M.qweight`` int32 ``[K, N/8]`` and ``M.qzeros`` int32
  ``[G, N/8]`` packed along N in AutoAWQ's interleaved order (nibble ``i`` holds column ``8c + [0,2,4,6,1,3,5,7][i]``),
  ``M.scales`` ``[G, N]``; value ``s·(q − z)``.

With fp16/bf16 scales (what the formats store) ``fl(s·q) + fl(−s·z)`` equals the exact ``s·(q − z)``
(both products and their difference fit in fp32's 24 bits), so the unpacked values dequantise bit for bit to
the exact values the checkpoint encodes. (The formats' own fp16 dequantisers round that value to fp16.)

:func:`convert_quant_checkpoint` turns such a checkpoint into a directory of the ``fxcompiler quantize`` kind
(config without ``quantization_config``, the checkpoint's other tensors plus the dequantised values of the
quantized ones for the capture, ``qformat.yaml``, ``qparam.safetensors`` with the checkpoint's own codes),
once per checkpoint content; the ``quantize`` pass then computes with exactly those codes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .integrity import IntegrityError, verify_checksums, write_checksums

__all__ = ["QuantCheckpointError", "UnpackedLinear", "convert_quant_checkpoint", "find_quantization_config",
           "read_scheme", "unpack_checkpoint"]

log = logging.getLogger("fxcompiler.quant_ckpt")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AutoAWQ GEMM int32 holds column 8c + AWQ_ORDER[i]
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_SUPPORTED = ("compressed-tensors", "gptq", "awq")
RECORD_FILE = "quant_checkpoint.json"


class QuantCheckpointError(ValueError):
    """A pre-quantised checkpoint that does not hold what its quantization_config says."""


@dataclass
class UnpackedLinear:
    """One quantized linear in fxcompiler's terms: int4 ``codes`` uint8 [N, K] in [0, 15] with ``scales`` and
    ``mins`` fp32 [N, G] (``w = fl(s·q) + m``), or int8 ``codes`` int8 [N, K] with ``scales`` [N, G]
    (``w = s·q``); ``group`` columns per group (-1: one per channel)."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        from .gptq import dequantize_codes

        return dequantize_codes(self.codes, self.scales, self.mins, self.group)


# ------------------------------------------------------------------------------------------------
# quantization_config
# ------------------------------------------------------------------------------------------------
def find_quantization_config(model_dir: str | os.PathLike) -> dict | None:
    """The ``quantization_config`` of ``model_dir/config.json`` (None when it has none)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config")
    return q if isinstance(q, dict) else None


@dataclass(frozen=True)
class CkptScheme:
    """What a ``quantization_config`` says: ``method``; for gptq/awq ``bits``/``group``/``sym``/extras; for
    compressed-tensors the parsed config groups ``[(targets, weights-args)]``."""

    method: str
    bits: int = 4
    group: int = -1
    sym: bool = False
    v1_zeros: bool = True
    groups: tuple = ()
    ignore: tuple = ()


def _field(where: str, key: str) -> str:
    return f"quantization_config.{key}" if not where else f"quantization_config.{where}.{key}"


def _int_field(qc: dict, key: str, where: str = "", default=None):
    v = qc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise QuantCheckpointError(f"{_field(where, key)} must be an int, got {v!r}")
    return v


def _bits(v: int, name: str, allowed=(4,)) -> int:
    if v not in (2, 3, 4, 8):
        raise QuantCheckpointError(f"{name}={v}: not a bit width of the format (2, 3, 4 or 8)")
    if v not in allowed:
        raise NotImplementedError(f"{name}={v}: only {'/'.join(map(str, allowed))}-bit weights of this format map "
                                  "onto fxcompiler's kernels (fxc::linear_w4 / fxc::linear_w8)")
    return v


def read_scheme(qc: dict) -> CkptScheme:
    """Validate a ``quantization_config``; errors name the field."""
    method = qc.get("quant_method")
    if method not in _SUPPORTED:
        raise NotImplementedError(f"quantization_config.quant_method={method!r} is not read by fxcompiler (supported: "
                                  f"{', '.join(_SUPPORTED)}; GGUF files load natively)")
    if method in ("gptq", "awq"):
        bits = _bits(_int_field(qc, "bits" if "bits" in qc or method == "gptq" else "w_bit"), "quantization_config.bits")
        group = _int_field(qc, "group_size" if "group_size" in qc or method == "gptq" else "q_group_size")
        if group != -1 and (group <= 0 or group % 2):
            raise QuantCheckpointError(f"quantization_config.group_size={group}: must be -1 or a positive even int")
        if method == "gptq":
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise NotImplementedError(f"quantization_config.checkpoint_format={fmt!r}: only 'gptq' (v1 zeros) and "
                                          "'gptq_v2' packings are read (marlin/bitblas repacks are GPU layouts)")
            return CkptScheme("gptq", bits, group, bool(qc.get("sym", True)), fmt == "gptq")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise NotImplementedError(f"quantization_config.version={qc.get('version')!r}: only AutoAWQ's GEMM packing "
                                      "is read (GEMV/Marlin/exllama repacks are other layouts)")
        if qc.get("zero_point", True) is not True:
            raise NotImplementedError("quantization_config.zero_point=false: AWQ without zero points is not read")
        return CkptScheme("awq", bits, group, False)
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise NotImplementedError(f"quantization_config.format={fmt!r}: of compressed-tensors only 'pack-quantized' "
                                  "(int4/int8 weight-only) is read; float-quantized fp8 checkpoints are not mapped onto "
                                  "fxc::linear_f8 yet (fp8 weights from a float model: Wf8A16 / --scheme fp8)")
    groups = []
    for gname, g in (qc.get("config_groups") or {}).items():
        where = f"config_groups.{gname}"
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise QuantCheckpointError(f"{_field(where, 'weights')} is missing")
        if g.get("input_activations") or g.get("output_activations"):
            raise NotImplementedError(f"{_field(where, 'input_activations')}: quantized activations (W8A8) of a "
                                      "compressed-tensors checkpoint are not read (fxcompiler quantize --scheme w8a8 "
                                      "writes its own); only weight-only schemes are read")
        w = g["weights"]
        if w.get("type", "int") != "int":
            raise NotImplementedError(f"{_field(where, 'weights.type')}={w.get('type')!r}: only int weights are read")
        bits = _bits(_int_field(w, "num_bits", where + ".weights"), _field(where, "weights.num_bits"), (4, 8))
        strategy = w.get("strategy", "tensor")
        if strategy not in ("group", "channel", "tensor"):
            raise NotImplementedError(f"{_field(where, 'weights.strategy')}={strategy!r}: only group, channel and "
                                      "tensor strategies are read")
        group = _int_field(w, "group_size", where + ".weights") if strategy == "group" else -1
        if strategy == "group" and (group <= 0 or group % 2):
            raise QuantCheckpointError(f"{_field(where, 'weights.group_size')}={group}: must be a positive even int")
        if w.get("actorder") not in (None, False, "static", "weight"):
            raise NotImplementedError(f"{_field(where, 'weights.actorder')}={w.get('actorder')!r}: act-order groups "
                                      "(g_idx) are not contiguous, and fxc::linear_w4 has contiguous groups only")
        sym = w.get("symmetric", True)
        if bits == 8 and not sym:
            raise NotImplementedError(f"{_field(where, 'weights.symmetric')}=false with num_bits=8: fxc::linear_w8 has "
                                      "no zero point (asymmetric int4 is read)")
        targets = g.get("targets") or ["Linear"]
        groups.append((tuple(targets), {"bits": bits, "group": group, "sym": bool(sym), "strategy": strategy}))
    if not groups:
        raise QuantCheckpointError("quantization_config.config_groups is empty")
    return CkptScheme("compressed-tensors", groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()))


# ------------------------------------------------------------------------------------------------
# unpacking
# ------------------------------------------------------------------------------------------------
def _nibbles(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned fields of an int32 tensor, ``32/bits`` per int32 lowest first, laid out along ``dim``."""
    f = 32 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(p >> (bits * i)) & mask for i in range(f)], dim=dim + 1)  # [..., x, f, ...]
    shape = list(packed.shape)
    shape[dim] *= f
    return fields.reshape(shape)


def _get(tensors: dict, key: str, what: str) -> torch.Tensor:
    if key not in tensors:
        raise QuantCheckpointError(f"checkpoint tensor {key!r} is missing ({what})")
    return tensors[key]


def _int32(t: torch.Tensor, key: str) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise QuantCheckpointError(f"checkpoint tensor {key!r} must be int32 packed words, got {t.dtype}")
    return t


def _scales(t: torch.Tensor, key: str, shape: tuple) -> torch.Tensor:
    if not t.is_floating_point() or tuple(t.shape) != shape:
        raise QuantCheckpointError(f"checkpoint tensor {key!r} is {t.dtype} {list(t.shape)}, expected float "
                                   f"{list(shape)}")
    return t.to(torch.float32)


def _check_g_idx(tensors: dict, key: str, k: int, group: int) -> None:
    if key not in tensors:
        return
    g_idx = tensors[key].to(torch.int64)
    expect = torch.arange(k) // (k if group == -1 else group)
    if g_idx.shape != expect.shape or not torch.equal(g_idx, expect):
        raise NotImplementedError(f"checkpoint tensor {key!r} is an act-order g_idx (columns not in contiguous groups "
                                  "of group_size); fxc::linear_w4 has contiguous groups only, so this checkpoint "
                                  "cannot be mapped without dequantising")


def _int4(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int) -> UnpackedLinear:
    """Codes ``q`` [N, K] in [0, 15], scales and integer zeros [N, G], value ``s·(q − z)``."""
    return UnpackedLinear(4, q.to(torch.uint8).contiguous(), s.contiguous(), (-(s * z.to(torch.float32))).contiguous(),
                          group)


def _unpack_gptq(tensors: dict, m: str, scheme: CkptScheme, awq: bool) -> UnpackedLinear:
    kind = "AWQ" if awq else "GPTQ"
    qw = _int32(_get(tensors, f"{m}.qweight", f"{kind} packed weight"), f"{m}.qweight")
    qz = _int32(_get(tensors, f"{m}.qzeros", f"{kind} packed zero points"), f"{m}.qzeros")
    sc = _get(tensors, f"{m}.scales", f"{kind} scales")
    if qw.dim() != 2 or qz.dim() != 2 or sc.dim() != 2:
        raise QuantCheckpointError(f"{m}: {kind} qweight/qzeros/scales must be 2-D")
    if awq:
        k, n = qw.shape[0], qw.shape[1] * 8
        q = _nibbles(qw, 4, 1)  # [K, N] with columns in AWQ order inside each 8-block
        order = torch.tensor(AWQ_ORDER)
        inv = torch.argsort(order)
        q = q.reshape(k, -1, 8)[:, :, inv].reshape(k, n)
    else:
        k, n = qw.shape[0] * 8, qw.shape[1]
        q = _nibbles(qw, 4, 0)  # [K, N]
    group = scheme.group
    groups = 1 if group == -1 else -(-k // group)
    if tuple(qz.shape) != (groups, n // 8):
        raise QuantCheckpointError(f"checkpoint tensor {m}.qzeros is {list(qz.shape)}, expected [{groups}, {n // 8}] "
                                   f"(group_size={group}, K={k}, N={n})")
    z = _nibbles(qz, 4, 1)
    if awq:
        z = z.reshape(groups, -1, 8)[:, :, torch.argsort(torch.tensor(AWQ_ORDER))].reshape(groups, n)
    elif scheme.v1_zeros:
        z = z + 1  # AutoGPTQ v1 stores z − 1 (its kernels add the 1 back without masking)
    s = _scales(sc, f"{m}.scales", (groups, n))
    if not awq:
        _check_g_idx(tensors, f"{m}.g_idx", k, group)
    return _int4(q.t(), s.t(), z.t(), group if group != -1 else k)


def _ct_scheme(scheme: CkptScheme, m: str) -> dict | None:
    for targets, args in scheme.groups:
        for t in targets:
            if t == "Linear" or (t.startswith("re:") and re.match(t[3:], m)) or t == m:
                return args
    return None


def _unpack_ct(tensors: dict, m: str, scheme: CkptScheme) -> UnpackedLinear:
    args = _ct_scheme(scheme, m)
    if args is None:
        raise QuantCheckpointError(f"{m}.weight_packed: no quantization_config.config_groups target matches {m!r}")
    bits = args["bits"]
    packed = _int32(_get(tensors, f"{m}.weight_packed", "compressed-tensors packed weight"), f"{m}.weight_packed")
    if f"{m}.weight_shape" in tensors:
        n, k = (int(v) for v in tensors[f"{m}.weight_shape"].tolist())
    else:
        n, k = packed.shape[0], packed.shape[1] * (32 // bits)
    f = 32 // bits
    if tuple(packed.shape) != (n, -(-k // f)):
        raise QuantCheckpointError(f"checkpoint tensor {m}.weight_packed is {list(packed.shape)}, expected "
                                   f"[{n}, {-(-k // f)}] for a {bits}-bit [{n}, {k}] weight")
    offset = 1 << (bits - 1)
    u = _nibbles(packed, bits, 1)[:, :k]  # q + offset
    group = args["group"] if args["strategy"] == "group" else -1
    groups = 1 if group == -1 else -(-k // group)
    sc = _get(tensors, f"{m}.weight_scale", "compressed-tensors scale")
    if args["strategy"] == "tensor" and sc.numel() == 1:
        sc = sc.reshape(1, 1).expand(n, 1)
    s = _scales(sc, f"{m}.weight_scale", (n, groups))
    _check_g_idx(tensors, f"{m}.weight_g_idx", k, group)
    if args["sym"]:
        z = torch.zeros(n, groups, dtype=torch.int64)
        zp = tensors.get(f"{m}.weight_zero_point")
        if zp is not None and bool((zp != 0).any()):
            raise QuantCheckpointError(f"checkpoint tensor {m}.weight_zero_point is non-zero but the scheme is symmetric")
    else:
        zp = _get(tensors, f"{m}.weight_zero_point", "compressed-tensors zero point (asymmetric)")
        if zp.dtype == torch.int8 and tuple(zp.shape) == (n, groups):  # stored unpacked
            z = zp.to(torch.int64)
        elif zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // f), groups):
            z = _nibbles(zp, bits, 0)[:n] - offset
        else:
            raise QuantCheckpointError(f"checkpoint tensor {m}.weight_zero_point is {zp.dtype} {list(zp.shape)}, "
                                       f"expected int32 [{-(-n // f)}, {groups}] (packed along N) or int8 [{n}, {groups}]")
    if bits == 4:
        return _int4(u, s, z + offset, group if group != -1 else k)
    return UnpackedLinear(8, (u - offset).to(torch.int8).contiguous(), s.contiguous(), None, group)


_PACKED_SUFFIX = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
                  "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                                         "weight_shape")}


def unpack_checkpoint(tensors: dict[str, torch.Tensor], qc: dict
                      ) -> tuple[dict[str, UnpackedLinear], dict[str, torch.Tensor]]:
    """``(quantized linears by module name, the other tensors)`` of a checkpoint with ``quantization_config`` qc."""
    scheme = read_scheme(qc)
    anchor = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}[scheme.method]
    modules = sorted(k[: -len(anchor) - 1] for k in tensors if k.endswith("." + anchor))
    for key in tensors:  # a zero-point/scale without its packed weight: a wrong name, refused
        for suffix in _PACKED_SUFFIX[scheme.method]:
            if key.endswith("." + suffix) and key[: -len(suffix) - 1] not in modules:
                if scheme.method == "compressed-tensors" and suffix == "weight_scale" and \
                        key[: -len(suffix) - 1] + ".weight" in tensors:
                    continue
                raise QuantCheckpointError(f"checkpoint tensor {key!r} has no {key[: -len(suffix) - 1]}.{anchor}")
    if not modules:
        raise QuantCheckpointError(f"the checkpoint has no '*.{anchor}' tensors although quantization_config."
                                   f"quant_method={scheme.method!r}")
    out: dict[str, UnpackedLinear] = {}
    for m in modules:
        if scheme.method == "compressed-tensors":
            out[m] = _unpack_ct(tensors, m, scheme)
        else:
            out[m] = _unpack_gptq(tensors, m, scheme, scheme.method == "awq")
        if f"{m}.weight" in tensors:
            raise QuantCheckpointError(f"checkpoint holds both {m}.weight and packed {m}.{anchor}")
    used = {f"{m}.{s}" for m in modules for s in _PACKED_SUFFIX[scheme.method]}
    rest = {k: v for k, v in tensors.items() if k not in used}
    return out, rest


# ------------------------------------------------------------------------------------------------
# conversion into an `fxcompiler quantize`-style directory
# ------------------------------------------------------------------------------------------------
def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"quant_ckpt_file_path={str(path)!r}: a pre-quantised checkpoint is read from "
                             "safetensors files (pickle-based .bin/.pt are refused)")
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"quant_ckpt_file_path={str(path)!r}: no *.safetensors files")
    return files


def _digest(files: list[Path]) -> str:
    from .models.loader import _file_digest

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + _file_digest(f).encode())
    return h.hexdigest()[:16]


def _verified(target: Path) -> bool:
    """A finished conversion whose files match their recorded checksums (checked before anything in it is
    parsed); a damaged one is logged, removed and made again."""
    from .models.loader import _complete

    if not _complete(target):
        return False
    try:
        verify_checksums(target)
    except IntegrityError as exc:
        log.warning("pre-quantised checkpoint cache entry %s is damaged (%s): rebuilding it", target, exc)
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True


def convert_quant_checkpoint(ckpt: str | os.PathLike, model_dir: str | os.PathLike | None = None,
                             cache_dir: str | os.PathLike | None = None, *, act_dtype: str | None = None) -> Path:
    """The ``fxcompiler quantize``-style directory of the pre-quantised checkpoint ``ckpt`` (a directory or a
    safetensors file; its config.json, else ``model_dir``'s, holds the quantization_config), made once per
    content under ``cache_dir/models`` (a temporary directory when None). ``model_dir`` (default: the
    checkpoint's directory) gives the config and tokenizer."""
    from .models.loader import _exclusive
    from .models.safetensors_reader import read_safetensors

    ckpt = Path(ckpt).expanduser()
    if not ckpt.exists():
        raise ValueError(f"quant_ckpt_file_path={str(ckpt)!r} does not exist")
    ckpt_dir = ckpt if ckpt.is_dir() else ckpt.parent
    meta_dir = Path(model_dir) if model_dir is not None else ckpt_dir  # config + tokenizer: the model's
    if meta_dir is None or not (meta_dir / "config.json").is_file():
        raise ValueError(f"quant_ckpt_file_path={str(ckpt)!r}: no config.json next to it or in the model directory")
    qc = find_quantization_config(ckpt_dir) or find_quantization_config(meta_dir)
    if qc is None:
        raise ValueError(f"quant_ckpt_file_path={str(ckpt)!r}: its config.json has no quantization_config (a float "
                         "checkpoint is loaded as the model itself)")
    read_scheme(qc)  # refuse an unsupported format before anything is read
    files = _weight_files(ckpt)
    meta_files = [f for f in sorted(meta_dir.iterdir()) if f.is_file() and not f.name.endswith(_WEIGHT_FILES)
                  and not f.name.startswith(".") and not f.name.endswith(".index.json")
                  and f.name not in ("qformat.yaml", "qparam.safetensors")]
    digest = _digest(files + meta_files)
    digest = hashlib.sha256(f"{digest}:{act_dtype}".encode()).hexdigest()[:16]
    if cache_dir is None:  # once per process, removed at exit (it holds the unpacked weights)
        from .integrity import process_temp_dir

        root = process_temp_dir("fxcompiler-qckpt-")
    else:
        root = Path(cache_dir) / "models"
    target = root / f"qckpt-{digest}" / meta_dir.name
    if cache_dir is not None:
        from .cache_limits import mark_used

        mark_used(target.parent)  # the entry (models/qckpt-<digest>): recency for the cache size limit
    if _verified(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".qckpt-{digest}.lock"):
        if _verified(target):
            return target
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(read_safetensors(f))
        linears, rest = unpack_checkpoint(tensors, qc)
        del tensors
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            _write(tmp, meta_dir, meta_files, qc, linears, rest, act_dtype, digest, str(ckpt))
            write_checksums(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    log.info("pre-quantised checkpoint %s (%s) unpacked into %s", ckpt, qc.get("quant_method"), target)
    return target


def _write(out: Path, meta_dir: Path, meta_files: list[Path], qc: dict, linears: dict[str, UnpackedLinear],
           rest: dict, act_dtype: str | None, digest: str, source: str) -> None:
    from safetensors.torch import save_file

    from .qformat import ModuleScheme, write_qformat
    from .qparam import save_qparam
    from .quant_config import QuantizationConfig

    for f in meta_files:
        shutil.copy2(f, out / f.name)
    cfg = json.loads((meta_dir / "config.json").read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if act_dtype is None:
        act_dtype = "bf16" if str(cfg.get("torch_dtype", cfg.get("dtype"))) == "bfloat16" else "fp32"
    weights = {k: v.contiguous() for k, v in rest.items()}
    qparam: dict[str, torch.Tensor] = {}
    schemes: dict[str, ModuleScheme] = {}
    for m, lin in linears.items():
        weights[f"{m}.weight"] = lin.dequantize()  # for the capture only; the pass computes with the codes
        qparam[f"{m}.qweight"] = lin.codes
        qparam[f"{m}.weight_scale"] = lin.scales
        if lin.bits == 4:
            qparam[f"{m}.weight_min"] = lin.mins
            schemes[m] = ModuleScheme("int4", lin.group, False)
        else:
            schemes[m] = ModuleScheme("int8", lin.group, True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    bits = {lin.bits for lin in linears.values()}
    config = QuantizationConfig("int4" if bits == {4} else "int8", act_dtype, None)
    write_qformat(out / "qformat.yaml", config, ModuleScheme("keep"), schemes,
                  {"quant_checkpoint": qc.get("quant_method", "?")})
    save_qparam(out / "qparam.safetensors", qparam, {"quant_checkpoint": str(qc.get("quant_method"))})
    (out / RECORD_FILE).write_text(json.dumps({"source": source, "sha256": digest, "quantization_config": qc,
                                               "modules": len(linears)}, indent=1) + "\n")
    (out / ".complete").write_text(json.dumps({"source": source}))
