"""The multi-host recipe of docs/parallelism.md: the same program on every host under torchrun.

    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        examples/torchrun_generate.py --model MODEL --tp 2 --requests requests.json --out tokens.json

torchrun's world size must be dp × pp × tp (``--dp 2 --tp 2``: 4 ranks, two replicas of two).

Every rank builds its shard inside ``LLM(...)``; ranks other than 0 serve steps there and exit
when rank 0's LLM shuts down, so only rank 0 runs the code after it. ``--requests`` is a JSON
``{"prompt_token_ids": [[...], ...], "max_tokens": [...], "llm": {extra LLM kwargs}}``; greedy
tokens go to ``--out`` (rank 0) after every round, with the round's wall time and tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="generate the requests this many times")
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()

    from fxcompiler import LLM, ManualBucketConfig, SamplingParams

    with open(args.requests) as f:
        req = json.load(f)
    kw = dict(req.get("llm", {}))
    if "buckets" in kw:
        prefill, decode = kw.pop("buckets")
        kw["bucket_config"] = ManualBucketConfig(prefill_buckets=[tuple(b) for b in prefill],
                                                 decode_buckets=[tuple(b) for b in decode])
    with LLM(args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
             data_parallel_size=args.dp, cache_dir=args.cache_dir, **kw) as llm:  # ranks > 0 serve in here and exit
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in req["max_tokens"]]
        print("generating", flush=True)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            outs = llm.generate(None, params, prompt_token_ids=req["prompt_token_ids"])
            seconds = time.perf_counter() - t0
            routed = getattr(llm.engine, "routed", None)  # data parallel: requests each replica received
            with open(args.out + ".tmp", "w") as f:  # after every round, whole (a reader never sees half)
                json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "comm": llm.build_info.get("comm"),
                           "plan": llm.parallel_plan and llm.parallel_plan.to_dict(), "routed": routed, "seconds": seconds,
                           "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds}, f)
            os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
