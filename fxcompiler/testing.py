"""Test helpers for pass authors (public API): hypothesis strategies, tiny captured models,
and :func:`assert_pass_preserves_semantics`.

    from hypothesis import given
    from fxcompiler import testing

    @given(testing.model_configs(), testing.buckets())
    def test_my_pass(cfg, bucket):
        program = testing.capture_tiny_model(cfg)
        testing.assert_pass_preserves_semantics(MyPass(), program, testing.example_inputs(program, bucket))
"""
from __future__ import annotations

import collections
import copy
import functools
from dataclasses import dataclass

import torch

from .capture import CapturedProgram, capture
from .model_zoo import ZOO, zoo_config, zoo_names  # noqa: F401  (tiny configs of 20 architectures)
from .pass_manager import CompileContext, FunctionPass, Pass, check_pass_result

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")


@dataclass(frozen=True)
class TinyConfig:
    """A small transformers config, hashable so captured programs can be cached per config."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int

    def to_transformers(self):
        from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

        if self.arch == "gpt2":
            return GPT2Config(vocab_size=self.vocab, n_embd=self.hidden, n_layer=self.layers, n_head=self.heads,
                              n_positions=512, n_inner=self.intermediate)
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[self.arch]
        extra = {"sliding_window": 24} if self.arch == "mistral" else {}
        return cls(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                   num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   max_position_embeddings=512, **extra)


@dataclass(frozen=True)
class TestBucket:
    """A concrete input shape: ``batch`` sequences, ``tokens`` new tokens each, ``context`` cached before."""

    batch: int
    tokens: int
    context: int
    block_size: int


def model_configs(archs=ARCHITECTURES, max_layers: int = 2, groups=(1, 3), vocabs=(97,), intermediates=(48,)):
    """Strategy: tiny configs over architectures, depth, width, heads and GQA ratios.

    The defaults keep the space small on purpose (56 configs of 1-2 layers):
    each distinct config costs a ``torch.export`` (≈1 s), and captures are cached per
    config for the whole session, so property tests of many passes share them. Widen
    ``groups`` (query heads per KV head), ``vocabs`` and ``intermediates`` when a pass
    depends on those sizes (97 is deliberately not a multiple of any vector width)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        arch = draw(st.sampled_from(archs))
        kv = draw(st.sampled_from([1, 2]))
        group = 1 if arch == "gpt2" else draw(st.sampled_from(list(groups)))
        heads = kv * group if arch != "gpt2" else draw(st.sampled_from([2, 4]))
        head_dim = draw(st.sampled_from([8, 16]))
        return TinyConfig(arch, draw(st.integers(1, max_layers)), heads * head_dim, heads,
                          heads if arch == "gpt2" else kv, draw(st.sampled_from(list(vocabs))),
                          draw(st.sampled_from(list(intermediates))))

    return build()


def buckets(max_batch: int = 3, max_tokens: int = 12, max_context: int = 40):
    """Strategy: prefill-like (context 0) and decode-like (tokens 1) shapes and chunks in between."""
    from hypothesis import strategies as st

    return st.builds(TestBucket, st.integers(1, max_batch), st.integers(1, max_tokens), st.integers(0, max_context),
                     st.sampled_from([1, 4, 16]))


def _capture_random(config, seed: int, dtype: torch.dtype) -> CapturedProgram:
    """Capture the model of a transformers ``config`` with seeded N(0, 0.2) matrices."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return capture(model)


@functools.lru_cache(maxsize=256)
def _capture_cached(cfg: TinyConfig, seed: int, dtype: torch.dtype) -> CapturedProgram:
    return _capture_random(cfg.to_transformers(), seed, dtype)


def capture_tiny_model(cfg: TinyConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> CapturedProgram:
    """The exported graph of a random tiny model (a fresh copy each call; exports are cached)."""
    program = copy_program(_capture_cached(cfg, seed, dtype))
    program.info["tiny_key"] = (cfg, seed, dtype)
    return program


def copy_program(program: CapturedProgram) -> CapturedProgram:
    gm = copy.deepcopy(program.graph_module)
    return CapturedProgram(gm, list(program.input_specs), dict(program.params), program.geometry,
                           program.export_seconds, dict(program.info))


def example_inputs(program: CapturedProgram, bucket: TestBucket, seed: int = 0) -> dict[str, torch.Tensor]:
    """Valid user inputs for ``bucket``: a random cache context, block tables, slots, positions."""
    return inputs_for_geometry(program.geometry, bucket, seed)


def inputs_for_geometry(g, bucket: TestBucket, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`example_inputs` from a :class:`~fxcompiler.capture.ModelGeometry` alone."""
    gen = torch.Generator().manual_seed(seed)
    B, T, ctx, bs = bucket.batch, bucket.tokens, bucket.context, bucket.block_size
    total = ctx + T
    mb = -(-total // bs)
    nb = B * mb + 1
    table = (torch.randperm(nb - 1, generator=gen)[: B * mb] + 1).view(B, mb)
    pos = ctx + torch.arange(T).repeat(B, 1)
    slots = table.gather(1, pos // bs) * bs + pos % bs
    inputs = {
        "input_ids": torch.randint(0, g.vocab_size, (B, T), generator=gen),
        "position_ids": pos,
        "block_table": table,
        "slot_mapping": slots,
        "seq_lens": torch.full((B,), total, dtype=torch.long),
        "logits_indices": torch.arange(B) * T + (T - 1),
    }
    for i in range(g.num_layers):
        for kv in "kv":
            inputs[f"{kv}_cache_{i}"] = torch.randn(nb, bs, g.num_kv_heads, g.head_dim, generator=gen).to(g.dtype)
    return inputs


def run_program(gm: torch.fx.GraphModule, ctx: CompileContext, inputs: dict[str, torch.Tensor]):
    """Run a graph with its parameters; returns (logits, caches after the step). Inputs are not mutated."""
    fresh = {k: v.to(ctx.geometry.dtype) if "_cache_" in k else v.clone() for k, v in inputs.items()}
    args = [ctx.params[s.target] if s.kind == "param" else fresh[s.target] for s in ctx.input_specs]
    with torch.no_grad():
        out = gm(*args)
    logits = out[0] if isinstance(out, (tuple, list)) else out
    caches = {k: v for k, v in fresh.items() if "_cache_" in k}
    return logits, caches


_PREPARED: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def default_passes_up_to(anchor: str) -> tuple[Pass, ...]:
    """The default pipeline's passes that run before ``anchor`` (a pass name, or an id such as
    ``dce#2``; a pass not in the default list: every default pass), as :func:`get_pass` objects."""
    from .pass_manager import DEFAULT_PASSES, get_pass, pass_ids

    names = list(DEFAULT_PASSES)
    ids = pass_ids([type("_N", (), {"name": n})() for n in names])
    if anchor in ids:
        stop = ids.index(anchor)
    elif anchor in names:
        stop = names.index(anchor)
    else:
        if "#" in anchor:
            raise ValueError(f"{anchor!r} is not a pass id of the default pipeline {ids}")
        get_pass(anchor)  # an unknown name raises here
        stop = len(names)
    return tuple(get_pass(n) for n in names[:stop])


def _run_passes_before(program: CapturedProgram, passes_before) -> tuple[torch.fx.GraphModule, CompileContext]:
    """``program`` after ``passes_before`` (a fresh copy). Results are memoised for tiny models
    when every pass is a registered one (``cache_key``), so property tests of late passes do
    not re-run the whole pipeline in front of them for configs already seen.
    ``passes_before="default-up-to:<pass>"``: the default pipeline in front of that pass."""
    if isinstance(passes_before, str):
        prefix = "default-up-to:"
        if not passes_before.startswith(prefix):
            raise ValueError(f"passes_before must be a sequence of passes or '{prefix}<pass>', got {passes_before!r}")
        passes_before = default_passes_up_to(passes_before[len(prefix):])
    passes = [q if isinstance(q, Pass) else FunctionPass(q) for q in passes_before]
    keys = tuple(getattr(q, "cache_key", None) for q in passes)
    tiny = program.info.get("tiny_key")
    memo = (tiny, keys) if tiny is not None and None not in keys else None
    if memo is not None and memo in _PREPARED:
        gm, specs, params, geometry = _PREPARED[memo]
        _PREPARED.move_to_end(memo)
        return copy.deepcopy(gm), CompileContext(list(specs), dict(params), geometry)
    before = copy_program(program)
    ctx = context_of(before)
    gm = before.graph_module
    for q in passes:
        gm = check_pass_result(q, q(gm, ctx)).graph_module
        gm.recompile()
    if memo is not None:
        _PREPARED[memo] = (copy.deepcopy(gm), list(ctx.input_specs), dict(ctx.params), ctx.geometry)
        while len(_PREPARED) > 128:
            _PREPARED.popitem(last=False)
    return gm, ctx


def context_of(program: CapturedProgram) -> CompileContext:
    return CompileContext(list(program.input_specs), dict(program.params), program.geometry)


def assert_pass_preserves_semantics(p: Pass, program: CapturedProgram, inputs: dict[str, torch.Tensor],
                                    rtol: float = 1e-9, atol: float = 1e-9, passes_before: tuple | str = ()) -> dict:
    """Run ``p`` on a copy of ``program`` (after ``passes_before``: passes, or
    ``"default-up-to:<pass>"`` for the default pipeline in front of ``<pass>``, e.g.
    ``"default-up-to:fuse_rope"`` or ``"default-up-to:dce#2"``) and check that logits and the
    updated KV caches match the graph before ``p`` on the same inputs. The result must honour
    the pass contract (a PassResult with JSON info). Returns the pass's info."""
    gm, ctx_before = _run_passes_before(program, passes_before)
    expected = run_program(gm, ctx_before, inputs)
    ctx_after = CompileContext(list(ctx_before.input_specs), dict(ctx_before.params), ctx_before.geometry)
    gm_after = copy.deepcopy(gm)
    p = p if isinstance(p, Pass) else FunctionPass(p)
    result = p(gm_after, ctx_after)
    info = result.info
    check_pass_result(p, result)  # the contract LLM(...) enforces: a PassResult with JSON info
    result.graph_module.recompile()
    result.graph_module.graph.lint()
    got = run_program(result.graph_module, ctx_after, inputs)
    torch.testing.assert_close(got[0], expected[0], rtol=rtol, atol=atol,
                               msg=lambda m: f"pass {p.name!r} changed the logits: {m}")
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"pass {p.name!r} changed {name}: {m}")
    return info


def zoo_architectures(moe: bool | None = None):
    """Strategy: names of :mod:`fxcompiler.model_zoo` architectures (``zoo_config(name)`` builds the config)."""
    from hypothesis import strategies as st

    return st.sampled_from(zoo_names(moe))


@functools.lru_cache(maxsize=64)
def _capture_zoo_cached(name: str, seed: int, dtype: torch.dtype) -> CapturedProgram:
    return _capture_random(zoo_config(name), seed, dtype)


def capture_zoo_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> CapturedProgram:
    """The exported graph of the tiny zoo architecture ``name`` (a fresh copy each call; exports are cached)."""
    program = copy_program(_capture_zoo_cached(name, seed, dtype))
    program.info["tiny_key"] = ("zoo", name, seed, dtype)
    return program
