"""Executors/compilers per (supertask kind × device kind); a registry maps kinds to them."""
from __future__ import annotations

from typing import Callable

BACKENDS: dict[tuple[str, str], Callable] = {}


def register_backend(kind: str, device_kind: str):
    def deco(factory):
        BACKENDS[(kind, device_kind)] = factory
        return factory

    return deco


def get_backend(kind: str, device_kind: str):
    from . import dfg, edf, fx  # noqa: F401  (registers the built-in backends)

    try:
        return BACKENDS[(kind, device_kind)]
    except KeyError:
        raise NotImplementedError(
            f"no backend for supertask kind {kind!r} on device kind {device_kind!r}; "
            f"registered: {sorted(BACKENDS)}") from None
