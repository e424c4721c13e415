"""Parameter memory (``fxcompiler/param_memory.py``) and the safetensors reader's regions: a cached program's
parameters mapped from their file read back exactly, and moved into anonymous memory in place they keep their
addresses and values and no longer follow the file."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fxcompiler import param_memory
from fxcompiler.models.safetensors_reader import read_safetensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64]


def _maps_file(address: int, nbytes: int) -> set[str]:
    """The paths (or '' for anonymous memory) of this process's mappings overlapping [address, +nbytes)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo < address + nbytes and hi > address:
                out.add(fields[5] if len(fields) > 5 else "")
    return out


@st.composite
def tensor_sets(draw):
    n = draw(st.integers(1, 5))
    out = {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 37), min_size=0, max_size=3))
        t = torch.randn(shape) * 50 if dtype.is_floating_point else torch.randint(-100, 100, shape)
        out[f"t{i}"] = t.to(dtype)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_sets())
def test_mapped_tensors_equal_safetensors_own_reader(tensors, tmp_path):
    path = tmp_path / "p.safetensors"
    save_file(tensors, str(path))
    ref = load_file(str(path))
    got = read_safetensors(path, mapped=True)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    ptrs = {k: v.data_ptr() for k, v in got.items()}
    nonempty = [v for v in got.values() if v.numel()]
    if nonempty:
        region = param_memory.region_of(nonempty[0])
        assert region is not None and region.file_backed
        assert param_memory.make_anonymous(region)
        assert not param_memory.region_of(nonempty[0]).file_backed
    assert {k: v.data_ptr() for k, v in got.items()} == ptrs
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


def test_made_anonymous_in_place_the_tensors_no_longer_follow_the_file(tmp_path):
    """Large enough for several 32 MiB pieces: every piece moved, addresses kept, the file then overwritten
    (as a rewritten cache entry would be) without the tensors changing."""
    path = tmp_path / "p.safetensors"
    ref = {"w": torch.randn(9, 1 << 20), "b": torch.randn(5).to(torch.bfloat16), "i": torch.arange(3)}
    save_file(ref, str(path))
    got = read_safetensors(path, mapped=True)
    region = param_memory.region_of(got["w"])
    assert region.file_backed and param_memory.region_of(got["i"]).address == region.address
    assert str(path) in _maps_file(region.address, region.nbytes)
    ptrs = {k: v.data_ptr() for k, v in got.items()}
    assert param_memory.make_anonymous(region)
    assert param_memory.make_anonymous(param_memory.region_of(got["w"]))  # already anonymous: nothing to do
    assert _maps_file(region.address, region.nbytes) == {""}
    assert {k: v.data_ptr() for k, v in got.items()} == ptrs
    data = bytearray(path.read_bytes())
    data[-4096:] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    got["w"][0, 0] = 7.0  # private, writable memory
    assert got["w"][0, 0] == 7.0


def test_writes_before_the_move_are_kept_and_never_reach_the_file(tmp_path):
    path = tmp_path / "p.safetensors"
    save_file({"w": torch.zeros(1 << 20)}, str(path))
    before = path.read_bytes()
    got = read_safetensors(path, mapped=True)
    got["w"][12345] = 3.0
    assert path.read_bytes() == before  # copy-on-write
    assert param_memory.make_anonymous(param_memory.region_of(got["w"]))
    assert got["w"][12345] == 3.0 and got["w"].sum() == 3.0


def test_a_file_with_misaligned_tensors_is_read_not_mapped(tmp_path):
    """safetensors' own writer aligns every tensor to its element size; a file that does not (another writer)
    cannot be viewed in place, so it is read into an anonymous region instead."""
    w = torch.arange(6, dtype=torch.float32)
    header = {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "w": {"dtype": "F32", "shape": [6], "data_offsets": [1, 25]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\x07" + w.numpy().tobytes())
    got = read_safetensors(path, mapped=True)
    assert torch.equal(got["w"], w) and got["b"].tolist() == [7]
    region = param_memory.region_of(got["w"])
    assert region is not None and not region.file_backed


def test_a_truncated_file_is_refused_before_mapping(tmp_path):
    path = tmp_path / "p.safetensors"
    save_file({"w": torch.randn(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated or has inconsistent offsets"):
        read_safetensors(path, mapped=True)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    """A file system without mmap must not make a valid cache entry unreadable (it would be rebuilt every start)."""
    path = tmp_path / "p.safetensors"
    ref = {"w": torch.randn(300, 7)}
    save_file(ref, str(path))

    def no_mmap(_path):
        raise OSError(19, "No such device")

    monkeypatch.setattr(param_memory, "map_file", no_mmap)
    got = read_safetensors(path, mapped=True)
    assert torch.equal(got["w"], ref["w"])
    assert not param_memory.region_of(got["w"]).file_backed


def test_readers_during_the_move_always_see_the_same_bytes(tmp_path):
    """The engine keeps stepping while the background thread moves the region: every read during the move
    (several 32 MiB pieces mremapped under it) gives the file's values, and nothing faults."""
    import threading

    path = tmp_path / "p.safetensors"
    ref = torch.randn(3, 24 << 20 >> 2)  # 72 MiB: three pieces
    save_file({"w": ref}, str(path))
    w = read_safetensors(path, mapped=True)["w"]
    expected = [float(r.sum()) for r in ref]
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seen.append([float(r.sum()) for r in w])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert param_memory.make_anonymous(param_memory.region_of(w))
    finally:
        stop.set()
        reader.join()
    assert seen and all(s == expected for s in seen)
    assert torch.equal(w, ref)


def test_heap_trimmer_trims_once_per_every_bytes_replaced(monkeypatch):
    from fxcompiler import param_memory

    trims = []
    monkeypatch.setattr(param_memory, "trim_heap", lambda: trims.append(1))
    t = param_memory.HeapTrimmer(every=100)
    for n in (40, 40, 30, 99, 1, 10):  # 110 -> trim, then 100 -> trim, then 10 pending
        t.replaced(n)
    assert len(trims) == 2
