"""Speculative decoding against plain decoding, batch 1, greedy (SmolLM2-135M-Instruct fp32 by default).

Three modes share one target LLM (same weights, executables and KV cache; only the engine's
speculator is switched between runs):

* ``plain``  - no speculation;
* ``ngram``  - prompt lookup (``speculative_model="[ngram]"``);
* ``draft``  - a draft model: by default the target's own checkpoint in bfloat16 (``--draft``,
  ``--draft-dtype``; a quantized copy of the target is the better draft once quantization exists).

Two prompt sets: ``quoting`` (repeat / edit a given text: the answer copies the prompt, where
n-gram lookup shines) and ``chat`` (free questions: little to look up, the back-off must keep
n-gram at plain speed). Rounds are interleaved (plain, ngram, draft, plain, ...) and every
figure is a median over rounds. Reported per prompt set and mode: decode tokens/s, the speedup
over plain, the acceptance rate, the mean accepted length (tokens per verify step and sequence),
and whether the greedy outputs equal plain decoding's.

    .venv/bin/python benchmarks/speculative.py [--rounds 5] [--max-tokens 128] [--k 4]

A tokenizer-less test model works too (``--model tests/.../llama --dtype float64``): its prompt
sets are synthetic token ids. Run it alone on the machine: timings of concurrent jobs are meaningless.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.sources import DEFAULT_MODEL_ID

PASSAGE = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
           "the members agreed to increase funding for the public library, to repair the roof of the town hall, "
           "and to plant two hundred trees along the river path before the end of the spring.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
        "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
        "    return total / len(values)\n")
QUOTING = [f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:\n",
           f"Rewrite this code, renaming the variable `total` to `acc`.\n\n{CODE}\nRewritten code:\n",
           f"Correct the spelling and return the full text.\n\n{PASSAGE.replace('the ', 'teh ')}\n\nCorrected:\n"]
CHAT = ["What are three good habits for staying healthy?",
        "Explain why the sky is blue to a ten-year-old.",
        "Write a short poem about the sea."]


def prompt_sets(llm) -> dict[str, list[list[int]]]:
    tok = llm.tokenizer
    if tok is None:  # a tokenizer-less test model: synthetic ids (quoting = a repeated phrase)
        vocab = llm.model_config.vocab_size
        phrase = [(7 * i + 5) % (vocab - 3) + 3 for i in range(16)]
        return {"quoting": [phrase * 3 + [3 + j] for j in range(3)],
                "chat": [[(11 * i + 5 * j) % (vocab - 3) + 3 for i in range(12)] for j in range(3)]}

    def ids(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(text)["input_ids"]

    return {"quoting": [ids(p) for p in QUOTING], "chat": [ids(p) for p in CHAT]}


def run_set(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Batch 1, one prompt after the other: decode tokens/s (first token excluded), outputs, stats delta."""
    eng = llm.engine
    st = eng.stats
    before = (st.spec_proposed_tokens, st.spec_accepted_tokens, st.spec_verified_seqs)
    tokens, seconds, outs = 0, 0.0, []
    for i, p in enumerate(prompts):
        eng.add_request(f"bench-{time.monotonic_ns()}-{i}", p,
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False))
        t_first = None
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if t_first is None and o.outputs[0].token_ids:
                    t_first = time.perf_counter()
                if o.finished:
                    out = o
        n = len(out.outputs[0].token_ids)
        seconds += time.perf_counter() - t_first
        tokens += n - 1
        outs.append(out.outputs[0].token_ids)
    proposed, accepted, verified = (st.spec_proposed_tokens - before[0], st.spec_accepted_tokens - before[1],
                                    st.spec_verified_seqs - before[2])
    return tokens / seconds, outs, {"proposed": proposed, "accepted": accepted, "verified_seqs": verified}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL_ID)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", default=None, help="draft model (default: the target's checkpoint)")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--draft-option", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM(...) keyword of the draft, e.g. keep_gguf_quantization=true (the embedded "
                         "Q4_1 weights natively) or quantize_lm_head=true; repeatable")
    ap.add_argument("--draft-quantization", default=None, metavar="SCHEME",
                    help="the draft as a quantized copy, e.g. W8A16 (llm_config=LLMConfig(quantization_config=...))")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--ngram", default="[ngram]", help="'[ngram]' or '[ngram]:MIN:MAX'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=None, help="build cache (default: the LLM's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from fxcompiler.speculative import _ngram_sizes
    from runtime.proposers import NgramProposer
    from runtime.speculative import SpeculativeConfig, SpeculativeDecoder

    common = dict(max_seq_len_to_capture=args.max_seq_len)
    if args.cache_dir is not None:
        common["cache_dir"] = args.cache_dir
    draft_options = {}
    for item in args.draft_option:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--draft-option expects KEY=VALUE, got {item!r}")
        draft_options[key] = json.loads(value)
    if args.draft_quantization:
        from fxcompiler import LLMConfig, QuantizationConfig

        draft_options["llm_config"] = LLMConfig(quantization_config=QuantizationConfig.from_str(args.draft_quantization))
    draft = LLM(args.draft or args.model, dtype=args.draft_dtype, skip_engine=True, **draft_options, **common)
    llm = LLM(args.model, dtype=args.dtype, speculative_model=draft, num_speculative_tokens=args.k, **common)
    speculators = {"plain": None,
                   "ngram": SpeculativeDecoder(NgramProposer(*_ngram_sizes(args.ngram)), SpeculativeConfig(args.k)),
                   "draft": llm.engine.speculator}
    sets = prompt_sets(llm)
    rates: dict[str, dict[str, list[float]]] = {s: {m: [] for m in speculators} for s in sets}
    counts = {s: {m: {"proposed": 0, "accepted": 0, "verified_seqs": 0} for m in speculators} for s in sets}
    outputs: dict[str, dict[str, list]] = {s: {} for s in sets}
    for _ in range(args.rounds):
        for name, prompts in sets.items():
            for mode, spec in speculators.items():
                llm.engine.speculator = spec
                rate, outs, c = run_set(llm, prompts, args.max_tokens)
                rates[name][mode].append(rate)
                outputs[name].setdefault(mode, outs)
                for key, v in c.items():
                    counts[name][mode][key] += v
    res: dict = {}
    for name in sets:
        plain = statistics.median(rates[name]["plain"])
        res[name] = {}
        for mode in speculators:
            med = statistics.median(rates[name][mode])
            c = counts[name][mode]
            res[name][mode] = {
                "decode_tok_s": med, "speedup": med / plain,
                "acceptance_rate": c["accepted"] / c["proposed"] if c["proposed"] else None,
                "mean_accepted_length": 1 + c["accepted"] / c["verified_seqs"] if c["verified_seqs"] else None,
                "greedy_equal_to_plain": outputs[name][mode] == outputs[name]["plain"]}
    res["setup"] = {"model": args.model, "dtype": args.dtype, "draft": args.draft or args.model,
                    "draft_dtype": args.draft_dtype, "draft_options": {k: str(v) for k, v in draft_options.items()}, "k": args.k, "rounds": args.rounds,
                    "max_tokens": args.max_tokens, "threads": args.threads, "torch": torch.__version__}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
