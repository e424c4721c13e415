"""Structured output cost: decode tokens/s of a batch constrained by a JSON schema vs the same batch
unconstrained (SmolLM2 by default, fp32, interleaved rounds, one process), and the share of the
constrained objects that parse and validate.

    .venv/bin/python benchmarks/structured.py [--model ID] [--batch 16] [--tokens 96] [--rounds 3] [--json out.json]

Both sides use the same seeds and prompts and generate the same number of tokens per row: each round runs the
constrained batch first (a JSON object ends with EOS after 20-60 tokens), then the unconstrained batch with
``max_tokens`` set to each row's constrained length and ``ignore_eos=True``, so the two runs step through the
same batch sizes and only the mask differs (otherwise the constrained batch, shrinking to one row as its objects
end, would be compared with a full batch). tok/s counts generated tokens over the wall time of
``LLM.generate`` (prefill included on both sides). The issue's target: constrained ≥ 0.85× unconstrained.
Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPT = "Describe a fictional person as JSON with a name, an age and a few tags:"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jsonschema

    from fxcompiler import GuidedDecodingParams, LLM, SamplingParams

    llm = LLM(args.model)
    prompts = [PROMPT] * args.batch

    def params(guided, lengths=None):
        g = GuidedDecodingParams(json=SCHEMA) if guided else None
        return [SamplingParams(temperature=0.8, seed=i, guided_decoding=g,
                               max_tokens=args.tokens if lengths is None else lengths[i],
                               ignore_eos=lengths is not None)
                for i in range(args.batch)]

    lengths: list[int] = []

    def run(guided):
        ps = params(True) if guided else params(False, lengths)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, ps)
        dt = time.perf_counter() - t0
        if guided:
            lengths[:] = [len(o.outputs[0].token_ids) for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt, outs

    run(True), run(False)  # warm-up (and the grammar compiled once)
    rates = {False: [], True: []}
    valid = total = 0
    for _ in range(args.rounds):
        for guided in (True, False):
            rate, outs = run(guided)
            rates[guided].append(rate)
            if guided:
                for o in outs:
                    total += 1
                    try:
                        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
    plain, constrained = statistics.median(rates[False]), statistics.median(rates[True])
    ratio = statistics.median(c / p for c, p in zip(rates[True], rates[False]))  # per-round ratios
    result = {"model": args.model, "batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
              "tokens_per_row": lengths, "unconstrained_tok_s": plain, "constrained_tok_s": constrained, "ratio": ratio,
              "per_round_ratios": [c / p for c, p in zip(rates[True], rates[False])],
              "valid_objects": valid, "objects": total}
    print(f"unconstrained {plain:.1f} tok/s, json_schema {constrained:.1f} tok/s, ratio {ratio:.3f} "
          f"(median of per-round ratios; target >= 0.85); {valid}/{total} objects valid")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
