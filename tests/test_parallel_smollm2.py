"""Tensor and pipeline parallel on the embedded SmolLM2-135M-Instruct (fp32, real weights): tp = 3
and pp = 3 rank workers give one process's greedy tokens for 16 mixed text requests under
continuous batching (a divergence is allowed only at a near-tie of the one-process run's top-2
logprobs, the suite's rule), and every block is free again afterwards.

Kept small for 2 cores running 3 ranks: few buckets, 4-20 new tokens a request, one compile cache
shared by the plans (each rank's shard is its own entry), one LLM per plan, shut down after."""
from __future__ import annotations

import pytest

from fxcompiler import LLM, ManualBucketConfig, SamplingParams
from fxcompiler.models.sources import DEFAULT_MODEL_ID

from .test_smollm2 import PROMPTS
from .test_speculative_smollm2 import _check

pytestmark = pytest.mark.slow

# 16 prompts of 1 to 30 tokens (13 lengths; the prefill buckets hold 32)
REQUESTS = PROMPTS + [
    "Paris",
    "The three primary colours are red,",
    "Question: what is two plus two? Answer:",
    "import numpy as np\n\ndef mean(xs):",
    "A haiku about autumn leaves:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Write a short email to a colleague asking to move tomorrow's meeting to Friday afternoon because",
    "1, 2, 3, 4,",
]
# mixed budgets: requests finish at different steps, so prefill and decode interleave
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + (3 * i) % 17, ignore_eos=True) for i in range(16)]
# few buckets: every rank compiles each one, and they still batch the 16 requests
KW = dict(dtype="float32", max_seq_len_to_capture=64,
          bucket_config=ManualBucketConfig(prefill_buckets=[(1, 32), (4, 32)], decode_buckets=[(4, 64), (16, 64)]))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel-smollm2-cache")


@pytest.fixture(scope="module")
def reference(cache):
    """One process's greedy outputs, with the top-2 logprobs the near-tie rule reads."""
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, logprobs=2) for p in PARAMS]
    with LLM(DEFAULT_MODEL_ID, cache_dir=cache, **KW) as one:
        outs = one.generate(REQUESTS, params)
    assert len({len(o.prompt_token_ids) for o in outs}) >= 10  # mixed prompt lengths
    return outs


def _all_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.blocks.check_invariants()
    assert sched.blocks.num_free_blocks == sched.blocks.num_usable_blocks
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("plan", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 3}], ids=["tp3", "pp3"])
def test_greedy_tokens_equal_one_process(reference, cache, plan):
    with LLM(DEFAULT_MODEL_ID, cache_dir=cache, **plan, **KW) as llm:
        outs = llm.generate(REQUESTS, PARAMS)
        assert [o.prompt_token_ids for o in outs] == [r.prompt_token_ids for r in reference]
        for ref, out, p in zip(reference, outs, PARAMS):
            assert len(out.outputs[0].token_ids) == p.max_tokens
            _check(ref, out.outputs[0].token_ids)
        _all_free(llm)
        got = llm.parallel_plan.to_dict()
        assert (got["tp"], got["pp"]) == (plan.get("tensor_parallel_size", 1), plan.get("pipeline_parallel_size", 1))
        if "pipeline_parallel_size" in plan:  # 30 blocks, 10 a stage
            assert [st["layers"] for st in llm.parallel_stages] == [[0, 10], [10, 20], [20, 30]]
        else:
            assert llm.build_info["comm"] == "shm"
