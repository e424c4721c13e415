"""``canonicalize_indices``: in-graph index tensors become int32 only where that is exact; the
captured models (whose index tensors are all graph inputs) are left as they are."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch.export import Dim

from fxcompiler import testing
from fxcompiler.pass_manager import get_pass

aten = torch.ops.aten


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(max_layers=2), bucket=testing.buckets())
def test_canonicalize_indices_preserves_semantics(cfg, bucket):
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    placeholders = {n.name: n.meta["val"].dtype for n in program.graph_module.graph.nodes
                    if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    info = testing.assert_pass_preserves_semantics(get_pass("canonicalize_indices"), program, inputs,
                                                   rtol=0, atol=0)
    assert info["converted"] == 0  # nothing in the captured graph builds its own index tensors
    assert placeholders["input_ids"] == placeholders["logits_indices"] == torch.int64


class _Indexing(torch.nn.Module):
    def forward(self, w, x, ids):
        t = ids.shape[1]
        e = F.embedding(torch.arange(t), w)                          # [0, t) → embedding: int32
        rows = (torch.arange(x.shape[0]) * 3 + 1) % x.shape[0]        # bounded arithmetic → index_select: int32
        y = x.index_select(0, rows)
        cols = torch.arange(1, t + 1).unsqueeze(0).expand(2, t) - 1   # views and sub → index.Tensor: int32
        g = w[cols]
        big = x.index_select(0, (torch.arange(t) * 2 ** 29) % x.shape[0])  # t·2^29 may pass 2^31: int64
        given = x.index_select(0, ids[0] % x.shape[0])                # a graph input's arithmetic: int64
        out_idx = torch.arange(t) + 1                                 # returned: int64
        return e.sum() + y.sum() + g.sum() + big.sum() + given.sum(), out_idx


def _export(max_t=16):
    args = (torch.randn(64, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64),
            torch.randint(0, 64, (2, 5)))
    shapes = {"w": None, "x": {0: Dim("n", min=2, max=4096)},
              "ids": {1: Dim("t", min=2, max=max_t) if max_t else Dim("t", min=2)}}
    ep = torch.export.export(_Indexing(), args, dynamic_shapes=shapes, strict=False)
    gm = ep.graph_module
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    return gm


def _aranges(gm):
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (aten.arange.default, aten.arange.start)]


def test_converts_bounded_index_arithmetic_only():
    gm = _export()
    cases = [(torch.randn(64, 8, dtype=torch.float64), torch.randn(n, 8, dtype=torch.float64),
              torch.randint(0, 64, (2, t))) for n, t in ((10, 5), (2, 16), (4096, 3))]
    expected = [gm(*c) for c in cases]
    info = get_pass("canonicalize_indices")(gm, None).info
    gm.recompile()
    gm.graph.lint()
    dtypes = [n.kwargs.get("dtype") for n in _aranges(gm)]
    assert dtypes == [torch.int32, torch.int32, torch.int32, None, None], dtypes
    assert info["sources"] == 3 and info["converted"] == 3 + 3 + 3  # arange; mul,add,rem; unsqueeze,expand,sub
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta["val"].dtype.is_floating_point is False:
            assert node.meta["val"].dtype == torch.int64
        if node.op == "call_function" and node.target is aten.index_select.default:
            assert node.args[2].meta["val"].dtype in (torch.int32, torch.int64)
    for c, e in zip(cases, expected):
        got = gm(*c)
        torch.testing.assert_close(got[0], e[0], rtol=0, atol=0)
        assert got[1].dtype == torch.int64 and torch.equal(got[1], e[1])


def test_unbounded_sizes_stay_int64():
    gm = _export(max_t=None)  # t has no maximum: arange(t) might not fit in int32
    info = get_pass("canonicalize_indices")(gm, None).info
    assert [n.kwargs.get("dtype") for n in _aranges(gm)] == [None, torch.int32, None, None, None]
    assert info["sources"] == 1  # only the arange over x's rows (n ≤ 4096)
