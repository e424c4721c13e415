"""Quantization configuration with furiosa-llm's names: :class:`QDtype` and :class:`QuantizationConfig`.

``QuantizationConfig(weight, activation, kv_cache=None, use_mcp=True)`` says which dtype the
weights, the activations and the KV cache are computed in; ``str()`` gives furiosa's short form
(``W8A16``, ``W8A8KV8``, ``W4A16KVf8``), :meth:`QuantizationConfig.from_str` parses it back and
:meth:`QuantizationConfig.from_qformat` reads the metadata first line of a furiosa ``qformat.yaml``
(``--weight_dtype int8 --act_dtype bf16 --kv_dtype bf16 ...``, argparse-style, as furiosa does).

What fxcompiler executes today (anything else raises ``NotImplementedError`` with the reason,
never silently casts; see docs/quantization.md):

* ``W16A16`` (bf16 weights and activations): the ``auto_bfloat16_cast`` pass;
* ``W8A16`` / ``W8A32`` (int8 weights, float activations): ``fxc::linear_w8`` (symmetric,
  per-channel or per-group scales);
* ``W4A16`` / ``W4A32``: ``fxc::linear_w4`` (asymmetric int4, scale and min per group of 32/64/128);
* ``Wf8A16`` / ``Wf8A32`` (fp8 e4m3 weights, float activations): ``fxc::linear_f8`` (a scale per
  output channel, ``amax / 448``);
* ``Wf8Af8`` (furiosa's ``w_f8_a_f8``): ``fxc::linear_f8f8``: the same weights, each matmul's input quantized
  per token to e4m3 at run time (``amax / 448``), fp32 products and sums; the rest of the model runs in fp32;
* ``W8A8`` (furiosa's ``w_i8_a_i8``, KV cache bf16/fp32 or unset): ``fxc::linear_w8a8`` (int8 weights, a scale
  per output channel; each matmul's input quantized per token to int8 at run time, int32 dot products);
  the rest of the model runs in fp32;
* ``W4A8`` (int4 weights as W4A16's, int8 activations): ``fxc::linear_w4a8``, each matmul's input quantized per
  token and weight group to int8 at run time (llama.cpp's Q4_1 × Q8_1 numerics), int32 dot products; with
  ``keep_gguf_quantization`` a GGUF's native int4 blocks run so too; the rest of the model runs in fp32;
* ``...KV8`` / ``...KVf8`` (an int8 / fp8 e4m3 KV cache with any scheme above: ``W8A8KV8``, ``W4A16KVf8``,
  ``Wf8Af8KVf8``): the quantized paged KV cache (``kv_cache_dtype="int8"`` / ``"fp8"``).
"""
from __future__ import annotations

import enum
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any

__all__ = ["QDtype", "QuantizationConfig", "parse_qformat_metadata", "supported_reason"]


class QDtype(str, enum.Enum):
    """Data types of furiosa's quantization configs."""

    INT4 = "int4"
    INT8 = "int8"
    FP8 = "fp8"
    BF16 = "bf16"
    FP32 = "fp32"

    @property
    def bits(self) -> int:
        return {"int4": 4, "int8": 8, "fp8": 8, "bf16": 16, "fp32": 32}[self.value]

    @property
    def is_float(self) -> bool:
        return self in (QDtype.FP8, QDtype.BF16, QDtype.FP32)

    @classmethod
    def parse(cls, value: "QDtype | str", what: str = "dtype") -> "QDtype":
        """Accepts a member, its value or name, and the aliases furiosa's qformat files use
        (``fp8-E4M3``, ``float32``, ``bfloat16``, ``i8``, ...)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip().lower().replace("_", "-")
            aliases = {"i4": "int4", "i8": "int8", "float8": "fp8", "fp8-e4m3": "fp8", "f8": "fp8",
                       "e4m3": "fp8", "bfloat16": "bf16", "float32": "fp32", "float": "fp32", "f32": "fp32"}
            text = aliases.get(text, text)
            for member in cls:
                if text == member.value:
                    return member
        raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}")


_SHORT = {QDtype.INT4: "4", QDtype.INT8: "8", QDtype.FP8: "f8", QDtype.BF16: "16", QDtype.FP32: "32"}


@dataclass(frozen=True)
class QuantizationConfig:
    """furiosa-llm's ``QuantizationConfig``: the dtypes of weights, activations and KV cache.

    ``use_mcp`` (furiosa's "model compressor pipeline" switch) is recorded; fxcompiler's own
    ``quantize`` pass does the work either way."""

    weight: QDtype = QDtype.BF16
    activation: QDtype = QDtype.BF16
    kv_cache: QDtype | None = None
    use_mcp: bool = True

    def __post_init__(self):
        object.__setattr__(self, "weight", QDtype.parse(self.weight, "QuantizationConfig.weight"))
        object.__setattr__(self, "activation", QDtype.parse(self.activation, "QuantizationConfig.activation"))
        if self.kv_cache is not None:
            object.__setattr__(self, "kv_cache", QDtype.parse(self.kv_cache, "QuantizationConfig.kv_cache"))
        if not isinstance(self.use_mcp, bool):
            raise TypeError(f"QuantizationConfig.use_mcp must be a bool, got {self.use_mcp!r}")
        if self.activation == QDtype.INT4:
            raise ValueError("QuantizationConfig.activation=int4 is not a furiosa scheme (activations are int8, "
                             "fp8, bf16 or fp32)")

    # -- furiosa's presets --------------------------------------------------------------------------
    @classmethod
    def w_i8_a_i8_kv_i8(cls) -> "QuantizationConfig":
        return cls(QDtype.INT8, QDtype.INT8, QDtype.INT8)

    @classmethod
    def w_i8_a_i8(cls) -> "QuantizationConfig":
        return cls(QDtype.INT8, QDtype.INT8, QDtype.BF16)

    @classmethod
    def w_f8_a_f8_kv_f8(cls) -> "QuantizationConfig":
        return cls(QDtype.FP8, QDtype.FP8, QDtype.FP8)

    @classmethod
    def w_f8_a_f8(cls) -> "QuantizationConfig":
        return cls(QDtype.FP8, QDtype.FP8, QDtype.BF16)

    @classmethod
    def w_4_a_16_kv_f8(cls) -> "QuantizationConfig":
        return cls(QDtype.INT4, QDtype.BF16, QDtype.FP8)

    @classmethod
    def w_16_a_16_kv_16(cls) -> "QuantizationConfig":
        return cls(QDtype.BF16, QDtype.BF16, QDtype.BF16)

    @classmethod
    def w_16_a_16(cls) -> "QuantizationConfig":
        return cls(QDtype.BF16, QDtype.BF16, None)

    # fxcompiler's weight-only presets (the schemes with CPU kernels)
    @classmethod
    def w_i8_a_16(cls) -> "QuantizationConfig":
        return cls(QDtype.INT8, QDtype.BF16, None)

    @classmethod
    def w_4_a_16(cls) -> "QuantizationConfig":
        return cls(QDtype.INT4, QDtype.BF16, None)

    @classmethod
    def w_f8_a_16(cls) -> "QuantizationConfig":
        return cls(QDtype.FP8, QDtype.BF16, None)

    # -- short form ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        text = f"W{_SHORT[self.weight]}A{_SHORT[self.activation]}"
        if self.kv_cache is not None:
            text += f"KV{_SHORT[self.kv_cache]}"
        return text

    @classmethod
    def from_str(cls, text: str) -> "QuantizationConfig":
        """Parse ``W8A16``, ``W8A8KV8``, ``W4A16KVf8``, ``W16A16`` (case-insensitive)."""
        if not isinstance(text, str):
            raise TypeError(f"QuantizationConfig.from_str expects a str, got {type(text).__name__}")
        m = re.fullmatch(r"w(4|8|f8|16|32)a(8|f8|16|32)(?:kv(8|f8|16|32))?", text.strip().lower())
        if m is None:
            raise ValueError(f"not a quantization scheme string: {text!r} (expected e.g. 'W8A16', 'W8A8KV8', "
                             "'W4A16KVf8', 'W16A16')")
        inverse = {v: k for k, v in _SHORT.items()}
        w, a, kv = (inverse[g] if g is not None else None for g in m.groups())
        return cls(w, a, kv)

    @classmethod
    def from_qformat(cls, path: str | os.PathLike) -> "QuantizationConfig":
        """The config a furiosa ``qformat.yaml`` describes, read from its metadata first line."""
        meta = parse_qformat_metadata(path)
        return cls(meta["weight_dtype"], meta["act_dtype"], meta.get("kv_dtype"))

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight.value, "activation": self.activation.value,
                "kv_cache": None if self.kv_cache is None else self.kv_cache.value, "use_mcp": self.use_mcp}


def parse_qformat_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``--key value`` pairs of a qformat.yaml's first line (furiosa writes its model-compressor
    arguments there, as a YAML comment or a plain line): ``weight_dtype``, ``act_dtype``,
    ``kv_dtype``, ``weight_calib_method``, ... Raises ``ValueError`` naming the file when the line
    is missing or lacks ``--weight_dtype``/``--act_dtype``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except OSError as exc:
        raise ValueError(f"qformat_path={path!r} cannot be read: {exc}") from exc
    line = first.strip().lstrip("#").strip()
    if not line.startswith("--"):
        raise ValueError(f"qformat_path={path!r}: the first line must be furiosa's metadata line "
                         f"('--weight_dtype ... --act_dtype ... --kv_dtype ...'), got {first.strip()[:80]!r}")
    tokens = shlex.split(line)
    out: dict[str, str] = {}
    key = None
    for tok in tokens:
        if tok.startswith("--"):
            key = tok[2:].replace("-", "_")
            if "=" in key:
                key, value = key.split("=", 1)
                out[key] = value
                key = None
            else:
                out[key] = "true"
        elif key is not None:
            out[key] = tok
            key = None
        else:
            raise ValueError(f"qformat_path={path!r}: metadata line has a value {tok!r} without a --key")
    for required in ("weight_dtype", "act_dtype"):
        if required not in out:
            raise ValueError(f"qformat_path={path!r}: metadata line lacks --{required}")
    return out


def supported_reason(config: QuantizationConfig) -> str | None:
    """None when fxcompiler executes ``config``; else why not (the NotImplementedError text)."""
    if config.activation == QDtype.INT8 and config.weight not in (QDtype.INT8, QDtype.INT4):
        return (f"{config}: int8 activations are built with int8 or int4 weights only (W8A8: fxc::linear_w8a8, "
                "W4A8: fxc::linear_w4a8)")
    if config.activation == QDtype.FP8 and config.weight != QDtype.FP8:
        return (f"{config}: fp8 activations are built with fp8 weights only (Wf8Af8: fxc::linear_f8f8); "
                f"{config.weight.value} weights take bf16 or fp32 activations")
    if config.weight == QDtype.FP32 and config.activation != QDtype.FP32:
        return f"{config}: fp32 weights with {config.activation.value} activations is not a supported scheme"
    return None
