"""Parameters copied into a huge-page mapping keep their values, shapes, dtypes and ties."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import huge_pages


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that contains ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def _params():
    big = torch.randn(1024, 1024)                       # 4 MiB fp32
    return {
        "w": big,
        "tied": big,                                    # the same tensor under two names
        "bf16": torch.randn(2048, 600).to(torch.bfloat16),
        "small": torch.randn(16),
        "strided": torch.randn(1024, 600).t(),          # not contiguous: stays where it is
    }


def test_moves_large_contiguous_tensors_keeping_values_and_ties():
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this kernel (or FXCOMPILER_HUGE_PAGES=0)")
    params = _params()
    before = {k: v.clone() for k, v in params.items()}
    kept = {k: params[k] for k in ("small", "strided")}
    moved = huge_pages.place_in_huge_pages(params)
    assert moved == (4 << 20) + 2048 * 600 * 2  # each once (the tie too), both multiples of 4 KiB
    for k, v in params.items():
        assert v.dtype == before[k].dtype and v.shape == before[k].shape and v.stride() == before[k].stride()
        assert torch.equal(v, before[k]), k
    assert params["w"] is params["tied"]
    assert params["small"] is kept["small"] and params["strided"] is kept["strided"]
    assert params["w"].data_ptr() % 4096 == 0 and params["bf16"].data_ptr() % 4096 == 0
    # Writable, independent memory: the originals are not aliased.
    params["w"][0, 0] = 123.0
    assert before["w"][0, 0] != 123.0


def test_the_kernel_backs_the_mapping_with_huge_pages():
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this kernel (or FXCOMPILER_HUGE_PAGES=0)")
    params = {"w": torch.randn(8 << 20 >> 2)}          # 8 MiB: at least three whole 2 MiB pages
    huge_pages.place_in_huge_pages(params)
    assert huge_pages.wait(60)                         # MADV_COLLAPSE runs in the background
    assert _huge_bytes_at(params["w"].data_ptr()) >= 2 << 20


def test_the_synchronous_path_faults_huge_pages_before_returning(monkeypatch):
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this kernel (or FXCOMPILER_HUGE_PAGES=0)")
    monkeypatch.setenv("FXCOMPILER_HUGE_PAGES", "sync")
    params = {"w": torch.randn(8 << 20 >> 2)}
    before = params["w"].clone()
    assert huge_pages.place_in_huge_pages(params) == 8 << 20
    assert torch.equal(params["w"], before)
    assert _huge_bytes_at(params["w"].data_ptr()) >= 2 << 20


def test_parameters_read_into_a_region_are_collapsed_in_place_not_copied(tmp_path):
    """A cached program's params.safetensors is read into a param_memory region: no second copy."""
    if not huge_pages.available() or not huge_pages._collapse_supported():
        pytest.skip("needs transparent huge pages and MADV_COLLAPSE (Linux 6.1+)")
    from safetensors.torch import save_file

    from fxcompiler import param_memory
    from fxcompiler.models.safetensors_reader import read_safetensors

    ref = {"w": torch.randn(2048, 1024), "b": torch.randn(3), "h": torch.randn(1536, 1024).to(torch.bfloat16)}
    save_file(ref, str(tmp_path / "p.safetensors"))
    params = read_safetensors(tmp_path / "p.safetensors", region=True)
    region = param_memory.region_of(params["w"])
    assert region is not None and param_memory.region_of(params["h"]).address == region.address
    assert all(t.data_ptr() % param_memory.ALIGN == 0 for t in params.values())
    ptrs = {k: v.data_ptr() for k, v in params.items()}
    assert huge_pages.place_in_huge_pages(params) == 0          # nothing copied
    assert {k: v.data_ptr() for k, v in params.items()} == ptrs
    assert huge_pages.wait(60)
    assert _huge_bytes_at(params["w"].data_ptr()) >= 2 << 20
    for k in ref:
        assert torch.equal(params[k], ref[k]), k
    assert param_memory.region_of(torch.randn(1 << 20)) is None


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("FXCOMPILER_HUGE_PAGES", "0")
    params = _params()
    same = dict(params)
    assert huge_pages.place_in_huge_pages(params) == 0
    assert all(params[k] is same[k] for k in params)


def test_nothing_large_enough_moves_nothing():
    params = {"a": torch.randn(10), "b": torch.randn(100, 100)}
    same = dict(params)
    assert huge_pages.place_in_huge_pages(params) == 0
    assert all(params[k] is same[k] for k in params)


def _mapped_params(tmp_path):
    from safetensors.torch import save_file

    from fxcompiler.models.safetensors_reader import read_safetensors

    ref = {"w": torch.randn(2048, 1024), "b": torch.randn(3), "h": torch.randn(1536, 1024).to(torch.bfloat16)}
    save_file(ref, str(tmp_path / "p.safetensors"))
    return ref, read_safetensors(tmp_path / "p.safetensors", mapped=True)


def test_mapped_parameters_are_made_anonymous_then_collapsed_in_place(tmp_path):
    """A cached program's params.safetensors is mapped (nothing read at start-up); the background thread moves
    it into anonymous memory at the same addresses and collapses that: no copy on the caller's thread."""
    if not huge_pages.available() or not huge_pages._collapse_supported():
        pytest.skip("needs transparent huge pages and MADV_COLLAPSE (Linux 6.1+)")
    from fxcompiler import param_memory

    ref, params = _mapped_params(tmp_path)
    assert param_memory.region_of(params["w"]).file_backed
    ptrs = {k: v.data_ptr() for k, v in params.items()}
    assert huge_pages.place_in_huge_pages(params) == 0          # nothing copied here
    assert huge_pages.wait(60)
    assert {k: v.data_ptr() for k, v in params.items()} == ptrs
    assert not param_memory.region_of(params["w"]).file_backed
    assert _huge_bytes_at(params["w"].data_ptr()) >= 2 << 20
    for k in ref:
        assert torch.equal(params[k], ref[k]), k


@pytest.mark.parametrize("setting", ["0", "sync"])
def test_mapped_parameters_are_made_anonymous_without_collapse(tmp_path, monkeypatch, setting):
    """Huge pages off (or the synchronous path, which copies the large tensors): the mapped region is still
    moved off its file in the background."""
    from fxcompiler import param_memory

    monkeypatch.setenv("FXCOMPILER_HUGE_PAGES", setting)
    ref, params = _mapped_params(tmp_path)
    region = param_memory.region_of(params["b"])
    huge_pages.place_in_huge_pages(params)
    assert huge_pages.wait(60)
    assert param_memory.region_of(params["b"]) is not None and not param_memory.region_of(params["b"]).file_backed
    assert region.address == param_memory.region_of(params["b"]).address
    for k in ref:
        assert torch.equal(params[k], ref[k]), k


def test_finished_background_threads_leave_nothing_behind(tmp_path, monkeypatch):
    """Every LLM on a cached program starts one background thread, and serving never calls wait(): a finished
    thread must not stay referenced (the module kept each one until wait(), ~16 objects per LLM)."""
    import gc
    import threading

    monkeypatch.setenv("FXCOMPILER_HUGE_PAGES", "0")  # the mapped region is still moved off its file

    def stopped() -> list[threading.Thread]:
        gc.collect()
        return [o for o in gc.get_objects()
                if type(o) is threading.Thread and o.name == "fxcompiler-huge-pages" and not o.is_alive()]

    assert not stopped()
    for i in range(3):
        (tmp_path / str(i)).mkdir()
        _, params = _mapped_params(tmp_path / str(i))
        huge_pages.place_in_huge_pages(params)
        for running in [t for t in threading.enumerate() if t.name == "fxcompiler-huge-pages"]:
            running.join(60)
        running = None
    assert not stopped()
    assert huge_pages.wait(0)
