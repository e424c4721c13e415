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
