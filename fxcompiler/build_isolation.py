"""Compile a program in a child process (``LLM(..., compile_in_subprocess=True)``).

On a compile-cache miss, exporting and optimising a model imports and keeps alive what only the build needs
(``torch.export``'s and dynamo's state, sympy, the transformers model classes: ~0.2 GiB of SmolLM2's 0.55 GiB
after a cold ``LLM(...)``). With this option the miss path (capture → passes → compile-cache store, then the
bucket pipelines into the build cache) runs in a fresh interpreter; this process then loads both as cache
hits and never imports the export machinery, so a cold start ends with a warm start's memory. (A program
already cached whose pipelines are not, e.g. new buckets, is built in this process.)

The child gets the :class:`~fxcompiler.build.ProgramRequest` and the weightless
:class:`~fxcompiler.models.loader.LoadedModel` pickled over its stdin: data this process made, never read
from disk. It checks that it computes the parent's cache key, stores the program and prints its build info.
Any failure (the child's own error, a different key, nothing stored) is logged and the build runs in this
process instead, so errors surface exactly as without the option. Only programs the compile cache can hold
are built this way (a cache directory, the cache enabled, fingerprintable options).

Requires: a compile-cache key for the request. Ensures: the same cached program as an in-process miss.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fxcompiler.build")

_INFO_PREFIX = "FXC_BUILD_INFO "
_ROOT = Path(__file__).resolve().parents[1]  # fxcompiler/, passes/, backends/, runtime/ live here


def compile_in_child(request, loaded, *, device: torch.device, cache_dir: str | os.PathLike, key: str,
                     fx_build: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run ``compile_program``'s miss path for ``request`` in a child process, storing the program under ``key``
    in ``cache_dir``; with ``fx_build`` (``_build_fx``'s ``model_name``, ``buckets``, ``block_size``, ``options``,
    ``workers``) the child also builds the bucket pipelines into the build cache. Returns the child's build
    info, or None (logged with the reason) when it did not."""
    # the child tunes and keys the program with the parent's intra-op thread count (part of the key)
    payload = pickle.dumps((request, loaded, str(device), os.fspath(cache_dir), key, fx_build, torch.get_num_threads()))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    log.info("compiling %s in a child process (compile_in_subprocess)", request.model_id)
    try:
        proc = subprocess.run([sys.executable, "-m", "fxcompiler.build_isolation"], input=payload,
                              capture_output=True, env=env, cwd=str(_ROOT), check=False)
    except OSError as e:
        log.warning("compile_in_subprocess: could not start the child (%s); building in this process", e)
        return None
    out = proc.stdout.decode(errors="replace")
    line = next((x for x in reversed(out.splitlines()) if x.startswith(_INFO_PREFIX)), None)
    if proc.returncode != 0 or line is None:
        tail = proc.stderr.decode(errors="replace")[-2000:]
        log.warning("compile_in_subprocess: the child exited with %s; building in this process instead. "
                    "Its last output:\n%s", proc.returncode, tail)
        return None
    return json.loads(line[len(_INFO_PREFIX):])


def _child_main() -> int:
    """The child: build and store the program the parent asked for; print its build info."""
    request, loaded, device, cache_dir, key, fx_build, threads = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(threads)
    from .build import _build_fx, compile_program

    dev = torch.device(device)
    gm, ctx, info = compile_program(request, loaded, device=dev, cache_dir=cache_dir)
    if info.get("cache_key") != key:
        print(f"compile_in_subprocess: the child's cache key {info.get('cache_key')} is not the parent's {key}",
              file=sys.stderr)
        return 3
    if fx_build is not None:
        result = _build_fx((gm, ctx), fx_build["model_name"], fx_build["buckets"], block_size=fx_build["block_size"],
                           device=dev, options=fx_build["options"], cache_dir=cache_dir, program_key=key,
                           workers=fx_build["workers"])
        info["build_cache"] = result.build_cache
    print(_INFO_PREFIX + json.dumps({k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))}),
          flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(_child_main())
