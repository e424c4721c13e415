"""Tensor parallelism end to end: spawned rank workers, shared-memory collectives, faults.

Multi-process tests, kept small (a tiny float64 Llama, 2 ranks) and bounded by timeouts: a
stuck rank fails the test instead of hanging CI."""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fxcompiler import LLM, ManualBucketConfig, SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _prompts(n: int = 16) -> list[list[int]]:
    return [[1] + [(7 * i + 13 * j) % 250 + 3 for j in range(2 + (5 * i) % 11)] for i in range(n)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.conftest import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tp") / "llama", "llama", tie_word_embeddings=True))


@pytest.fixture(scope="module")
def tp_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-cache")


# few buckets: every rank compiles each one (cost), and they still batch the 16 mixed requests
KW = dict(dtype="float64", max_seq_len_to_capture=64,
          bucket_config=ManualBucketConfig(prefill_buckets=[(1, 16), (4, 16)], decode_buckets=[(4, 64), (16, 64)]))
# mixed lengths and budgets: requests finish at different steps, prefill and decode interleave
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + (3 * i) % 17, ignore_eos=True) for i in range(16)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Where the one-process (``one``) and tp=2 (``tp2``) LLMs export their artifacts."""
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="module")
def reference(tiny_llama, tp_cache, artifacts):
    """One process's greedy tokens for the 16 mixed requests."""
    with LLM(tiny_llama, cache_dir=tp_cache, artifacts_export_path=artifacts / "one", **KW) as ref:
        return [o.outputs[0].token_ids for o in ref.generate(None, PARAMS, prompt_token_ids=_prompts())]


@pytest.fixture(scope="module")
def tp_llm(tiny_llama, tp_cache, artifacts):
    llm = LLM(tiny_llama, tensor_parallel_size=2, cache_dir=tp_cache, artifacts_export_path=artifacts / "tp2", **KW)
    yield llm
    llm.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def test_tp2_greedy_tokens_equal_one_process_with_continuous_batching(reference, tp_llm):
    got = [o.outputs[0].token_ids for o in tp_llm.generate(None, PARAMS, prompt_token_ids=_prompts())]
    assert got == reference
    assert tp_llm.build_info["comm"] == "shm"
    placements = tp_llm.parallel_plan.placements
    assert placements and any(v == ["S", 1] for v in placements.values())
    assert tp_llm.parallel_plan.to_dict()["tp"] == 2


def test_artifacts_record_the_plan_load_with_it_and_refuse_another(tp_llm, artifacts, reference, tp_cache):
    import json

    from fxcompiler.artifacts import ArtifactError

    recorded = json.loads((artifacts / "tp2" / "parallel_plan.json").read_text())
    assert (recorded["tp"], recorded["pp"], recorded["world"]) == (2, 1, 2)
    assert recorded["placements"] == tp_llm.parallel_plan.placements
    with LLM.load_artifact(artifacts / "tp2", cache_dir=tp_cache) as again:  # the ranks load their shards
        assert again.parallel_plan.tp == 2 and again.build_info["comm"] == "shm"
        got = [o.outputs[0].token_ids for o in again.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
    with pytest.raises(ArtifactError, match=r"built with tensor_parallel_size=2, pipeline_parallel_size=1, "
                                            r"num_blocks_per_pp_stage=None; loading it with tensor_parallel_size=2, "
                                            r"pipeline_parallel_size=2, .* is refused"):
        LLM.load_artifact(artifacts / "tp2", pipeline_parallel_size=2)
    with pytest.raises(ArtifactError, match=r"built with tensor_parallel_size=2.*loading it with tensor_parallel_size=1"):
        LLM.load_artifact(artifacts / "tp2", tensor_parallel_size=1)
    with pytest.raises(ArtifactError, match=r"rank 1's shard of an artifact built with tensor_parallel_size=2"):
        LLM.load_artifact(artifacts / "tp2" / "rank1")
    with pytest.raises(ArtifactError, match=r"built with tensor_parallel_size=1, pipeline_parallel_size=1.*"
                                            r"loading it with tensor_parallel_size=1, pipeline_parallel_size=2"):
        LLM.from_artifacts(artifacts / "one", pipeline_parallel_size=2)
    # a one-process artifact serves data-parallel replicas
    with LLM.load_artifact(artifacts / "one", data_parallel_size=2, cache_dir=tp_cache) as dp:
        assert len(dp.engine.replicas) == 2
        got = [o.outputs[0].token_ids for o in dp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference


def test_shared_memory_all_reduce_is_exact_and_equals_gloo():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # spawned ranks import the benchmark by name
    try:
        bench = importlib.import_module("allreduce")
        # 1.5 MiB of float64 goes through the 1 MiB slots in two chunks
        rows = bench.run(world=2, sizes=(8, 16384, 3 << 19), iters=3, dtype="float64", timeout=240)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert [r["bytes"] for r in rows] == [8, 16384, 3 << 19]
    assert all(r["shm"] for r in rows)
    assert all(r["exact"] and r["matches_gloo"] for r in rows), rows


def test_killed_rank_is_reported_by_rank_and_every_worker_is_reaped(tiny_llama, tp_llm, tp_cache):
    from runtime.admission import RequestError
    from runtime.workers import WorkerError

    pids = tp_llm._workers.pids()
    victim = pids[1]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    timer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
    timer.start()
    t0 = time.monotonic()
    try:
        # the requests of the failed step carry the WorkerError (main's per-request error isolation)
        with pytest.raises(RequestError, match=r"WorkerError: rank 1 .*SIGKILL") as info:
            for _ in range(200):  # keeps stepping until the kill lands
                tp_llm.generate(None, sp, prompt_token_ids=_prompts())
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 10.5
    assert isinstance(info.value.cause, WorkerError)
    with pytest.raises(RequestError, match=r"WorkerError: rank"):  # the dead group fails fast, never hangs
        tp_llm.generate(None, sp, prompt_token_ids=[[1, 2, 3]])
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    # a new tensor-parallel LLM starts afterwards (its ranks hit the compile cache)
    again = LLM(tiny_llama, tensor_parallel_size=2, cache_dir=tp_cache, **KW)
    try:
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        out = again.generate(None, sp, prompt_token_ids=[[1, 5, 9]])
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        again.shutdown()
    assert not any(_alive(p) for p in again._workers.pids())


def test_impossible_plans_are_refused_before_any_worker_starts(tiny_llama):
    from fxcompiler.mppp import PlanError

    with pytest.raises(PlanError, match=r"tensor_parallel_size=3 does not divide the 4 query heads"):
        LLM(tiny_llama, tensor_parallel_size=3, cache_dir=None, **KW)
    with pytest.raises(PlanError, match=r"names 2 devices but tensor_parallel_size=4"):
        LLM(tiny_llama, tensor_parallel_size=4, devices="cpu:0,cpu:1", cache_dir=None, **KW)


def test_cuda_ranks_are_refused_saying_what_is_missing(tiny_llama):
    for kw in (dict(tensor_parallel_size=2, devices="cuda:0,cuda:1"), dict(devices="cuda:0,cuda:1")):  # tp; dp
        with pytest.raises(NotImplementedError, match=r"parallelism over cuda devices \(NCCL ranks\) is not built: "
                                                      r"a rank worker builds its shard on the LLM's first device"):
            LLM(tiny_llama, cache_dir=None, **kw, **KW)


def test_pp2_greedy_tokens_equal_one_process_and_stages_hold_their_blocks(tiny_llama, tp_cache, reference):
    with LLM(tiny_llama, pipeline_parallel_size=2, cache_dir=tp_cache, **KW) as pp:
        pids = pp._workers.pids()
        got = [o.outputs[0].token_ids for o in pp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        assert pp.engine.runner.micro_batches == 2  # the default: a micro-batch per stage, the stages overlap
        for m in (1, 3):  # one batch a step; more micro-batches than stages (and than some steps' rows)
            pp.engine.runner.micro_batches = m
            assert [o.outputs[0].token_ids for o in pp.generate(None, PARAMS, prompt_token_ids=_prompts())] == reference, m
        assert [st["layers"] for st in pp.parallel_stages] == [[0, 1], [1, 2]]
        assert pp.parallel_plan.to_dict()["pp"] == 2
        # stage 0 holds the embedding, stage 1 the final norm and lm_head; each its own block
        names = set(pp.parallel_plan.placements)
        assert any("layers.0." in n for n in names) and any("layers.1." in n for n in names)
        assert pp.kv_cache_plan.num_blocks >= 2
    assert not any(_alive(p) for p in pids)  # the context manager's shutdown() reaped both stages


def _blocks_all_free(llm):
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_speculative_decoding_with_a_parallel_target_equals_one_process(tiny_llama, tp_cache, reference):
    """The verify steps (k + 1 tokens per sequence) run in the rank workers; the draft (an LLM of the
    same tiny model, so every draft is accepted) and the n-gram proposer run in this process."""
    with LLM(tiny_llama, cache_dir=tp_cache, skip_engine=True, **KW) as draft, \
            LLM(tiny_llama, tensor_parallel_size=2, speculative_model=draft, num_speculative_tokens=3,
                cache_dir=tp_cache, **KW) as tp:
        got = [o.outputs[0].token_ids for o in tp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        st = tp.engine.stats
        assert st.spec_verify_steps > 0 and st.spec_accepted_tokens == st.spec_proposed_tokens > 0
        _blocks_all_free(tp)
    with LLM(tiny_llama, pipeline_parallel_size=2, speculative_model="[ngram]", num_speculative_tokens=3,
             cache_dir=tp_cache, **KW) as pp:
        got = [o.outputs[0].token_ids for o in pp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        assert pp.engine.stats.spec_verify_steps > 0
        _blocks_all_free(pp)


def test_dp2_speculation_a_speculator_per_replica(tiny_llama, tp_cache, reference):
    """Data-parallel replicas each verify their own requests, with the n-gram proposer and with a
    draft model (a draft KV cache per replica); the tokens are one process's."""
    with LLM(tiny_llama, cache_dir=tp_cache, skip_engine=True, **KW) as draft, \
            LLM(tiny_llama, data_parallel_size=2, speculative_model=draft, num_speculative_tokens=3,
                cache_dir=tp_cache, **KW) as dp:
        got = [o.outputs[0].token_ids for o in dp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        specs = [r.speculator for r in dp.engine.replicas]
        assert specs[0] is not specs[1] and specs[0].proposer.blocks is not specs[1].proposer.blocks
        assert specs[0].proposer.runner.kv is not specs[1].proposer.runner.kv
        per = [r.stats.spec_verify_steps for r in dp.engine.replicas]
        assert min(per) > 0 and dp.engine.stats.spec_verify_steps == sum(per), per
        st = dp.engine.stats
        assert st.spec_accepted_tokens == st.spec_proposed_tokens > 0  # the same model drafts: all accepted
        for r in dp.engine.replicas:
            for blocks in (r.scheduler.blocks, r.speculator.proposer.blocks):
                blocks.check_invariants()
                assert blocks.num_free_blocks == blocks.num_usable_blocks
    with LLM(tiny_llama, data_parallel_size=2, speculative_model="[ngram]", num_speculative_tokens=2,
             cache_dir=tp_cache, **KW) as dp:
        got = [o.outputs[0].token_ids for o in dp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        assert all(r.speculator is not None for r in dp.engine.replicas)


def test_parallel_drafts_in_rank_workers_of_their_own(tiny_llama, tp_cache, reference):
    """A tp = 2 draft and a pp = 2 draft (``speculative_draft_*``): the draft's steps run in its own
    rank workers, every draft is accepted (the same model), the tokens are one process's, and the
    target's shutdown reaps the draft's workers."""
    for draft_kw in (dict(speculative_draft_tensor_parallel_size=2),
                     dict(speculative_draft_num_blocks_per_pp_stage=[1, 1])):
        with LLM(tiny_llama, speculative_model=tiny_llama, num_speculative_tokens=3, cache_dir=tp_cache,
                 **draft_kw, **KW) as llm:
            draft = llm.speculative_llm
            pids = draft._workers.pids()
            assert len(pids) == 2 and llm.engine.speculator.proposer.runner is draft.engine.runner
            got = [o.outputs[0].token_ids for o in llm.generate(None, PARAMS, prompt_token_ids=_prompts())]
            assert got == reference, draft_kw
            st = llm.engine.stats
            assert st.spec_verify_steps > 0 and st.spec_accepted_tokens == st.spec_proposed_tokens > 0
            blocks = llm.engine.speculator.proposer.blocks
            blocks.check_invariants()
            assert blocks.num_free_blocks == blocks.num_usable_blocks
            if "speculative_draft_tensor_parallel_size" in draft_kw:  # an LLM the user built with workers
                with pytest.raises(NotImplementedError, match=r"an LLM with rank workers .* as the draft"):
                    LLM(tiny_llama, speculative_model=draft, num_speculative_tokens=2, cache_dir=tp_cache, **KW)
        for pid in pids:  # reaped with the target
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
    with pytest.raises(NotImplementedError, match=r"tensor/pipeline-parallel draft with data_parallel_size=2"):
        LLM(tiny_llama, data_parallel_size=2, speculative_model=tiny_llama, num_speculative_tokens=2,
            speculative_draft_tensor_parallel_size=2, cache_dir=tp_cache, **KW)


def test_speculative_combinations_not_built_are_refused_before_any_worker_starts(tiny_llama):
    with pytest.raises(NotImplementedError, match=r"speculative_draft_data_parallel_size=2 other than the target's"):
        LLM(tiny_llama, speculative_model=tiny_llama, num_speculative_tokens=2,
            speculative_draft_data_parallel_size=2, **KW)
    with pytest.raises(ValueError, match=r"speculative_draft_tensor_parallel_size must be a positive int, got 0"):
        LLM(tiny_llama, speculative_model=tiny_llama, num_speculative_tokens=2,
            speculative_draft_tensor_parallel_size=0, **KW)


def test_more_stages_than_blocks_and_bad_stage_sizes_name_the_numbers(tiny_llama):
    from fxcompiler.mppp import PlanError

    with pytest.raises(PlanError, match=r"pipeline_parallel_size=3 needs at least 3 blocks; the model has 2"):
        LLM(tiny_llama, pipeline_parallel_size=3, cache_dir=None, **KW)
    with pytest.raises(PlanError, match=r"num_blocks_per_pp_stage=\[2, 1\] must be positive and sum to the "
                                        r"model's 2 blocks \(sums to 3\)"):
        LLM(tiny_llama, pipeline_parallel_size=2, num_blocks_per_pp_stage=[2, 1], cache_dir=None, **KW)
    with pytest.raises(PlanError, match=r"has 1 stages but pipeline_parallel_size=2"):
        LLM(tiny_llama, pipeline_parallel_size=2, num_blocks_per_pp_stage=[2], cache_dir=None, **KW)


def test_dp2_replicas_behind_the_router_give_one_process_tokens(tiny_llama, tp_cache, reference):
    with LLM(tiny_llama, data_parallel_size=2, cache_dir=tp_cache, **KW) as dp:
        from runtime.router import ReplicaRouter

        assert isinstance(dp.engine, ReplicaRouter) and len(dp.engine.replicas) == 2
        got = [o.outputs[0].token_ids for o in dp.generate(None, PARAMS, prompt_token_ids=_prompts())]
        assert got == reference
        assert min(dp.engine.routed) >= 4, dp.engine.routed  # both replicas served a share of the 16
        assert dp.engine.replicas[0].runner.kv is not dp.engine.replicas[1].runner.kv  # a KV cache each
    # devices name the replicas (dp inferred from the devices and tp x pp)
    with LLM(tiny_llama, devices="cpu:0,cpu:1", cache_dir=tp_cache, **KW) as dp:
        assert dp.parallel_plan.dp == 2 and len(dp.engine.replicas) == 2


def test_dp2_router_keeps_a_shared_prefix_on_the_replica_that_holds_it(tiny_llama, tp_cache):
    """Prefix-cache-aware routing: a prompt behind a 12-token system prompt (3 blocks of 4) that
    replica 0 holds goes there although replica 0 is busier, and the tokens are one process's."""
    system = [1] + [(11 * j) % 250 + 3 for j in range(11)]
    prompts = [system + [5], [2, 3, 4], system + [7, 9]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(KW, paged_attention_block_size=4)
    with LLM(tiny_llama, cache_dir=tp_cache, **kw) as one:
        want = [o.outputs[0].token_ids for o in one.generate(None, params, prompt_token_ids=prompts)]
    with LLM(tiny_llama, data_parallel_size=2, cache_dir=tp_cache, **kw) as dp:
        got = [o.outputs[0].token_ids for o in dp.generate(None, params, prompt_token_ids=prompts[:1])]
        # [2, 3, 4] goes to replica 0 (a tie); the next prompt's 12 held tokens outweigh those 6 queued
        got += [o.outputs[0].token_ids for o in dp.generate(None, params, prompt_token_ids=prompts[1:])]
        assert got == want
        assert dp.engine.routed == [3, 0] and dp.engine.prefix_routed_tokens == [12, 0], dp.engine.routed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_hosts(tiny_llama, tp_cache, tmp_path, *args, nproc: int = 1, repeat: int = 1):
    """Two torchrun "hosts" on 127.0.0.1 (separate torchrun processes, ``--nnodes 2``, ``nproc``
    ranks each) running examples/torchrun_generate.py on the 16 mixed requests; their Popens
    (stdout and stderr together, text) and the output path."""
    import json
    import subprocess

    port = _free_port()
    req = tmp_path / "requests.json"
    req.write_text(json.dumps({"prompt_token_ids": _prompts(), "max_tokens": [p.max_tokens for p in PARAMS],
                               "llm": {"dtype": "float64", "max_seq_len_to_capture": 64,
                                       "buckets": [[[1, 16], [4, 16]], [[4, 64], [16, 64]]]}}))
    out = tmp_path / "tokens.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node",
         str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(ROOT / "examples" / "torchrun_generate.py"), "--model", tiny_llama, "--requests", str(req),
         "--out", str(out), "--cache-dir", str(tp_cache), "--repeat", str(repeat), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return procs, out


def _finish(procs, timeout: float = 600) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_torchrun_two_loopback_hosts_match_one_process(tiny_llama, tp_cache, reference, tmp_path):
    """docs/parallelism.md's recipe: two torchrun "hosts" (one rank each, separate torchrun
    processes, env:// rendezvous on 127.0.0.1) run examples/torchrun_generate.py with tp=2."""
    import json

    procs, out = _torchrun_hosts(tiny_llama, tp_cache, tmp_path, "--tp", "2")
    logs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["tokens"] == reference
    assert got["comm"] == "gloo" and got["plan"]["tp"] == 2


def _children_by_parent() -> dict[int, list[int]]:
    """Every live process's pid under its parent's (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(d))
    return parents


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    parents = _children_by_parent()
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _local_rank_0(torchrun_pid: int) -> int:
    """The worker torchrun ``torchrun_pid`` started as LOCAL_RANK 0: its child with that variable
    (pids wrap around in a long run, so the lowest descendant pid need not be that worker)."""
    found = []
    for pid in _children_by_parent().get(torchrun_pid, []):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"LOCAL_RANK=0" in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    assert len(found) == 1, (torchrun_pid, found)
    return found[0]


def _kill_rank_mid_generation(procs, node: int):
    """Wait until rank 0 generates, SIGKILL the rank worker of ``node`` (its torchrun's LOCAL_RANK 0);
    returns the kill time, the worker pids of both nodes (the killed one first), and a thread
    collecting rank 0's output lines with their time after the kill."""
    line = ""
    while "generating" not in line:
        line = procs[0].stdout.readline()
        assert line or procs[0].poll() is None, "rank 0 exited before generating"
    time.sleep(0.5)
    workers = [sorted(_descendants(p.pid)) for p in procs]
    assert all(workers), workers
    lines: list[tuple[float, str]] = []
    victim = _local_rank_0(procs[node].pid)
    workers[node].remove(victim)
    workers[node].insert(0, victim)  # the killed worker first
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()

    def read():
        for ln in procs[0].stdout:
            lines.append((time.monotonic() - t0, ln))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return t0, workers, lines, reader


def test_torchrun_a_killed_rank_is_named_within_10_s_and_every_process_exits(tiny_llama, tp_cache, tmp_path):
    """Fault detection across hosts: rank 1 (the other host) SIGKILLed mid-generation -> rank 0's
    generate raises a WorkerError naming rank 1 within 10 s, and every process of the job exits."""
    procs, _ = _torchrun_hosts(tiny_llama, tp_cache, tmp_path, "--tp", "2", repeat=100000)
    try:
        t0, workers, lines, reader = _kill_rank_mid_generation(procs, node=1)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError("torchrun did not exit 60 s after the kill; rank 0 printed:\n"
                                     + "".join(f"{t:6.1f} {ln}" for t, ln in lines)[-6000:]) from None
        reader.join(5)
        named = [(t, ln) for t, ln in lines if "WorkerError: rank 1 (" in ln and "stopped its heartbeat" in ln]
        assert named, "".join(ln for _, ln in lines)[-3000:]
        assert named[0][0] < 10.0, named[0]
        assert time.monotonic() - t0 < 30
        assert [p.returncode for p in procs] == [1, 1]
        assert not any(_alive(w) for ws in workers for w in ws), workers
    finally:
        _finish(procs, timeout=5)


def test_torchrun_data_parallel_replicas_of_tp2_match_one_process_and_exit_when_rank_0_dies(
        tiny_llama, tp_cache, reference, tmp_path):
    """dp = 2 replicas of tp = 2 over two "hosts" of two ranks each (world 4 = dp × pp × tp): the
    router in rank 0 spreads the 16 requests over both replicas, each replica's TP collectives run
    on its own group, and the tokens are one process's. Then (one job start for both checks) rank 0
    is SIGKILLed mid-generation: replica 0's rank 1 (in a collective with it) and replica 1's ranks
    2 and 3 (waiting on the store for their next step) exit within seconds, not at a timeout."""
    import json

    procs, out = _torchrun_hosts(tiny_llama, tp_cache, tmp_path, "--tp", "2", "--dp", "2", nproc=2, repeat=100000)
    try:
        deadline = time.monotonic() + 600
        while not out.exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "the job ended early"
            time.sleep(0.2)
        got = json.loads(out.read_text())
        assert got["tokens"] == reference
        assert (got["plan"]["dp"], got["plan"]["tp"]) == (2, 2) and got["comm"] == "gloo"
        assert min(got["routed"]) >= 4, got["routed"]  # both replicas served a share

        t0, workers, lines, reader = _kill_rank_mid_generation(procs, node=0)
        others = [w for w in workers[0] if w != workers[0][0]] + workers[1]
        assert len(others) == 3, workers
        while any(_alive(w) for w in others) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not any(_alive(w) for w in others), (others, time.monotonic() - t0)
        for p in procs:
            p.wait(timeout=30)
        assert all(p.returncode != 0 for p in procs)
    finally:
        _finish(procs, timeout=5)


def test_torchrun_worlds_other_than_dp_pp_tp_are_refused_naming_the_sizes(tiny_llama, monkeypatch, tmp_path):
    from fxcompiler.mppp import PlanError

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing listens: the refusal comes first
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(PlanError, match=r"torchrun started 4 ranks but tensor_parallel_size=2 × pipeline_parallel_size"
                                        r"=1 × data_parallel_size=1 needs 2; with these tp and pp pass "
                                        r"data_parallel_size=2"):
        LLM(tiny_llama, tensor_parallel_size=2, cache_dir=None, **KW)
    with pytest.raises(PlanError, match=r"torchrun started 4 ranks but tensor_parallel_size=1 × pipeline_parallel_size"
                                        r"=1 × data_parallel_size=3 needs 3; .* pass data_parallel_size=4"):
        LLM(tiny_llama, data_parallel_size=3, cache_dir=None, **KW)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(PlanError, match=r"torchrun started 3 ranks but tensor_parallel_size=2 × pipeline_parallel_size"
                                        r"=1 × data_parallel_size=2 needs 4$"):
        LLM(tiny_llama, tensor_parallel_size=2, data_parallel_size=2, cache_dir=None, **KW)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotImplementedError, match=r"artifacts_export_path with data_parallel_size=2 under torchrun"):
        LLM(tiny_llama, data_parallel_size=2, artifacts_export_path=tmp_path / "art", cache_dir=None, **KW)
