"""Issue 22's acceptance on the real model (SmolLM2-135M-Instruct, fp32):

* ``fxcompiler compile --bisect`` names an injected wrong pass and the node it broke, in one command;
* pattern-matcher fusions written from the docs alone (the RMSNorm snippet of
  docs/writing-a-pass.md, verbatim, and examples/fuse_swiglu.py, each ≤ 30 lines) fire on every
  layer and leave the greedy output unchanged.

The model is exported once for the module: every build here gets a fresh copy of that capture
(torch.export is deterministic; each build still runs its own passes, pipelines and engine).
"""
from __future__ import annotations

import json

import pytest

import fxcompiler.capture
from fxcompiler import LLM, SamplingParams
from fxcompiler.models.sources import DEFAULT_MODEL_ID
from fxcompiler.testing import copy_program

from .test_writing_a_pass_docs import code_lines, pattern_matcher_snippet

pytestmark = pytest.mark.slow

LAYERS = 30
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The GGUF → HF conversion is shared by the module's builds; the compile cache is off (each build
    must run its passes)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FXCOMPILER_COMPILE_CACHE", "0")
    real = fxcompiler.capture.capture
    exported: dict = {}

    def capture_once(model, *args, **kwargs):
        key = (type(model).__name__, model.config.to_json_string(), next(model.parameters()).dtype, args,
               tuple(sorted(kwargs.items())))
        if key not in exported:
            exported[key] = real(model, *args, **kwargs)
        return copy_program(exported[key])

    mp.setattr(fxcompiler.capture, "capture", capture_once)
    yield str(tmp_path_factory.mktemp("smollm2-cache"))
    mp.undo()


def test_compile_bisect_finds_injected_pass_and_node(cache_dir, capsys):
    from fxcompiler.cli import main

    spec = json.dumps({"insert": [{"pass": "tests._pass_fixtures:scale_first_silu", "after": "weight_layout"}]})
    rc = main(["compile", DEFAULT_MODEL_ID, "--max-seq-len-to-capture", "128", "--cache-dir", cache_dir,
               "--bisect", "--passes-json", spec])
    err = capsys.readouterr().err
    assert rc == 1, err[-2000:]
    assert "bisect: pass 'scale_first_silu' changed logits" in err
    assert "first divergent node 'silu_mul" in err and "its inputs ['mul" in err


def test_fusions_written_from_the_docs_fire_and_keep_greedy_output(cache_dir):
    from examples.fuse_swiglu import fuse_swiglu

    scope: dict = {}
    exec(compile(pattern_matcher_snippet(), "docs/writing-a-pass.md", "exec"), scope)
    assert code_lines(pattern_matcher_snippet()) <= 30
    overrides = {"passes": {"disable": ["fuse_rms_norm"],  # the docs' RMSNorm fusion takes its place
                            "insert": [(scope["my_fusion"], {"after": "cse", "must_fire": True}),
                                       (fuse_swiglu, {"after": "fuse_projections", "must_fire": True})]}}
    kw = dict(max_seq_len_to_capture=256, cache_dir=cache_dir)
    fused = LLM(DEFAULT_MODEL_ID, compiler_config_overrides=overrides, **kw)
    history = {h["pass"]: h for h in fused.pass_history}
    assert history["my_fusion"]["matched"] == 2 * LAYERS + 1 and history["fuse_swiglu"]["fused"] == LAYERS
    code = fused._build.graph_module.code
    assert code.count("fxc.rms_norm") == 2 * LAYERS + 1 and code.count("example.swiglu") == LAYERS
    assert "fxc.silu_mul" not in code and "aten.rsqrt" not in code
    base = LLM(DEFAULT_MODEL_ID, **kw)
    assert "example.swiglu" not in base._build.graph_module.code
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    greedy = [llm.generate(None, sp, prompt_token_ids=[PROMPT])[0].outputs[0].token_ids for llm in (fused, base)]
    assert len(greedy[0]) == 24 and greedy[0] == greedy[1]
