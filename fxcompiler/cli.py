"""``fxcompiler`` command line: ``generate``, interactive streaming ``chat``, ``compile`` (passes and dumps),
``build`` (an artifact directory), ``inspect`` (an artifact's summary) and ``cache`` (the cache folder's size)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time


DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about compilers.",
    "Explain paged attention in one sentence.",
    "List three prime numbers:",
]


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, derived from :class:`~fxcompiler.engine_args.EngineArgs` (the same as ``serve``'s)."""
    from .engine_args import EngineArgs

    EngineArgs.add_cli_args(p)
    p.add_argument("-v", "--verbose", action="store_true")


def _engine_args(args):
    """The :class:`~fxcompiler.engine_args.EngineArgs` of a parsed command (``--artifact DIR`` names the model)."""
    from pathlib import Path

    from .engine_args import EngineArgs

    artifact = getattr(args, "artifact", None)
    if artifact:
        if not (Path(artifact) / "artifact.json").is_file():
            raise ValueError(f"--artifact {artifact}: not an artifact directory (no artifact.json; "
                             "build one with 'fxcompiler build MODEL OUT')")
        args.model = artifact
    return EngineArgs.from_cli_args(args)


# What the CLI samples with when neither a flag nor the model's generation_config.json sets a field.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """Sampling flags; unset ones come from the model's generation_config.json, else the defaults shown."""
    src = "default: the model's generation_config.json, else"
    p.add_argument("--max-tokens", type=int, default=None, help=f"({src} {max_tokens})")
    p.add_argument("--temperature", type=float, default=None, help=f"({src} 0.0, greedy)")
    p.add_argument("--top-p", type=float, default=None, help=f"({src} 1.0)")
    p.add_argument("--top-k", type=int, default=None, help=f"({src} -1)")
    p.add_argument("--min-p", type=float, default=None, help=f"({src} 0.0)")
    p.add_argument("--repetition-penalty", type=float, default=None, help=f"({src} 1.0)")
    p.set_defaults(default_max_tokens=max_tokens)


def _sampling(args, generation_config=None):
    """The flags' ``SamplingParams``: a flag wins, then ``generation_config`` (vLLM's behaviour), then the CLI's
    defaults (``CLI_SAMPLING_DEFAULTS``, ``--max-tokens`` per command)."""
    from .generation_defaults import generation_defaults
    from .sampling_params import SamplingParams

    model = generation_defaults(generation_config)
    fallback = {**CLI_SAMPLING_DEFAULTS, "max_tokens": args.default_max_tokens}
    values = {}
    for name in (*CLI_SAMPLING_DEFAULTS, "max_tokens"):
        flag = getattr(args, name)
        values[name] = flag if flag is not None else model.get(name, fallback[name])
    return SamplingParams(seed=args.seed, **values)


def _make_llm(args):
    engine_args = _engine_args(args)
    t0 = time.perf_counter()
    llm = engine_args.create_llm()
    print(f"[fxcompiler] {llm!r} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    llm = _make_llm(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    sp = _sampling(args, llm.generation_config)
    if args.chat_template:
        messages = [[{"role": "user", "content": p}] for p in prompts]
        t0 = time.perf_counter()
        outs = llm.chat(messages, sp)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(list(prompts), sp)
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    print(f"[fxcompiler] {len(outs)} prompts, {n_tokens} tokens in {seconds:.2f}s: "
          f"{n_tokens / seconds:.1f} tokens/s", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from .sampling_params import SamplingParams

    llm = _make_llm(args)
    sp = _sampling(args, llm.generation_config)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("[fxcompiler] chat: empty line or Ctrl-D to quit, /reset to clear history", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        reply = []

        async def stream():
            async for delta in llm.stream_generate(prompt, SamplingParams.from_optional(
                    max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                    min_p=sp.min_p, repetition_penalty=sp.repetition_penalty, seed=sp.seed),
                    tokenizer_kwargs={"add_special_tokens": False}):
                reply.append(delta)
                print(delta, end="", flush=True)

        t0 = time.perf_counter()
        asyncio.run(stream())
        print(f"\n[{time.perf_counter() - t0:.2f}s]", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_compile(args) -> int:
    """Capture + passes + pipelines without an engine; optionally dump every pass."""
    from .llm import LLM

    engine_args = _engine_args(args)
    overrides = {"dump_dir": args.dump_dir} if args.dump_dir else {}
    if args.passes_json:
        overrides["passes"] = _passes_json(args.passes_json)
    if args.bisect:
        overrides["bisect"] = True
    t0 = time.perf_counter()
    from .pass_manager import PassError

    try:
        engine_args.set_threads()
        llm = LLM(engine_args.model, **engine_args.llm_kwargs(), skip_engine=True, compiler_config_overrides=overrides)
    except PassError as exc:
        print(f"[fxcompiler] {exc}", file=sys.stderr)
        return 1
    if args.bisect:
        print("bisect: every pass's results match the unoptimised graph's")
    seconds = time.perf_counter() - t0
    blobs = {b for p in llm.pipelines for b in p.blobs}
    print(f"model: {llm.model_id}\npipelines: {len(llm.pipelines)} ({llm.pipelines[0].name} ...)\n"
          f"unique graph blobs: {len(blobs)}\ncompile cache: {llm.build_info['compile_cache']}, capture: {llm.build_info['export_seconds']:.2f}s, "
          f"total {seconds:.2f}s")
    for h in llm.pass_history:
        extra = {k: v for k, v in h.items() if k not in ("pass", "id", "modified", "seconds")}
        print(f"  {h.get('id', h['pass']):20s} {h['seconds'] * 1000:8.1f} ms  modified={h['modified']}  {extra}")
    if args.dump_dir:
        print(f"dumps: {args.dump_dir}")
    return 0


def _passes_json(text: str) -> dict:
    """``--passes-json``: the ``passes`` override as JSON text, or ``@FILE`` holding it."""
    import json
    from pathlib import Path

    from .pass_manager import parse_passes_spec

    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        return parse_passes_spec(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--passes-json is not valid JSON: {exc}") from None


def cmd_build(args) -> int:
    """Build an artifact directory (furiosa-llm build)."""
    from .llm import LLM

    engine_args = _engine_args(args)
    if engine_args.is_artifact:
        raise ValueError(f"MODEL {engine_args.model} is an artifact already; build takes a model id, directory or .gguf")
    engine_args.set_threads()
    t0 = time.perf_counter()
    llm = LLM(engine_args.model, **engine_args.llm_kwargs(), use_blockwise_compile=not args.no_blockwise_compile,
              num_blocks_per_supertask=args.num_blocks_per_supertask, param_saved_format=args.param_saved_format,
              skip_engine=True, artifacts_export_path=args.output,
              compiler_config_overrides={"passes": _passes_json(args.passes_json)} if args.passes_json else None)
    print(f"artifact: {args.output}\nmodel: {llm.model_id}\npipelines: {len(llm.pipelines)}\n"
          f"compile cache: {llm.build_info['compile_cache']}\nbuilt in {time.perf_counter() - t0:.1f}s")
    if llm.num_speculative_tokens is not None:
        print(f"speculative: {args.speculative_model}, num_speculative_tokens={llm.num_speculative_tokens}")
    return 0


def _scheme_text(q) -> str:
    """One line for an artifact's recorded quantization (``settings["quantization"]``)."""
    if not q:
        return "none (float weights)"
    weight = q.get("weight")
    if weight == "rules":  # a qformat's per-module schemes
        weight = f"per module (qformat sha256 {q.get('qformat_sha256')}" + (
            f", qparam sha256 {q['qparam']['sha256']})" if q.get("qparam") else ", RTN)")
    parts = [q.get("scheme", "?"), f"weights {weight}"]
    if q.get("group_size") not in (None, -1):
        parts.append(f"group {q['group_size']}")
    if q.get("gguf_sha256"):
        parts.append(f"GGUF blocks kept (sha256 {q['gguf_sha256']})")
    parts.append({True: "lm_head quantized", "native": "lm_head on the GGUF's blocks"}.get(q.get("lm_head"),
                                                                                          "lm_head float"))
    return ", ".join(parts)


def cmd_inspect(args) -> int:
    """Summarise an artifact: manifest, buckets, graph blobs and their reuse, sizes."""
    import json
    from collections import Counter
    from pathlib import Path

    from .artifacts import read_manifest, verify_files

    root = Path(args.artifact)
    m = read_manifest(root)
    if args.verify:
        verify_files(root, m)
    if args.json:
        print(json.dumps(m, indent=1, sort_keys=True))
        return 0
    uses: Counter = Counter()
    for rel in m["pipelines"]:
        data = json.loads((root / rel).read_text())
        for task in data["supertasks"].values():
            if task.get("data_blob"):
                uses[task["data_blob"]] += 1
    total = sum(f["size"] for f in m["files"].values())
    v = m["versions"]
    print(f"artifact {root}  (schema {m['schema_version']}, fxcompiler {v['fxcompiler']}, torch {v['torch']}, "
          f"transformers {v['transformers']})")
    print(f"model: {m['model']['id']} ({m['model']['architecture']}), built {m['created']} on "
          f"{m['host']['machine']}/{m['host']['isa']}")
    g = m["geometry"]
    print(f"geometry: {g['num_layers']} layers, {g['num_kv_heads']} KV heads x {g['head_dim']}, vocab {g['vocab_size']}, "
          f"{g['dtype']}")
    st = m["settings"]
    print(f"buckets: {len(m['buckets']['prefill'])} prefill, {len(m['buckets']['decode'])} decode, "
          f"{len(m['buckets']['all'])} pipelines; max_seq_len_to_capture {st['max_seq_len_to_capture']}, "
          f"block size {st['block_size']}, prefill chunk {st.get('prefill_chunk_size')}")
    print(f"supertask kind: {', '.join(m['supertask_kind'])}; blockwise: {st.get('use_blockwise_compile')} "
          f"({st.get('num_blocks_per_supertask')} block(s) per supertask)")
    print(f"graph blobs: {len(m['graphs'])} unique, {sum(uses.values())} supertask uses")
    for blob_id, entry in sorted(m["graphs"].items()):
        size = m["files"][entry["code"]]["size"]
        print(f"  {blob_id}  {entry['kind']}  used {uses[blob_id]}x  {size / 1024:.1f} KiB code"
              + ("  + constants" if entry.get("constants") else ""))
    print(f"params: {m['params']['file']} ({m['params']['format']}), {m['params']['bytes'] / 2**20:.1f} MiB on device "
          f"{', '.join(m['parallel']['devices'])}")
    print(f"quantization: {_scheme_text(st.get('quantization'))}")
    sp = m.get("speculative")
    if isinstance(sp, dict):  # docs/speculative.md
        where = f"{sp.get('model_id')} in {sp.get('path')}/" if sp.get("method") == "draft_model" else sp.get("model")
        print(f"speculative: {sp.get('method')} {where}, num_speculative_tokens {sp.get('num_speculative_tokens')}")
    print(f"passes: {' -> '.join(p['pass'] for p in m['passes'])}")
    print(f"files: {len(m['files'])}, {total / 2**20:.1f} MiB")
    if args.dot:
        rel = next((r for r in m["pipelines"] if args.pipeline and args.pipeline in r), None) if args.pipeline \
            else next((r for r in m["pipelines"] if "/decode-" in r), m["pipelines"][0])
        if rel is None:
            raise ValueError(f"--pipeline {args.pipeline!r} matches none of {m['pipelines']}")
        Path(args.dot).write_text(pipeline_dot(json.loads((root / rel).read_text())))
        print(f"pipeline DAG of {rel} written to {args.dot} (render: dot -Tsvg {args.dot} -o pipeline.svg)")
    return 0


def pipeline_dot(data: dict) -> str:
    """Graphviz DOT of one pipeline: supertasks (kind, device, blob) joined by the tensors they pass."""
    palette = {"input": "lightgrey", "output": "lightgrey", "fx": "lightblue", "dfg": "palegreen", "edf": "khaki"}
    lines = [f'digraph "{data["name"]}" {{', "  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica];"]
    producer = {}
    for key, task in data["supertasks"].items():
        for out in task["outputs"]:
            producer[out] = key
    for key, task in data["supertasks"].items():
        label = f"{key}: {task['kind']}"
        if task.get("device") is not None:
            label += f"\\ndevice {task['device']}"
        if task.get("data_blob"):
            label += f"\\nblob {task['data_blob'][:10]}"
        params = sum(1 for i in task["inputs"] if data["tensors"].get(i, {}).get("kind") == "param")
        if params:
            label += f"\\n{params} params"
        lines.append(f'  t{key} [label="{label}", fillcolor={palette.get(task["kind"], "white")}];')
    for key, task in data["supertasks"].items():
        for name in task["inputs"]:
            src = producer.get(name)
            if src is not None and data["tensors"].get(name, {}).get("kind") != "param":
                t = data["tensors"].get(name, {})
                lines.append(f'  t{src} -> t{key} [label="{name}\\n{t.get("dtype", "")}{t.get("shape", "")}", fontsize=9];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def cmd_quantize(args) -> int:
    """``fxcompiler quantize MODEL OUT --scheme ...`` (fxcompiler/quantize_model.py)."""
    from .gptq import GPTQConfig
    from .llm import CACHE_DIR
    from .quantize_model import quantize_model

    gptq = GPTQConfig(args.gptq_damp, args.gptq_block_size, args.gptq_act_order, args.w_observer, args.gptq_refit,
                      args.gptq_true_sequential)
    out = quantize_model(args.model_pos, args.output, args.scheme, algorithm=args.algorithm,
                         calib_data=args.calib_data, num_samples=args.num_samples, seq_len=args.seq_len,
                         seed=args.seed, cache_dir=args.cache_dir or CACHE_DIR, gptq=gptq, observer=args.w_observer,
                         smoothquant_alpha=args.smoothquant_alpha, kv_calib_tokens=args.kv_calib_tokens,
                         kv_observer=args.kv_observer, kv_percentile=args.kv_percentile)
    print(f"quantized model: {out} (scheme {args.scheme}, {args.algorithm}); load it with LLM({str(out)!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxcompiler", description="fxcompiler: LLM inference as a graph compiler")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions and report tokens/s")
    _add_engine_args(g)
    _add_sampling_args(g, 64)
    g.add_argument("--prompt", "-p", action="append", help="prompt (repeatable); default: a few demo prompts")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat turn")
    g.add_argument("--artifact", default=None, help="load this artifact directory instead of building --model")
    g.set_defaults(func=cmd_generate)
    k = sub.add_parser("compile", help="build the pipelines without an engine (and dump every pass)")
    _add_engine_args(k)
    k.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (same as --model)")
    k.add_argument("--dump-dir", default=None, help="write before/after code, DOT and op diffs per pass here")
    k.add_argument("--passes-json", default=None, metavar="JSON|@FILE",
                   help='the passes override as JSON, e.g. \'{"disable": ["fuse_rope"], "insert": '
                        '[{"pass": "pkg.mod:my_pass", "after": "dce#2"}]}\'')
    k.add_argument("--bisect", action="store_true", help="compare every pass's results with the unoptimised "
                   "graph's and stop at the first pass (and node) that diverges")
    k.set_defaults(func=cmd_compile)
    b = sub.add_parser("build", help="build an artifact directory (load it with LLM.load_artifact); the engine "
                       "flags are recorded in it (a --speculative-model is written under OUT/speculative_model/)")
    _add_engine_args(b)
    b.add_argument("model_pos", metavar="MODEL", help="model id, HF-format directory or .gguf file")
    b.add_argument("output", metavar="OUT", help="artifact directory to create (must not exist or be empty)")
    b.add_argument("--no-blockwise-compile", action="store_true", help="one supertask per pipeline")
    b.add_argument("--num-blocks-per-supertask", type=int, default=1)
    b.add_argument("--param-saved-format", choices=["safetensors", "pt"], default="safetensors")
    b.add_argument("--passes-json", default=None, metavar="JSON|@FILE", help="the passes override as JSON "
                   "(recorded in the artifact's settings)")
    b.set_defaults(func=cmd_build)
    i = sub.add_parser("inspect", help="summarise an artifact (manifest, buckets, blobs, sizes)")
    i.add_argument("artifact", metavar="ARTIFACT")
    i.add_argument("--verify", action="store_true", help="also check every file's size and sha256")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.add_argument("--dot", default=None, metavar="FILE", help="write one pipeline's supertask DAG as Graphviz DOT")
    i.add_argument("--pipeline", default=None, help="which pipeline for --dot (a substring of its file name; "
                   "default: the first decode pipeline)")
    i.add_argument("-v", "--verbose", action="store_true")
    i.set_defaults(func=cmd_inspect)
    qz = sub.add_parser("quantize", help="write a quantized model directory (qformat, qparam, recipe) LLM(OUT) loads")
    qz.add_argument("model_pos", metavar="MODEL", help="model id, HF-format directory or .gguf file")
    qz.add_argument("output", metavar="OUT", help="directory to create (must not exist or be empty)")
    qz.add_argument("--scheme", required=True,
                    help="w8a16 | w4a16-g32 | w4a16-g64 | w4a16-g128 | fp8 (= wf8a16) | wf8af8 (fp8 weights and "
                         "per-token fp8 activations) | w8a8 | w4a8-g32 | w4a8-g64 | w4a8-g128 (int4 weights, int8 "
                         "activations per token and group), each optionally +kv8 / +kvf8 (e.g. w8a16+kv8: int8 KV "
                         "cache with calibrated static scales; +kvf8: fp8 e4m3), or kv8 / kvf8 alone")
    qz.add_argument("--algorithm", default="rtn", help="rtn | gptq | smoothquant (w8a8 only)")
    qz.add_argument("--smoothquant-alpha", type=float, default=0.5,
                    help="SmoothQuant migration strength in (0, 1]: s = max|X|^a / max|W|^(1-a)")
    qz.add_argument("--gptq-damp", type=float, default=0.01, help="GPTQ damping, a fraction of mean(diag H)")
    qz.add_argument("--gptq-block-size", type=int, default=128, help="GPTQ lazy-update block (columns)")
    qz.add_argument("--gptq-act-order", action="store_true", help="GPTQ columns by decreasing H[i, i] (static groups)")
    qz.add_argument("--gptq-refit", action="store_true",
                    help="GPTQ: after rounding, the least-squares scales/mins of each row for its codes")
    qz.add_argument("--gptq-true-sequential", action="store_true",
                    help="GPTQ: inside each decoder layer, quantize q/k/v, o, gate/up, down in turn, each on inputs "
                         "through the already quantized ones")
    qz.add_argument("--w-observer", default="minmax", choices=("minmax", "mse"),
                    help="how each weight group's (fp8: channel's) grid is chosen, RTN and GPTQ: minmax (RTN's "
                         "formula) | mse (search for the least squared rounding error; int8 stays amax/127)")
    qz.add_argument("--calib-data", default=None, metavar="FILE",
                    help="calibration text (default: the calibration half of CPython's pydoc_data.topics)")
    qz.add_argument("--num-samples", type=int, default=128)
    qz.add_argument("--seq-len", type=int, default=512)
    qz.add_argument("--kv-calib-tokens", type=int, default=None,
                    help="kv8 / kvf8: tokens of the calibration text prefilled to find the KV scales (default 1024)")
    qz.add_argument("--kv-observer", default="minmax", choices=("minmax", "percentile"),
                    help="kv8 / kvf8: each layer's and KV head's scale from the absmax (minmax) or a percentile of "
                         "|x| (percentile), times 1.05")
    qz.add_argument("--kv-percentile", type=float, default=None,
                    help="--kv-observer percentile: which percentile of |x|, in (0, 100] (default 99.99)")
    qz.add_argument("--seed", type=int, default=0)
    qz.add_argument("--cache-dir", default=None)
    qz.add_argument("-v", "--verbose", action="store_true")
    qz.set_defaults(func=cmd_quantize)
    c = sub.add_parser("chat", help="interactive chat with streaming output")
    _add_engine_args(c)
    _add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--artifact", default=None, help="load this artifact directory instead of building --model")
    c.set_defaults(func=cmd_chat)
    m = sub.add_parser("models", help="the model support table (measured: fusions and kernels per architecture)")
    m.add_argument("--arch", action="append", default=None, help="only these zoo architectures (repeatable)")
    m.add_argument("--write", default=None, metavar="FILE", help="replace the table between the markers in FILE")
    m.add_argument("--check", default=None, metavar="FILE", help="exit 1 when FILE's table differs")
    m.add_argument("-v", "--verbose", action="store_true")
    m.set_defaults(func=cmd_models)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (docs/serving.md)")
    from .serving.cli_args import add_serve_args

    add_serve_args(s)
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=cmd_serve)
    bn = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = bn.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="open-loop client: TTFT/TPOT/ITL/latency percentiles, throughput")
    from .serving.bench import add_bench_serve_args

    add_bench_serve_args(bs)
    bs.add_argument("-v", "--verbose", action="store_true")
    bs.set_defaults(func=cmd_bench_serve)
    _add_cache_parser(sub)
    return parser


def _add_cache_parser(sub) -> None:
    """``fxcompiler cache info|prune|clear`` (fxcompiler/cache_limits.py)."""
    from .cache_limits import KINDS

    ca = sub.add_parser("cache", help="the cache folder's size: info, prune (least recently used first), clear")
    csub = ca.add_subparsers(dest="cache_command", required=True)
    parsers = []
    ci = csub.add_parser("info", help="per-kind totals and entry counts, the size limit, the oldest entries")
    ci.add_argument("--oldest", type=int, default=10, metavar="N", help="list the N least recently used entries")
    ci.set_defaults(func=cmd_cache_info)
    cp = csub.add_parser("prune", help="remove least recently used entries down to the size limit")
    cp.add_argument("--max-size", default=None, metavar="SIZE",
                    help="e.g. 20G, 500M, 1.5GiB or bytes; 0 / none: no size bound (default: "
                         "$FXCOMPILER_CACHE_MAX_SIZE, else 20 GiB)")
    cp.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                    help="also remove every entry not used for DAYS days")
    cp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    cp.set_defaults(func=cmd_cache_prune)
    cc = csub.add_parser("clear", help="remove every entry (of --kind only, if given)")
    cc.add_argument("--kind", action="append", choices=KINDS, default=None, help="only this kind (repeatable)")
    cc.add_argument("--yes", action="store_true", help="required: confirms the removal")
    cc.set_defaults(func=cmd_cache_clear)
    parsers += [ci, cp, cc]
    for p in parsers:
        p.add_argument("--cache-dir", default=None,
                       help="the cache folder (default: $FXCOMPILER_CACHE_DIR, else ~/.cache/fxcompiler)")
        p.add_argument("-v", "--verbose", action="store_true")


def _cache_dir_arg(args):
    from .cache_limits import default_cache_dir

    return args.cache_dir or default_cache_dir()


def _limit_text() -> str:
    from .cache_limits import ENV, format_bytes, max_size

    limit = max_size()
    source = f"{ENV}={os.environ[ENV]}" if os.environ.get(ENV, "").strip() else "the default"
    return f"{'none' if limit is None else format_bytes(limit)} ({source})"


def cmd_cache_info(args) -> int:
    """``fxcompiler cache info``: what each kind holds, the limit, and the entries a prune removes first."""
    from .cache_limits import KINDS, cache_usage, format_bytes, unmanaged_usage

    root = _cache_dir_arg(args)
    t0 = time.perf_counter()
    entries = cache_usage(root)
    scan = time.perf_counter() - t0
    print(f"cache dir: {root}\nlimit: {_limit_text()}")
    print(f"{'kind':<12}{'entries':>8}{'size':>12}")
    for kind in KINDS:
        of = [e for e in entries if e.kind == kind]
        print(f"{kind:<12}{len(of):>8}{format_bytes(sum(e.bytes for e in of)):>12}")
    print(f"{'total':<12}{len(entries):>8}{format_bytes(sum(e.bytes for e in entries)):>12}   (scanned in {scan:.3f}s)")
    other = unmanaged_usage(root)
    if other:
        print("not managed: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in other.items()))
    if entries and args.oldest > 0:
        print("least recently used (pruned first):")
        for e in entries[: args.oldest]:
            print(f"  {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used))}  {format_bytes(e.bytes):>10}  "
                  f"{e.kind}/{e.path.name}")
    return 0


def _print_report(report, verb: str) -> None:
    from .cache_limits import format_bytes

    for e in report.removed:
        print(f"{verb} {e.kind}/{e.path.name} ({format_bytes(e.bytes)}, last used "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e.last_used))})")
    for e in report.busy:
        print(f"left {e.kind}/{e.path.name}: locked by a build, or removed meanwhile")
    print(f"{len(report.removed)} entries, {format_bytes(report.freed)} {'would be ' if report.dry_run else ''}freed: "
          f"{format_bytes(report.bytes_before)} -> {format_bytes(report.bytes_after)}")


def cmd_cache_prune(args) -> int:
    """``fxcompiler cache prune``: least recently used entries out until the total fits the limit."""
    from .cache_limits import max_size, parse_size, prune

    if args.older_than is not None and not args.older_than >= 0:
        raise ValueError(f"--older-than must be a number of days >= 0, got {args.older_than}")
    limit = parse_size(args.max_size, what="--max-size") if args.max_size is not None else max_size()
    older = args.older_than * 86400 if args.older_than is not None else None
    report = prune(_cache_dir_arg(args), limit, older_than=older, dry_run=args.dry_run)
    _print_report(report, "would remove" if args.dry_run else "removed")
    return 0


def cmd_cache_clear(args) -> int:
    """``fxcompiler cache clear --yes``: every entry (of ``--kind``) removed."""
    from .cache_limits import KINDS, prune

    if not args.yes:
        raise ValueError("cache clear removes every entry" + (f" of {', '.join(args.kind)}" if args.kind else "") +
                         "; pass --yes to confirm (or see `fxcompiler cache prune --dry-run`)")
    report = prune(_cache_dir_arg(args), 0, kinds=args.kind or KINDS)
    _print_report(report, "removed")
    return 0


def cmd_bench_serve(args) -> int:
    from .serving.bench import run_bench_serve

    return run_bench_serve(args)


def cmd_serve(args) -> int:
    from .serving.api_server import run_server

    return run_server(args)


def cmd_models(args) -> int:
    from .support import cmd_models as run

    return run(args.arch, args.write, args.check)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_pos", None):
        args.model = args.model_pos
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except (ValueError, TypeError, NotImplementedError) as exc:
        print(f"fxcompiler: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
