"""A lean HTTP/1.1 client for one streamed POST: the server-sent events' ``data:`` payloads as they arrive.

``fxcompiler bench serve`` runs on the host it measures: its own CPU time per token is taken from the
server's. So the response is parsed by an ``asyncio.Protocol`` as its bytes are received: status and
headers, chunked transfer coding (or Content-Length, or up to EOF), events split on blank lines, each
event's data handed to a callback right there (``stream_sse``) — no await, task wake-up or generator
hop per event. The bench stamps TTFT/ITL in that callback, the moment the event's bytes are read.
``post_sse`` is the same as an async iterator (one queue hop per event; for tests and tools).
One connection per request (``Connection: close``); ``http`` and ``https``.
"""
from __future__ import annotations

import asyncio
import collections
import json
import ssl
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit

__all__ = ["HTTPStatusError", "post_sse", "stream_sse"]


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200 (``status``; ``body``: the first bytes of its body)."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body


class _SSEProtocol(asyncio.Protocol):
    """Parses one HTTP/1.x response; calls ``on_event(data)`` per SSE event with data; ``done`` ends it."""

    def __init__(self, request: bytes, on_event: Callable[[str], None], done: asyncio.Future):
        self.request = request
        self.on_event = on_event
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.buf = b""  # raw bytes not parsed yet (head, or chunk framing)
        self.events = b""  # decoded body bytes not yet split into events
        self.status = 0
        self.head_done = False
        self.chunked = False
        self.left: int | None = None  # Content-Length bytes still to come (None: chunked or up to EOF)
        self.chunk_left = -1  # chunked: bytes of the current chunk still to come (-1: at a size line)
        self.error_body = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def _finish(self, exc: BaseException | None = None) -> None:
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            elif self.status != 200:
                self.done.set_exception(HTTPStatusError(self.status, self.error_body))
            else:
                self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def _head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        sep = 4
        if end < 0:
            end, sep = self.buf.find(b"\n\n"), 2
            if end < 0:
                return False
        lines = self.buf[:end].decode("latin-1").splitlines()
        self.buf = self.buf[end + sep:]
        parts = lines[0].split(None, 2) if lines else []
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError(f"not an HTTP/1.x response: {lines[0][:100] if lines else ''!r}")
        self.status = int(parts[1])
        headers = {}
        for h in lines[1:]:
            name, _, value = h.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self.chunked and "content-length" in headers:
            self.left = int(headers["content-length"])
        self.head_done = True
        return True

    def _body(self, data: bytes) -> None:
        if self.status != 200:
            self.error_body += data
            return
        events = (self.events + data).replace(b"\r\n", b"\n")  # a CR split from its LF waits for the next piece
        if events.endswith(b"\r"):
            events, self.events = events[:-1], b"\r"
        else:
            self.events = b""
        start = 0
        while True:
            end = events.find(b"\n\n", start)
            if end < 0:
                break
            event = events[start:end]
            start = end + 2
            if event.startswith(b"data: ") and b"\n" not in event:  # the common case: one data line
                self.on_event(event[6:].decode("utf-8"))
                continue
            lines = [ln[6:] if ln.startswith(b"data: ") else ln[5:] for ln in event.split(b"\n")
                     if ln.startswith(b"data:")]
            if lines:
                self.on_event(b"\n".join(lines).decode("utf-8"))
        self.events = events[start:] + self.events

    def data_received(self, data: bytes) -> None:
        try:
            self._received(data)
        except BaseException as exc:  # noqa: BLE001 - a parse error (or the callback's) ends this request
            self._finish(exc)

    def _received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.buf += data
        if not self.head_done and not self._head():
            return
        if not self.chunked:
            data, self.buf = self.buf, b""
            if self.left is not None:
                data = data[:self.left]
                self.left -= len(data)
            if data:
                self._body(data)
            if self.left == 0:
                self._finish()
            return
        while True:
            if self.chunk_left < 0:  # a size line
                nl = self.buf.find(b"\n")
                if nl < 0:
                    return
                size = int(self.buf[:nl].split(b";", 1)[0].strip(), 16)
                self.buf = self.buf[nl + 1:]
                if size == 0:
                    self._finish()
                    return
                self.chunk_left = size + 2  # the chunk and its CRLF
            if len(self.buf) < self.chunk_left:
                return
            piece, self.buf = self.buf[:self.chunk_left - 2], self.buf[self.chunk_left:]
            self.chunk_left = -1
            self._body(piece)

    def eof_received(self) -> None:
        if self.head_done and not self.chunked and self.left is None:
            self._finish()  # a body that ends with the connection
        else:
            self._finish(ConnectionError("connection closed inside the response"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("connection closed inside the response"))


def _request(url: str, body: dict, headers: dict[str, str] | None) -> tuple[str, int, ssl.SSLContext | None, bytes]:
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
    return u.hostname, port, ctx, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


async def stream_sse(url: str, body: dict, headers: dict[str, str] | None, on_event: Callable[[str], None]) -> None:
    """POST ``body`` as JSON to ``url``; call ``on_event(data)`` for each server-sent event's data (``data:``
    lines joined) as its bytes are read; return when the body ends.

    Raises ``HTTPStatusError`` for a status other than 200, ``ConnectionError`` for a truncated response, and
    whatever ``on_event`` raises; the caller bounds the time (``asyncio.timeout``); cancelling closes the connection."""
    host, port, ctx, request = _request(url, body, headers)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _SSEProtocol(request, on_event, done), host, port, ssl=ctx)
    try:
        await done
    finally:
        transport.close()


async def post_sse(url: str, body: dict, headers: dict[str, str] | None = None) -> AsyncIterator[str]:
    """``stream_sse`` as an async iterator of the events' data (raises as it does)."""
    _request(url, body, headers)  # a bad url raises here, before any connection
    ready: collections.deque[str] = collections.deque()
    wake = asyncio.Event()

    def on_event(data: str) -> None:
        ready.append(data)
        wake.set()

    task = asyncio.ensure_future(stream_sse(url, body, headers, on_event))
    task.add_done_callback(lambda _t: wake.set())
    try:
        while True:
            await wake.wait()
            wake.clear()
            while ready:
                yield ready.popleft()
            if task.done():
                while ready:
                    yield ready.popleft()
                task.result()
                return
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing early
                pass
