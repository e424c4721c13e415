"""The data-parallel router: least-loaded by queued tokens, one engine interface over replicas."""
from __future__ import annotations

from types import SimpleNamespace

from fxcompiler import SamplingParams
from fxcompiler.outputs import RequestOutput
from runtime.router import ReplicaRouter


class _Replica:
    """An engine stand-in: each step computes every waiting prompt, then one token per request."""

    def __init__(self):
        self.requests: dict = {}
        self.aborted: list = []
        self.configured: dict = {}

    def configure(self, **kw):
        self.configured = kw

    def check_params(self, params):
        pass

    def add_request(self, rid, ids, params, prompt=None):
        seq = SimpleNamespace(num_uncomputed=len(ids), params=params, output_token_ids=[], is_finished=False)
        self.requests[rid] = SimpleNamespace(seqs=[seq])

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outs = []
        for rid, st in list(self.requests.items()):
            s = st.seqs[0]
            s.num_uncomputed = 1
            s.output_token_ids.append(7)
            done = len(s.output_token_ids) >= s.params.max_tokens
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, None, [], [], done))
        return outs


def test_requests_go_to_the_replica_with_fewest_queued_tokens():
    a, b = _Replica(), _Replica()
    router = ReplicaRouter([a, b])
    router.configure(enable_prefix_caching=True)
    assert a.configured == b.configured == {"enable_prefix_caching": True}
    router.add_request("long", [1] * 30, SamplingParams(max_tokens=10))  # 40 queued tokens -> a (tie: lowest)
    router.add_request("s1", [1] * 5, SamplingParams(max_tokens=5))  # 10 -> b
    router.add_request("s2", [1] * 5, SamplingParams(max_tokens=5))  # b has 20 < 40 -> b
    assert set(a.requests) == {"long"} and set(b.requests) == {"s1", "s2"}
    assert router.loads() == [40, 20]
    outs = router.step()  # prompts computed, one token each: loads fall
    assert {o.request_id for o in outs} == {"long", "s1", "s2"}
    assert router.loads() == [1 + 9, 2 * (1 + 4)]
    router.add_request("s3", [1] * 2, SamplingParams(max_tokens=2))  # a 10 vs b 10: tie -> a
    assert "s3" in a.requests and router.routed == [2, 2]
    assert set(router.requests) == {"long", "s1", "s2", "s3"}
    router.abort_request("s1")
    assert b.aborted == ["s1"]
    while router.has_unfinished_requests():
        router.step()
    assert router.loads() == [0, 0]


class _CachingReplica(_Replica):
    """A stand-in with a real prefix cache: prompts are computed (and their blocks cached) at once."""

    def __init__(self):
        super().__init__()
        from runtime.block_manager import BlockManager

        self.blocks = BlockManager(64, 4, 16, 16, enable_prefix_caching=True)

    def prefix_tokens(self, ids, params):
        return self.blocks.prefix_tokens(list(ids))

    def add_request(self, rid, ids, params, prompt=None):
        from runtime.sequence import Sequence

        s = Sequence(rid, 0, list(ids), params, 0)
        self.blocks.allocate(s, s.num_tokens)
        s.num_cached = s.num_tokens
        self.blocks.commit(s)
        super().add_request(rid, ids, params, prompt)
        self.requests[rid].seqs[0].num_uncomputed = 1  # its prompt is in the cache now


def test_a_held_prefix_draws_requests_until_the_queue_outweighs_it():
    a, b = _CachingReplica(), _CachingReplica()
    router = ReplicaRouter([a, b])
    system = [9] * 40
    router.add_request("other", [1] * 8, SamplingParams(max_tokens=4))  # a: 1 + 4 queued
    router.add_request("sys0", system + [2], SamplingParams(max_tokens=4))  # a 5 vs b 0 -> b (no prefix yet)
    assert "sys0" in b.requests
    for k in range(1, 6):  # b holds the 40-token prefix: 5 + 5k queued there beats 5 + 41 on a
        router.add_request(f"sys{k}", system + [2 + k], SamplingParams(max_tokens=4))
        assert f"sys{k}" in b.requests, (k, router.loads())
    assert router.prefix_routed_tokens == [0, 5 * 40]
    router.add_request("big", system + [3], SamplingParams(max_tokens=60))  # b: 30 - 40 < a: 5
    assert "big" in b.requests
    router.add_request("next", system + [4], SamplingParams(max_tokens=4))  # b: 30 + 61 - 40 = 51 > a: 5
    assert "next" in a.requests, router.loads()


class _RemoteReplica(_Replica):
    """A replica whose steps wait on ranks of its own (torchrun's): its runner says so."""

    runner = SimpleNamespace(steps_concurrently=True)

    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier

    def step(self):
        self.barrier.wait(timeout=5)  # passes only when the other replica steps at the same time
        return super().step()


def test_replicas_that_step_concurrently_are_stepped_at_once_outputs_in_replica_order():
    import threading

    barrier = threading.Barrier(2)
    a, b = _RemoteReplica(barrier), _RemoteReplica(barrier)
    router = ReplicaRouter([a, b])
    assert router.concurrent and not ReplicaRouter([_Replica(), _Replica()]).concurrent
    router.add_request("x", [1] * 4, SamplingParams(max_tokens=2))
    router.add_request("y", [1] * 4, SamplingParams(max_tokens=2))
    assert set(a.requests) == {"x"} and set(b.requests) == {"y"}
    assert [o.request_id for o in router.step()] == ["x", "y"]  # sequential stepping would break the barrier
    assert [(o.request_id, o.finished) for o in router.step()] == [("x", True), ("y", True)]
    router.add_request("z", [1] * 4, SamplingParams(max_tokens=1))  # one busy replica: stepped in this thread
    barrier_free = threading.Barrier(1)
    a.barrier = b.barrier = barrier_free
    assert [o.request_id for o in router.step()] == ["z"]
