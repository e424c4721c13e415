"""``qformat.yaml``: which matmuls are quantized, and how (docs/quantization.md, "Open quantization files").

The first line is furiosa's metadata line (``--weight_dtype int8 --act_dtype bf16 --kv_dtype bf16 ...``,
optionally behind ``#``), parsed as furiosa does (:func:`fxcompiler.quant_config.parse_qformat_metadata`);
it gives the :class:`~fxcompiler.quant_config.QuantizationConfig`. The rest is YAML::

    format: fxcompiler-qformat/1          # optional
    default: {weight: int4, group_size: 128, symmetric: false}   # optional; else from --weight_dtype
    modules:                              # module-name patterns (fnmatch), first match wins
      "model.layers.*.self_attn.*": {weight: int8, granularity: channel}
      "model.layers.0.mlp.down_proj": {weight: bf16}          # kept in high precision
      lm_head: {weight: int8}                                 # the output projection is kept unless named

A scheme is ``weight`` (``int8``, ``int4``, ``fp8`` (e4m3, per channel only), or ``bf16``/``fp32`` = kept),
``granularity`` (``channel`` or ``group``), ``group_size`` (int4: 32, 64, 128 ...; int8: a divisor of K) and
``symmetric`` (int8 is always symmetric; int4 symmetric is Q4_0-style). Module names are
transformers' (``model.layers.0.mlp.down_proj``, ``lm_head``).
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .quant_config import QDtype, QuantizationConfig, parse_qformat_metadata

__all__ = ["ModuleScheme", "QFormat", "load_qformat", "write_qformat"]

FORMAT = "fxcompiler-qformat/1"
_SCHEME_KEYS = {"weight", "granularity", "group_size", "symmetric"}
_TOP_KEYS = {"format", "default", "modules"}


@dataclass(frozen=True)
class ModuleScheme:
    """How one matmul's weight is stored: ``weight`` ``int8`` | ``int4`` | ``fp8`` | ``keep``; ``group_size``
    -1 = per output channel."""

    weight: str
    group_size: int = -1
    symmetric: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QFormat:
    path: str
    sha256: str
    metadata: dict[str, str]
    config: QuantizationConfig
    default: ModuleScheme
    modules: tuple[tuple[str, ModuleScheme], ...] = field(default_factory=tuple)

    def to_options(self) -> dict[str, Any]:
        """The JSON-able form the ``quantize`` pass reads (``rules``/``default``)."""
        return {"default": self.default.to_dict(), "rules": [[p, s.to_dict()] for p, s in self.modules]}


def _err(path: str, msg: str) -> ValueError:
    return ValueError(f"qformat_path={path!r}: {msg}")


def parse_scheme(raw: Any, where: str, path: str) -> ModuleScheme:
    """A :class:`ModuleScheme` from a qformat entry (``where`` names it in errors)."""
    if not isinstance(raw, dict):
        raise _err(path, f"{where} must be a mapping of {sorted(_SCHEME_KEYS)}, got {raw!r}")
    extra = set(raw) - _SCHEME_KEYS
    if extra:
        raise _err(path, f"{where} has unknown keys {sorted(extra)} (allowed: {sorted(_SCHEME_KEYS)})")
    if "weight" not in raw:
        raise _err(path, f"{where} lacks 'weight'")
    try:
        dtype = QDtype.parse(raw["weight"], f"{where}.weight")
    except ValueError as exc:
        raise _err(path, str(exc)) from None
    if dtype in (QDtype.BF16, QDtype.FP32):
        return ModuleScheme("keep")
    if dtype == QDtype.FP8:
        if raw.get("granularity", "channel") != "channel" or raw.get("group_size", -1) != -1:
            raise _err(path, f"{where}: fp8 weights have one scale per output channel (fxc::linear_f8); "
                             "granularity 'group' / a group_size is not available")
        if raw.get("symmetric", True) is not True:
            raise _err(path, f"{where}: fp8 weights are symmetric (fxc::linear_f8 has no zero point)")
        return ModuleScheme("fp8", -1, True)
    gran = raw.get("granularity", "channel" if dtype == QDtype.INT8 and "group_size" not in raw else "group")
    if gran not in ("channel", "group"):
        raise _err(path, f"{where}.granularity must be 'channel' or 'group', got {gran!r}")
    symmetric = raw.get("symmetric", dtype == QDtype.INT8)
    if not isinstance(symmetric, bool):
        raise _err(path, f"{where}.symmetric must be true or false, got {symmetric!r}")
    if dtype == QDtype.INT8 and not symmetric:
        raise _err(path, f"{where}: int8 weights are symmetric (fxc::linear_w8 has no zero point)")
    group = raw.get("group_size", 128 if gran == "group" else -1)
    if isinstance(group, bool) or not isinstance(group, int):
        raise _err(path, f"{where}.group_size must be an int, got {group!r}")
    if gran == "channel":
        if "group_size" in raw and group != -1:
            raise _err(path, f"{where}: granularity 'channel' takes no group_size (got {group})")
        group = -1
    elif group <= 0 or group % 2:
        raise _err(path, f"{where}.group_size must be a positive even number such as 32, 64, 128, got {group}")
    return ModuleScheme(dtype.value, group, symmetric)


def _default_scheme(config: QuantizationConfig) -> ModuleScheme:
    if config.weight == QDtype.INT8:
        return ModuleScheme("int8", -1, True)
    if config.weight == QDtype.INT4:
        return ModuleScheme("int4", 128, False)
    if config.weight == QDtype.FP8:
        return ModuleScheme("fp8", -1, True)
    return ModuleScheme("keep")


def load_qformat(path: str | os.PathLike) -> QFormat:
    """Read and validate a ``qformat.yaml`` (every error names the file and the entry)."""
    import yaml

    path = os.fspath(path)
    meta = parse_qformat_metadata(path)
    try:
        config = QuantizationConfig(meta["weight_dtype"], meta["act_dtype"], meta.get("kv_dtype"))
    except ValueError as exc:
        raise _err(path, f"metadata line: {exc}") from None
    with open(path, "rb") as f:
        data = f.read()
    body = data.decode("utf-8").split("\n", 1)[1] if b"\n" in data else ""
    try:
        doc = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        raise _err(path, f"the body after the metadata line is not valid YAML: {exc}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise _err(path, f"the body must be a mapping with {sorted(_TOP_KEYS)}, got {type(doc).__name__}")
    extra = set(doc) - _TOP_KEYS
    if extra:
        raise _err(path, f"unknown top-level keys {sorted(extra)} (allowed: {sorted(_TOP_KEYS)})")
    if doc.get("format", FORMAT) != FORMAT:
        raise _err(path, f"format {doc['format']!r} is not {FORMAT!r}")
    default = parse_scheme(doc["default"], "default", path) if "default" in doc else _default_scheme(config)
    modules = doc.get("modules") or {}
    if not isinstance(modules, dict):
        raise _err(path, f"'modules' must map module-name patterns to schemes, got {type(modules).__name__}")
    rules = []
    for pattern, raw in modules.items():
        if not isinstance(pattern, str) or not pattern:
            raise _err(path, f"module pattern {pattern!r} must be a non-empty string")
        rules.append((pattern, parse_scheme(raw, f"modules[{pattern!r}]", path)))
    return QFormat(path, hashlib.sha256(data).hexdigest()[:16], meta, config, default, tuple(rules))


def write_qformat(path: str | os.PathLike, config: QuantizationConfig, default: ModuleScheme,
                  modules: dict[str, ModuleScheme] | None = None, extra_metadata: dict[str, str] | None = None) -> None:
    """Write a qformat.yaml (metadata line first) that :func:`load_qformat` reads back."""
    import yaml

    meta = {"weight_dtype": config.weight.value, "act_dtype": config.activation.value,
            "kv_dtype": (config.kv_cache or (config.activation if config.activation.is_float and config.activation != QDtype.FP8
                                             else QDtype.FP32)).value,  # int8 / fp8 activations: an fp32 cache
            **(extra_metadata or {})}
    line = " ".join(f"--{k} {v}" for k, v in meta.items())

    def scheme(s: ModuleScheme) -> dict:
        if s.weight == "keep":
            return {"weight": "bf16"}
        out = {"weight": s.weight, "granularity": "channel" if s.group_size == -1 else "group"}
        if s.group_size != -1:
            out["group_size"] = s.group_size
        out["symmetric"] = s.symmetric
        return out

    body = {"format": FORMAT, "default": scheme(default),
            "modules": {p: scheme(s) for p, s in (modules or {}).items()}}
    with open(path, "w", encoding="utf-8") as f:
        f.write(line + "\n" + yaml.safe_dump(body, sort_keys=False))


def match_rule(name: str, rules: list, default: dict | None) -> tuple[int | None, dict | None]:
    """``(index of the first rule whose pattern matches module ``name``, its scheme)``; ``(None, default)``
    when none does."""
    for i, (pattern, scheme) in enumerate(rules):
        if fnmatch.fnmatchcase(name, pattern):
            return i, scheme
    return None, default
