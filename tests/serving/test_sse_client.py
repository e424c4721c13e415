"""``post_sse`` against a raw asyncio server: chunked and plain bodies, events split across chunks, errors."""
from __future__ import annotations

import asyncio
import json

import pytest

from fxcompiler.serving.sse_client import HTTPStatusError, post_sse, stream_sse


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _serve(response: bytes, seen: list[bytes]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        seen.append(head + await reader.readexactly(length))
        writer.write(response)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _events(response: bytes, headers=None) -> tuple[list[str], list[bytes]]:
    seen: list[bytes] = []
    server, port = await _serve(response, seen)
    async with server:
        out = [e async for e in post_sse(f"http://127.0.0.1:{port}/v1/completions", {"a": 1}, headers)]
    return out, seen


def test_chunked_events_split_and_joined_across_chunks():
    pieces = [b'data: {"x": 1}\n\ndata: {"x"', b': 2}\r\n\r', b"\n: a comment\n\ndata: [DONE]\n\n"]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    out, seen = asyncio.run(_events(head + _chunked(pieces), {"Authorization": "Bearer k"}))
    assert out == ['{"x": 1}', '{"x": 2}', "[DONE]"]  # the comment-only event carries no data
    request = seen[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in request
    assert json.loads(request.split(b"\r\n\r\n", 1)[1]) == {"a": 1}


def test_stream_sse_calls_back_per_event_and_raises_what_the_callback_raises():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [b'data: {"x": 1}\n\ndata: {"x": 2}\n', b"\ndata: [DONE]\n\n"]

    async def go(on_event):
        server, port = await _serve(head + _chunked(pieces), [])
        async with server:
            await stream_sse(f"http://127.0.0.1:{port}/v1/completions", {}, None, on_event)

    got: list[str] = []
    asyncio.run(go(got.append))
    assert got == ['{"x": 1}', '{"x": 2}', "[DONE]"]

    def bad(data: str) -> None:
        raise KeyError(data)
    with pytest.raises(KeyError, match="x"):
        asyncio.run(go(bad))


def test_content_length_body_and_multiline_data():
    body = b"data: line1\ndata: line2\n\n"
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    out, _ = asyncio.run(_events(resp))
    assert out == ["line1\nline2"]


def test_non_200_raises_with_the_body():
    body = b'{"error": {"code": 401}}'
    resp = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    with pytest.raises(HTTPStatusError, match="HTTP 401") as info:
        asyncio.run(_events(resp))
    assert info.value.status == 401 and info.value.body == body


def test_truncated_chunked_body_is_an_error():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        asyncio.run(_events(head + b"20\r\ndata: cut"))


@pytest.mark.parametrize("url", ["ftp://h/x", "http:///nohost", "127.0.0.1:8000/v1"])
def test_bad_url(url):
    async def go():
        return [e async for e in post_sse(url, {})]
    with pytest.raises(ValueError, match="url must be"):
        asyncio.run(go())
