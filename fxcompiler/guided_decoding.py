"""``GuidedDecodingParams``: the structured-output constraint of one request (vLLM's shape).

Exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar, llguidance's
dialect) is set. The runtime compiles it to a token-bitmask matcher (``runtime/structured_output.py``).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(kw_only=True)
class GuidedDecodingParams:
    """One structured-output constraint; validated (shape only) in ``__post_init__``."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"guided_decoding needs exactly one of {', '.join(_KINDS)}; got {set_ or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, dict):
                raise TypeError(f"guided_decoding.json must be a JSON schema object, got {type(self.json).__name__}")
        if self.json_object is not False and self.json_object is not True:
            raise TypeError("guided_decoding.json_object must be a bool")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"guided_decoding.{name} must be a non-empty str")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError("guided_decoding.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A stable key of the constraint (compiled grammars are cached under it)."""
        value = getattr(self, self.kind)
        return self.kind + ":" + _json.dumps(value, sort_keys=True, separators=(",", ":"))
