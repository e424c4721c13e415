"""``ClosingStreamingResponse``: a stream whose client went away closes its body generator at once (its ``finally``
aborts the request), not when the garbage collector reaches it."""
from __future__ import annotations

import asyncio
import gc

import pytest

from fxcompiler.serving.api_server import ClosingStreamingResponse


@pytest.mark.parametrize("spec_version", ["2.4", "2.3"])
def test_a_disconnected_stream_closes_its_generator_at_once(spec_version):
    closed = []

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def main():
        sent = []

        async def send(message):
            sent.append(message)
            if len(sent) > 2:  # the client is gone after the first chunk
                raise OSError("connection reset")

        async def receive():
            await asyncio.sleep(3600)  # no disconnect message: the failed send is what tells
            return {"type": "http.disconnect"}

        response = ClosingStreamingResponse(body(), media_type="text/event-stream")
        with pytest.raises(Exception):
            await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
        return list(closed), sent  # before asyncio.run's shutdown_asyncgens closes what is left

    gc.disable()  # the generator must not wait for a collection
    try:
        closed_when_the_response_ended, sent = asyncio.run(main())
        assert closed_when_the_response_ended == [True] and len(sent) == 3
    finally:
        gc.enable()
