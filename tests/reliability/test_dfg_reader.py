"""The dfg reader resolves ops only from an allow-list and parses dims without eval."""
from __future__ import annotations

import pytest

from fxcompiler import dfg


@pytest.mark.parametrize("domain, op", [
    (dfg.PYTHON_DOMAIN, "os.system"),
    (dfg.PYTHON_DOMAIN, "subprocess.run"),
    (dfg.PYTHON_DOMAIN, "builtins.exec"),
    (dfg.PYTHON_DOMAIN, "torch.load"),
    (dfg.BUILTIN_DOMAIN, "methodcaller"),
    (dfg.BUILTIN_DOMAIN, "__import__"),
    (dfg.METHOD_DOMAIN, "__reduce_ex__"),
    ("os", "system"),
    ("quantized", "linear"),
    ("aten", "add.Tensor;import os"),
])
def test_ops_outside_the_allow_list_are_refused(domain, op):
    with pytest.raises(dfg.DisallowedOpError):
        dfg._resolve_target(domain, op)


def test_allowed_ops_resolve():
    import operator

    import torch

    assert dfg._resolve_target("aten", "add.Tensor") == ("call_function", torch.ops.aten.add.Tensor)
    assert dfg._resolve_target(dfg.BUILTIN_DOMAIN, "getitem") == ("call_function", operator.getitem)
    assert dfg._resolve_target(dfg.METHOD_DOMAIN, "view") == ("call_method", "view")
    assert dfg._resolve_target("fxc", "rms_norm.default")[1] is torch.ops.fxc.rms_norm.default


def test_dims_are_evaluated_without_eval(tmp_path):
    sentinel = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {sentinel}')"
    assert dfg._dim_value(payload, {}) is None
    assert dfg._dim_value(f"(lambda: open('{sentinel}', 'w'))()", {}) is None
    assert not sentinel.exists()
    sizes = {"s0": 3, "s1": 5}
    assert dfg._dim_value("s0*s1", sizes) == 15
    assert dfg._dim_value("2*s0 + 1", sizes) == 7
    assert dfg._dim_value("Max(s0, s1) - 1", sizes) == 4
    assert dfg._dim_value("s1//s0", sizes) == 1
    assert dfg._dim_value("s9", sizes) is None
    assert dfg._dim_value("s0" + "*s0" * 400, sizes) is None  # longer than any real dim expression
