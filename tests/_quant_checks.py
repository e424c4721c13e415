"""A check shared by the quantize-CLI tests: the engine multiplies by exactly the qparam file's int4 codes."""
from __future__ import annotations

import torch

from fxcompiler.ops.quant_linear import unpack_int4


def assert_engine_uses_file_codes(llm, qp: dict, module: str, group_size: int) -> None:
    """``llm``'s packed int4 weight of ``module`` unpacks to the file's codes, scales and mins bit for bit."""
    base = next(k for k in llm._build.params if module.removeprefix("model.") in k and k.endswith(".q"))[:-2]
    q, s, m = unpack_int4(llm._build.params[base + ".q"], llm._build.params[base + ".scales"],
                          llm._build.params[base + ".mins"], group_size)
    assert torch.equal(q, qp[f"{module}.qweight"]) and torch.equal(s, qp[f"{module}.weight_scale"])
    assert torch.equal(m, qp[f"{module}.weight_min"])
