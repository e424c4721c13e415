"""Lifecycle: shutdown stops the worker and frees the engine; no cycle keeps an engine alive;
cancelled streams leave nothing behind."""
from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from fxcompiler import SamplingParams

from .conftest import PROMPTS, make_llm

SP = SamplingParams(max_tokens=6, temperature=0)


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fxcompiler-engine"]


async def _stream(llm, ids, stop_after=None, sp=SP):
    out = []
    async for d in llm.stream_generate("", sp, prompt_token_ids=ids):
        out.append(d)
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def _streamed_llm(llama_dir, cache):
    llm = make_llm(llama_dir, cache)
    asyncio.run(_stream(llm, PROMPTS[0]))
    return llm


def test_shutdown_stops_the_worker_and_frees_the_engine(llama_dir, rel_cache):
    before = len(_workers())
    llm = _streamed_llm(llama_dir, rel_cache)
    assert len(_workers()) == before + 1
    engine = weakref.ref(llm.engine)
    llm.shutdown()
    gc.collect()
    assert len(_workers()) == before
    assert engine() is None, "nothing may keep a shut-down engine alive"
    llm.shutdown()  # idempotent


def test_an_llm_that_streamed_is_freed_when_dropped(llama_dir, rel_cache):
    before = len(_workers())
    llm = _streamed_llm(llama_dir, rel_cache)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None
    assert len(_workers()) == before


def test_a_finaliser_in_a_thread_holding_the_engine_lock_returns(llama_dir, rel_cache):
    """A garbage collection can finalise an LLM in the thread that holds its engine lock (its own
    worker, mid-step); ``__del__`` then must not wait for that lock (it used to, forever)."""
    llm = _streamed_llm(llama_dir, rel_cache)
    engine = weakref.ref(llm.engine)
    done = threading.Event()

    def finalise_holding_the_lock():
        with llm._lock:
            llm.__del__()
        done.set()

    t = threading.Thread(target=finalise_holding_the_lock, daemon=True)
    t.start()
    assert done.wait(30), "LLM.__del__ blocked on the engine lock its own thread holds"
    assert llm.engine is None
    del llm
    gc.collect()
    assert engine() is None


def test_context_manager_shuts_down(llama_dir, rel_cache):
    with make_llm(llama_dir, rel_cache) as llm:
        assert llm.generate(None, SP, prompt_token_ids=PROMPTS[:1])[0].finished
    assert llm.engine is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(None, SP, prompt_token_ids=PROMPTS[:1])


async def _until_running(llm):
    while not llm.engine.requests:
        await asyncio.sleep(0.005)


def test_shutdown_during_a_stream_aborts_it(llama_dir, rel_cache):
    llm = make_llm(llama_dir, rel_cache)
    blocks = llm.engine.scheduler.blocks

    async def main():
        task = asyncio.create_task(_stream(llm, [1, 2, 3], None, SamplingParams(max_tokens=120, temperature=0)))
        await _until_running(llm)
        llm.shutdown()
        return await asyncio.gather(task, return_exceptions=True)

    (res,) = asyncio.run(main())
    assert isinstance(res, RuntimeError) and "shut down" in str(res)
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_cancelled_streams_leave_nothing_in_pending(llm):
    async def main():
        tasks = [asyncio.create_task(_stream(llm, [1, 2, 3 + i], stop_after=1)) for i in range(6)]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    # let the worker drain what it had computed ahead for the cancelled requests
    assert llm.generate(None, SP, prompt_token_ids=PROMPTS[:1])[0].finished
    assert not llm._pending and not llm._live and not llm.engine.requests
    llm.engine.scheduler.blocks.check_invariants()


def test_task_cancellation_leaves_nothing_behind(llm):
    async def main():
        t = asyncio.create_task(_stream(llm, [1, 7, 7], None, SamplingParams(max_tokens=120, temperature=0)))
        await _until_running(llm)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())
    assert llm.generate(None, SP, prompt_token_ids=PROMPTS[:1])[0].finished
    assert not llm._pending and not llm.engine.requests
    llm.engine.scheduler.blocks.check_invariants()
