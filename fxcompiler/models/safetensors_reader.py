"""Read safetensors files into private memory, tensor by tensor.

``safetensors``' own loader returns views into an mmap of the whole file; while any of
them lives, every page ever read stays resident. The compiler re-lays most weights out
(and frees the originals one by one), so owning each tensor separately keeps peak
memory near one copy of the model instead of two.

With ``region=True`` every tensor is read straight into one page-aligned anonymous mapping
(:mod:`fxcompiler.param_memory`, each tensor on its own 4 KiB boundary): a cached program's
parameters, which the CPU backend then backs with huge pages in place instead of copying.

With ``mapped=True`` nothing is read: the tensors are views of a private copy-on-write mapping of the
whole file (:func:`fxcompiler.param_memory.map_file`; a cached program's parameters, whose checksum the
caller has verified), which :func:`fxcompiler.param_memory.make_anonymous` later moves into anonymous
memory in place. A file whose tensors are not aligned to their element size is read instead.
"""
from __future__ import annotations

import json
import os
import struct

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors(path: str | os.PathLike, *, region: bool = False, mapped: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of one file; raises ``ValueError`` naming the file if it is truncated or malformed.
    ``region``: the tensors are views of one anonymous mapping; ``mapped``: of a private mapping of the
    file itself (see the module doc)."""
    out: dict[str, torch.Tensor] = {}
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0 if region else -1) as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ValueError(f"{path}: corrupt safetensors header length {n}")
        header = json.loads(f.read(n))
        base = 8 + n
        entries = [(name, info) for name, info in header.items() if name != "__metadata__"]
        for name, info in entries:
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            if any(int(d) < 0 for d in info["shape"]) or end - start != _nbytes(info) or base + end > size:
                raise ValueError(f"{path}: tensor {name!r} is truncated or has inconsistent offsets")
        if mapped and all((base + info["data_offsets"][0]) % _DTYPES[info["dtype"]].itemsize == 0
                          for _, info in entries):
            from ..param_memory import map_file

            try:
                _, whole = map_file(path)
            except (OSError, ValueError):  # a file system without mmap: read it instead
                whole = None
            if whole is not None:
                return {name: whole[base + info["data_offsets"][0]:base + info["data_offsets"][1]]
                        .view(_DTYPES[info["dtype"]]).view(info["shape"]) for name, info in entries}
        region = region or mapped
        pool, offset = None, 0
        if region:
            from ..param_memory import aligned, allocate

            total = sum(aligned(_nbytes(info)) for _, info in entries)
            _, pool = allocate(total)
        for name, info in entries:
            start, end = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            if pool is None:
                t = torch.empty(info["shape"], dtype=dtype)
            else:
                nb = _nbytes(info)
                t = pool[offset:offset + nb].view(dtype).view(info["shape"])
                offset += aligned(nb)
            nbytes = t.numel() * t.element_size()
            if end - start != nbytes or base + end > size:
                raise ValueError(f"{path}: tensor {name!r} is truncated or has inconsistent offsets")
            if nbytes:
                f.seek(base + start)
                view, got = memoryview(t.view(-1).view(torch.uint8).numpy()), 0
                while got < nbytes:  # an unbuffered read may return less than asked
                    k = f.readinto(view[got:])
                    if not k:
                        break
                    got += k
                if got != nbytes:
                    raise ValueError(f"{path}: tensor {name!r} is truncated")
            out[name] = t
    return out


def _nbytes(info: dict) -> int:
    count = 1
    for d in info["shape"]:
        count *= int(d)
    return count * torch.empty((), dtype=_DTYPES[info["dtype"]]).element_size()
