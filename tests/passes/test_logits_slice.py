"""``logits_slice``: lm_head (and the final norm) run on the sampled rows only."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from fxcompiler import testing
from fxcompiler.pass_manager import DEFAULT_PASSES, get_pass

BEFORE = tuple(DEFAULT_PASSES[:DEFAULT_PASSES.index("logits_slice")])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_logits_slice_preserves_semantics(cfg, bucket):
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    info = testing.assert_pass_preserves_semantics(get_pass("logits_slice"), program, inputs,
                                                   passes_before=tuple(get_pass(n) for n in BEFORE))
    assert info["moved"] >= 1


def _lm_head_input(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    lm_head = out.args[0][0]
    while lm_head.target not in (torch.ops.aten.linear.default, torch.ops.aten.matmul.default):
        lm_head = lm_head.args[0]
    return lm_head


def test_lm_head_and_final_norm_run_after_the_selection():
    cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)  # fp32: the final norm is fused
    ctx = testing.context_of(program)
    gm = program.graph_module
    for name in BEFORE:
        gm = get_pass(name)(gm, ctx).graph_module
    before = _lm_head_input(gm)
    assert before.args[0].target is torch.ops.aten.reshape.default  # captured: lm_head on every row
    result = get_pass("logits_slice")(gm, ctx)
    gm = result.graph_module
    gm.recompile()
    assert result.info["moved"] == 2  # lm_head and fxc::rms_norm
    lm_head = _lm_head_input(gm)
    norm = lm_head.args[0]
    assert norm.target is torch.ops.fxc.rms_norm.default
    select = norm.args[0]
    assert select.target is torch.ops.aten.index_select.default and select.args[2].name == "logits_indices"
    assert select.args[0].target is torch.ops.aten.reshape.default
    # the logits row count is the selection's, not B*T
    inputs = testing.example_inputs(program, testing.TestBucket(3, 7, 5, 4))
    logits, _ = testing.run_program(gm, ctx, inputs)
    assert logits.shape == (3, cfg.vocab)


def test_graph_without_selection_is_untouched():
    cfg = testing.TinyConfig("gpt2", layers=1, hidden=32, heads=4, kv_heads=4, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    ctx = testing.context_of(program)
    gm = program.graph_module
    sel = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index_select.default
               and n.args[2].name == "logits_indices")
    sel.replace_all_uses_with(sel.args[0])
    gm.graph.erase_node(sel)
    result = get_pass("logits_slice")(gm, ctx)
    assert not result.modified and result.info["moved"] == 0
