"""Capture cache: the exported program *before* any pass, keyed by the model and the capture settings only.

The compile cache (:mod:`fxcompiler.compile_cache`) keys the optimised program by everything,
the compiler options included, so a build with another pass list, quantization scheme, dtype cast
or an inserted user pass misses it and used to load the checkpoint and run ``torch.export`` again
(~15 s of a 30-layer model's cold build on 2 cores). What ``torch.export`` produces depends only on
the model (files, ``hf_overrides``, dtype, random-weight seed), the KV block size, the device kind
and the code and library versions, so it is cached on its own, in
``cache_dir/captured/<capture key>/``, in the compile cache's entry format (``graph.py``,
``params.safetensors``, ``program.json``, ``checksums.json``: verified before the graph code runs,
written to a temporary directory and renamed; a damaged entry is removed and rebuilt).

A hit gives back the same graph the export gave: the same nodes in the same order under the same
names (``program.json`` records them; the tracer that reads ``graph.py`` back would otherwise
re-derive names such as ``embedding_default``), with ``meta['val']`` re-derived from the
placeholder signature. The passes then run as on a fresh export, so builds that watch them run
(``dump_dir``, ``numeric_check``, bisection, user passes without a ``cache_key``), which never use
the compile cache, use this one. ``FXCOMPILER_COMPILE_CACHE=0`` turns both off.

Requires: a :class:`~fxcompiler.capture.CapturedProgram` straight from :func:`~fxcompiler.capture.capture`
(no pass has run). Ensures: :meth:`CaptureCache.load_captured` returns an equivalent ``CapturedProgram``
whose parameters are private to the caller (the passes may replace them freely).
"""
from __future__ import annotations

import time

from .capture import CapturedProgram
from .compile_cache import CompileCache, save_program, write_entry
from .pass_manager import CompileContext


class CaptureCache(CompileCache):
    """``cache_dir/captured/<key>/`` entries of exported, not yet optimised, programs."""

    DIRECTORY = "captured"
    WHAT = "capture cache"

    def load_captured(self, key: str) -> CapturedProgram | None:
        """The cached export (meta restored, node names kept), or None when absent or damaged."""
        t0 = time.perf_counter()
        program = self.load(key, restore_meta=True)
        if program is None:
            return None
        gm, ctx = program
        return CapturedProgram(gm, list(ctx.input_specs), dict(ctx.params), ctx.geometry, 0.0,
                               {"nodes": len(gm.graph.nodes), "capture_cache": "hit",
                                "load_seconds": time.perf_counter() - t0})

    def store_captured(self, key: str, captured: CapturedProgram) -> None:
        """Write ``captured`` (call before any pass runs on it); an existing entry is kept."""
        ctx = CompileContext(list(captured.input_specs), captured.params, captured.geometry, {})
        written = write_entry(self.path(key), lambda tmp: save_program(tmp, captured.graph_module, ctx,
                                                                       {"stage": "capture"}, node_names=True), self.WHAT)
        self._stored(self.path(key), written)  # marked used; the size limit enforced on the others
