"""The model support table: which architectures are tested, and which fusions and kernels apply to each.

``fxcompiler models`` prints it; ``docs/models.md`` holds it between markers and
``tests/test_support_table.py`` regenerates it and fails when the checked-in copy differs, so the
documentation never claims what the code does not do. What each column comes from:

* *parity*: the tests that assert greedy token parity with transformers for the architecture
  (``tests/test_model_coverage.py``: float64, 8 prompts x 32 tokens through ``fx``, Qwen3-MoE also
  through ``dfg``/``edf``; Llama, Qwen2, Mistral and GPT-2 in ``tests/test_llm_parity.py``: 8 prompts x 64
  tokens through ``fx``, ``dfg`` and ``edf``). A test failing fails CI, which fails the table check's run.
* *fusions*: measured here: the tiny float32 config is captured and run through the default pass
  pipeline; a pass is listed with the number of rewrites it made (per 2 layers).
* *kernels*: the ``fxc`` ops left in the optimised float32 graph, with ``lower_cpu_kernels`` told that
  ``fxc::linear`` wins everywhere (the real build asks the autotuner per shape; a fixed answer keeps the
  table independent of machine load).

The encoder-task table (between its own markers) comes from the facts of ``tests/test_encoder_tasks.py``:
its parity column is rendered from the checks each case of ``fxcompiler.encoder_zoo`` lists, which that module
runs one by one (it is parametrised over that list), and its fusion and kernel columns are those of the
float64 builds the checks run on (the test compares the table with them; ``fxcompiler models`` redoes the same
capture and passes). ``lower_cpu_kernels`` prepacks fp32/bf16 linears only, so ``fxc::linear`` is absent there.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from .model_zoo import ZOO, zoo_config, zoo_names

FUSION_PASSES = ("fuse_rms_norm", "fuse_silu_mul", "fuse_rope", "fuse_projections", "lower_cpu_kernels",
                 "fuse_linear_silu_mul", "fuse_linear_add", "fuse_qkv_attention")
_COUNT_KEYS = {"fuse_projections": "fused_groups", "lower_cpu_kernels": "lowered"}
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"

# What a user meets beyond the tested configs (measured reasons; docs/models.md explains each).
KNOWN_LIMITS = {
    "llama_dynamic_rope": "NTK rescaling only applies beyond max_position_embeddings, which LLM refuses",
    "phi3": "a sequence crossing original_max_position_embeddings keeps short-factor keys (transformers "
            "re-prefills); qkv split by slicing: no fuse_qkv_attention",
    "qwen3": "per-head q/k norm between projection and rope: no fuse_qkv_attention (the norms fuse as rms_norm)",
    "olmo2": "q/k norm over all heads between projection and head split: no fuse_qkv_attention",
    "exaone4": "q/k norm: no fuse_qkv_attention; full-attention layers have no rope",
    "gemma3": "q/k norm: no fuse_qkv_attention; gelu-tanh MLP: no fuse_silu_mul",
    "gemma2": "gelu-tanh MLP: no fuse_silu_mul",
    "stablelm": "LayerNorm (not RMSNorm); per-head q/k LayerNorm: no fuse_qkv_attention",
    "gptj": "interleaved (rotate-every-two) partial rotary: no fuse_rope; GELU MLP",
    "gpt2": "LayerNorm, GELU MLP, no rope",
    "qwen3_moe": "fxc::moe: C++ experts kernel up to 16 tokens (fp32/bf16), ATen grouped matmuls above; q/k norm",
    "mixtral": "fxc::moe: C++ experts kernel up to 16 tokens (fp32/bf16), ATen grouped matmuls above",
    "gpt_oss": "fxc::moe: C++ experts kernel up to 16 tokens, ATen above; sinks: no fuse_qkv_attention; chunked rope form: "
               "no fuse_rope",
}
PARITY = {name: ("fp64 fx, dfg, edf" if name in ("llama", "qwen3_moe") else "fp64 fx") for name in zoo_names()}
PARITY.update({"qwen2": "fp64 fx, dfg, edf", "mistral": "fp64 fx, dfg, edf", "gpt2": "fp64 fx, dfg, edf"})


@dataclass
class ArchitectureReport:
    name: str
    model_class: str
    constructs: str
    fusions: dict[str, int] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)


class _KernelAlwaysWins:
    """A ``LinearKernelTuner`` whose answer is fixed: fxc::linear is 2x faster (table determinism)."""

    def isa(self) -> str:
        return "fixed"

    def measure(self, k, n, weight_dtype, baseline, ms):
        from .ops.linear import LinearTimings

        return LinearTimings({m: 1.0 for m in ms}, {m: 2.0 for m in ms})


def measure(name: str, dtype: torch.dtype = torch.float32) -> ArchitectureReport:
    """Capture the tiny ``name`` config and run the default pipeline; count fusions and fxc ops."""
    from transformers import AutoModelForCausalLM

    from .capture import capture
    from .pipeline_builder import optimise

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo_config(name), dtype=dtype).eval()
    gm, ctx = optimise(capture(model), {}, [], {"kernel_tuner": _KernelAlwaysWins()})
    entry = ZOO[name]
    return ArchitectureReport(name, entry.model_class, entry.constructs, *_counts(gm, ctx))


def _counts(gm, ctx) -> tuple[dict[str, int], dict[str, int]]:
    """Rewrites per fusion pass (from the pass history) and fxc ops left in the graph."""
    fusions = {}
    for h in ctx.history:
        if h["pass"] in FUSION_PASSES:
            n = int(h.get(_COUNT_KEYS.get(h["pass"], "fused"), 0) or 0)
            fusions[h["pass"]] = fusions.get(h["pass"], 0) + n
    kernels = collections.Counter(str(n.target).split(".")[1] for n in gm.graph.nodes
                                  if n.op == "call_function" and str(n.target).startswith("fxc."))
    return fusions, dict(sorted(kernels.items()))


def _applied(fusions: dict[str, int], kernels: dict[str, int]) -> tuple[str, str]:
    """The table's "fusions applied" and "fxc kernels" cells."""
    return (", ".join(f"{p} {n}" for p, n in fusions.items() if n) or "none",
            ", ".join(f"{k} {n}" for k, n in kernels.items()) or "none")


def _markdown(columns: list[str], rows: list[tuple], begin: str, end: str) -> str:
    """A markdown table of ``rows`` (cells in ``columns`` order) between the markers ``begin`` / ``end``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join([begin, *lines, end])


_COLUMNS_TAIL = ["fusions applied (count, 2 layers)", "fxc kernels in the graph", "known limits"]


def render(reports: list[ArchitectureReport]) -> str:
    """The markdown table (between the markers that docs/models.md keeps it in)."""
    columns = ["architecture", "transformers class", "constructs", "task", "greedy parity tested", *_COLUMNS_TAIL]
    rows = [(r.name, r.model_class, r.constructs, "text generation", PARITY[r.name], *_applied(r.fusions, r.kernels),
             KNOWN_LIMITS.get(r.name, "")) for r in reports]
    return _markdown(columns, rows, BEGIN, END)


def support_table(names: list[str] | None = None) -> str:
    return render([measure(n) for n in (names or zoo_names())])


# -- encoder tasks ----------------------------------------------------------------------------------------
ENCODER_BEGIN, ENCODER_END = "<!-- encoder-table:begin -->", "<!-- encoder-table:end -->"
ENCODER_LIMITS = {
    "bert_qa": "attention is ATen SDPA (no fxc attention kernel); LayerNorm, GELU MLP: no fxc norm/MLP fusion",
    "bert_embed": "attention is ATen SDPA (no fxc attention kernel); LayerNorm, GELU MLP: no fxc norm/MLP fusion",
    "bert_cross_encoder": "attention is ATen SDPA (no fxc attention kernel); LayerNorm, GELU MLP: no fxc "
                          "norm/MLP fusion",
    "xlm_roberta_cross_encoder": "attention is ATen SDPA (no fxc attention kernel); LayerNorm, GELU MLP: no fxc "
                                 "norm/MLP fusion",
    "qwen2_embed": "attention is ATen SDPA over the padded batch (no paged KV cache, no fxc attention kernel); "
                   "fp64: transformers' RMSNorm computes in fp32, a cast the rms_norm pattern does not match",
}


@dataclass
class EncoderReport:
    name: str
    model_class: str
    task: str
    constructs: str
    parity: str
    fusions: dict[str, int] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)


def encoder_report(name: str, ctx, gm) -> EncoderReport:
    """The table row of encoder case ``name`` from a build's compile context (pass history) and optimised graph."""
    from .encoder_zoo import ENCODER_ZOO, parity_text

    case = ENCODER_ZOO[name]
    return EncoderReport(name, case.model_class, case.task, case.constructs, parity_text(case), *_counts(gm, ctx))


def measure_encoder(name: str, dtype: torch.dtype = torch.float64) -> EncoderReport:
    """Capture the tiny encoder case ``name`` for its task as the tests build it (float64) and run the default
    pipeline; count fusions and fxc ops."""
    import transformers

    from .encoder_build import _AUTO_CLASSES
    from .encoder_capture import capture_encoder
    from .encoder_zoo import ENCODER_ZOO, encoder_config
    from .pipeline_builder import optimise

    case = ENCODER_ZOO[name]
    torch.manual_seed(0)
    model = getattr(transformers, _AUTO_CLASSES[case.task]).from_config(encoder_config(name), dtype=dtype).eval()
    gm, ctx = optimise(capture_encoder(model, case.task), {}, [], {"kernel_tuner": _KernelAlwaysWins()})
    return encoder_report(name, ctx, gm)


def render_encoders(reports: list[EncoderReport]) -> str:
    columns = ["case", "transformers class", "constructs", "task", "parity tested", *_COLUMNS_TAIL]
    rows = [(r.name, r.model_class, r.constructs, r.task, r.parity, *_applied(r.fusions, r.kernels),
             ENCODER_LIMITS.get(r.name, "")) for r in reports]
    return _markdown(columns, rows, ENCODER_BEGIN, ENCODER_END)


def encoder_table(names: list[str] | None = None) -> str:
    from .encoder_zoo import encoder_names

    return render_encoders([measure_encoder(n) for n in (names or encoder_names())])


def replace_in(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part between the markers replaced by ``table`` (which includes the markers)."""
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + table + text[stop:]


def extract(text: str, begin: str = BEGIN, end: str = END) -> str:
    return text[text.index(begin): text.index(end) + len(end)]


def cmd_models(archs: list[str] | None, write: str | None, check: str | None) -> int:
    """``fxcompiler models``: print the tables (decoders, encoder tasks); ``write``: put them into a file;
    ``check``: compare (1 if stale). ``archs`` selects zoo architectures and encoder cases by name."""
    from pathlib import Path

    from .encoder_zoo import encoder_names

    decoders = [a for a in archs or () if a not in encoder_names()]
    encoders = [a for a in archs or () if a in encoder_names()]
    tables = []
    if not archs or decoders:
        tables.append((support_table(decoders or None), BEGIN, END))
    if not archs or encoders:
        tables.append((encoder_table(encoders or None), ENCODER_BEGIN, ENCODER_END))
    if write:
        path = Path(write)
        text = path.read_text()
        for table, begin, end in tables:
            text = replace_in(text, table, begin, end)
        path.write_text(text)
    if check:
        text = Path(check).read_text()
        if any(extract(text, begin, end) != table for table, begin, end in tables):
            print(f"{check}: the support table is stale; regenerate with: fxcompiler models --write {check}")
            return 1
    if not (write or check):
        print("\n\n".join(t for t, _, _ in tables))
    return 0
