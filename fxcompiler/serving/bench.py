"""``fxcompiler bench serve``: an open-loop client against a running OpenAI-compatible server.

Requests go to ``/v1/completions`` (streamed, ``ignore_eos``, a fixed ``--output-len``) with
Poisson arrivals at ``--request-rate`` (``inf``: all at once) and at most ``--max-concurrency``
in flight, each read by ``sse_client.stream_sse`` (a lean client: its CPU time per token comes out of
the server's on a shared host; each event is parsed and timestamped in the protocol callback that reads it). Prompts are cut from text shipped with Python (``pydoc_data.topics``). Reported:
TTFT, TPOT (per request, after the first token), ITL (between chunks) and end-to-end latency
p50/p90/p99 in ms, request and output-token throughput; ``--result-json`` writes them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from .sse_client import HTTPStatusError, stream_sse

__all__ = ["add_bench_serve_args", "bench", "run_bench_serve", "BenchResult"]


def add_bench_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (127.0.0.1 by default)")
    p.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words (approximate tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--result-json", default=None)
    p.add_argument("--no-progress", action="store_true")
    return p


@dataclass
class _Req:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass
class BenchResult:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]


def _prompts(n: int, words: int, seed: int) -> list[str]:
    import pydoc_data.topics as topics

    text = " ".join(topics.topics.values()).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(0, max(1, len(text) - words))
        out.append(" ".join(text[i:i + words]))
    return out


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(values)

    def q(p: float) -> float:
        return 1000.0 * s[min(len(s) - 1, int(round(p * (len(s) - 1))))]
    return {"mean": 1000.0 * statistics.fmean(s), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99)}


async def _one(url: str, body: dict, headers: dict[str, str], timeout: float) -> _Req:
    r = _Req()
    t0 = time.perf_counter()
    last = t0
    loads = json.loads

    def on_event(data: str) -> None:  # called as the event's bytes are read: TTFT/ITL are stamped here
        nonlocal last
        now = time.perf_counter()
        if data == "[DONE]" or r.error is not None:
            return
        chunk = loads(data)
        if "error" in chunk:
            r.error = str(chunk["error"])
            return
        if chunk.get("usage"):
            r.output_tokens = chunk["usage"]["completion_tokens"]
        if not any(c.get("text") for c in chunk.get("choices", ())):
            return
        if r.ttft is None:
            r.ttft = now - t0
        else:
            r.itl.append(now - last)
        last = now

    try:
        await asyncio.wait_for(stream_sse(url, body, headers, on_event), timeout)
        if r.error is not None:
            return r
        r.e2e = time.perf_counter() - t0
        r.ok = r.ttft is not None
        if not r.ok:
            r.error = "no tokens"
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        r.error = str(exc) if isinstance(exc, HTTPStatusError) else f"{type(exc).__name__}: {exc}"
    return r


async def _bench(args: argparse.Namespace) -> BenchResult:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency + 4, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=args.timeout) as c:
        model = args.model
        if model is None:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
        url = args.base_url.rstrip("/") + "/v1/completions"
        prompts = _prompts(args.num_prompts, args.input_len, args.seed)
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.max_concurrency)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="bench serve", unit="req")

        async def run(prompt: str) -> _Req:
            async with sem:
                body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                r = await _one(url, body, headers, args.timeout)
            if bar is not None:
                bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(run(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return BenchResult(completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
                       request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
                       ttft_ms=_pct([r.ttft for r in ok]), tpot_ms=_pct(tpot),
                       itl_ms=_pct([x for r in ok for x in r.itl]), e2e_ms=_pct([r.e2e for r in ok]),
                       errors=sorted({r.error for r in results if r.error})[:10])


def run_async(coro):
    """``asyncio.run`` on uvloop where it is installed (the client's own CPU time is part of what it measures)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def bench(args: argparse.Namespace) -> BenchResult:
    """One bench run (the namespace of ``add_bench_serve_args``)."""
    return run_async(_bench(args))


def run_bench_serve(args: argparse.Namespace) -> int:
    res = bench(args)
    print(f"completed {res.completed}, failed {res.failed}, {res.duration_s:.2f} s; "
          f"{res.request_throughput:.2f} req/s, {res.output_throughput:.1f} output tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = getattr(res, name)
        print(f"{name[:-3].upper():5s} ms  mean {d['mean']:.1f}  p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  "
              f"p99 {d['p99']:.1f}")
    for e in res.errors:
        print("error:", e)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0 if res.failed == 0 else 1
