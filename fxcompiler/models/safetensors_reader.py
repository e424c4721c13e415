"""Read safetensors files into private memory, tensor by tensor.

``safetensors``' own loader returns views into an mmap of the whole file; while any of
them lives, every page ever read stays resident. The compiler re-lays most weights out
(and frees the originals one by one), so owning each tensor separately keeps peak
memory near one copy of the model instead of two.
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


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of one file; raises ``ValueError`` naming the file if it is truncated or malformed."""
    out: dict[str, torch.Tensor] = {}
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ValueError(f"{path}: corrupt safetensors header length {n}")
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            nbytes = t.numel() * t.element_size()
            if end - start != nbytes or base + end > size:
                raise ValueError(f"{path}: tensor {name!r} is truncated or has inconsistent offsets")
            if nbytes:
                f.seek(base + start)
                got = f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
                if got != nbytes:
                    raise ValueError(f"{path}: tensor {name!r} is truncated")
            out[name] = t
    return out
