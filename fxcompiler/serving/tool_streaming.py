"""Streaming tool calls: OpenAI's ``delta.tool_calls`` chunks while the model writes them (hermes, llama3_json).

``ToolCallStreamer(parser).feed(text)`` takes each new piece of one choice's output and returns the deltas
to send: ``{"content": ...}`` for text that is not part of a call, and ``{"tool_calls": [...]}`` — first
``{index, id, type: "function", function: {name, arguments: ""}}`` once the call's name is complete, then
``{index, function: {arguments: PIECE}}`` as the arguments object grows (its text as the model writes
it). ``finish()`` flushes what was held back and says whether any call was sent (``finish_reason:
"tool_calls"``).

Text that may still become a call is held back: a suffix that could start ``<tool_call>`` (hermes), the
start of the output until it is known to begin with ``{`` / ``<|python_tag|>`` (llama3_json), trailing
whitespace of the content (the non-streamed parse strips it). A block that turns out unparsable before
its name was sent becomes content, as in the non-streamed parsers; once a call's header is sent it
cannot be taken back.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .tool_parsers import _call

__all__ = ["ToolCallStreamer"]

_OPEN, _CLOSE, _PY_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_WS = " \t\n\r"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at ``s[i] == '"'``, or None while it is unterminated."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at ``s[i]``, or None while it is incomplete."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\n\r":
        j += 1
    return j if j < len(s) else None  # a number or literal may still grow


@dataclass
class _Scan:
    """What is known of a call object ``{"name": ..., "arguments"|"parameters": ...}`` being written."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # index after its closing brace
    bad: bool = False  # not the shape of a call object


def _scan_call(s: str, start: int) -> _Scan:
    out = _Scan()
    i = start + 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return out
        if s[i] == "}":
            out.end = i + 1
            return out
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            out.bad = True
            return out
        kend = _string_end(s, i)
        if kend is None:
            return out
        key = json.loads(s[i:kend])
        i = _skip_ws(s, kend)
        if i >= len(s):
            return out
        if s[i] != ":":
            out.bad = True
            return out
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return out
        vstart, vend = i, _value_end(s, i)
        if key == "name" and vend is not None:
            try:
                value = json.loads(s[vstart:vend])
            except ValueError:
                value = None
            if not isinstance(value, str):
                out.bad = True
                return out
            out.name = value
        elif key in ("arguments", "parameters") and out.args_start is None:
            out.args_start, out.args_end = vstart, vend
        if vend is None:
            return out
        i = vend


class _Call:
    """One call being streamed: header sent?, how much of its raw arguments text was sent."""

    def __init__(self, index: int):
        self.index = index
        self.header = False
        self.args_sent = 0
        self.broken = False  # its header was sent, then its text did not parse

    def advance(self, s: str, scan: _Scan) -> list[dict]:
        """Deltas for what ``scan`` (offsets into ``s``) adds: the header once the name is known, then the
        arguments object's text as it grows."""
        out: list[dict] = []
        if not self.header and scan.name is not None:
            self.header = True
            out.append({"index": self.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": scan.name, "arguments": ""}})
        if self.header and scan.args_start is not None and s[scan.args_start] in "{[":
            raw = s[scan.args_start:scan.args_end if scan.args_end is not None else len(s)]
            if len(raw) > self.args_sent:
                out.append({"index": self.index, "function": {"arguments": raw[self.args_sent:]}})
                self.args_sent = len(raw)
        return out

    def complete(self, obj_text: str, args_key: str) -> list[dict] | None:
        """The deltas that finish the call once its object is complete; None: not a call (nothing was sent)."""
        try:
            call = _call(json.loads(obj_text), args_key)
        except ValueError:
            call = None
        if call is None:
            self.broken = self.header
            return None if not self.header else []
        out: list[dict] = []
        if not self.header:
            self.header = True
            out.append({"index": self.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": call.name, "arguments": ""}})
        if self.args_sent == 0:  # arguments absent, a JSON string, or held until the name came
            out.append({"index": self.index, "function": {"arguments": call.arguments}})
            self.args_sent = len(call.arguments)
        return out


class ToolCallStreamer:
    """Incremental tool-call parsing of one choice's output for SSE deltas (see the module docstring)."""

    def __init__(self, parser: str):
        if parser not in ("hermes", "llama3_json"):
            raise ValueError(f"unknown tool-call parser {parser!r}; known: ['hermes', 'llama3_json']")
        self.parser = parser
        self.text = ""
        self.pos = 0  # text[:pos] is decided (sent as content or part of a finished call)
        self.mode = "content" if parser == "hermes" else "start"
        self.call: _Call | None = None
        self.call_start = 0  # where the current call object's text starts
        self.n_calls = 0  # complete calls sent
        self.n_indices = 0  # call indices used (calls whose header was sent)
        self.ws = ""  # content whitespace held back

    # -- deltas -------------------------------------------------------------------------------------
    def _content(self, piece: str, out: list[dict]) -> None:
        if not piece:
            return
        body = piece.rstrip(_WS)
        if not body:
            self.ws += piece
            return
        self._emit_content(self.ws + body, out)
        self.ws = piece[len(body):]

    @staticmethod
    def _emit_content(text: str, out: list[dict]) -> None:
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})

    @staticmethod
    def _calls(deltas: list[dict], out: list[dict]) -> None:
        if deltas:
            out.append({"tool_calls": deltas})

    # -- feeding --------------------------------------------------------------------------------------
    def feed(self, piece: str) -> list[dict]:
        """Deltas for ``piece``, the next text of this choice."""
        self.text += piece
        out: list[dict] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> tuple[list[dict], bool]:
        """(the last deltas, whether a complete tool call was sent; one cut short does not count)."""
        out: list[dict] = []
        while self._step(out, final=True):
            pass
        rest = self.text[self.pos:]
        if self.mode == "after" and self.n_calls and not rest.strip(_WS + ";"):
            rest = ""  # separators after the last call
        if self.mode in ("content", "start", "after"):
            self._content(rest, out)
        elif self.call is not None and not self.call.header:  # an unfinished block: content, as unparsed
            self._content(rest if self.parser == "llama3_json" else _OPEN + self.text[self.call_start:], out)
        if self.n_calls == 0 and self.ws:
            self._emit_content(self.ws, out)
        self.pos = len(self.text)
        return out, self.n_calls > 0

    def _end_call(self) -> None:
        if self.call.header:
            self.n_indices += 1
            self.n_calls += not self.call.broken
        self.call = None

    def _step(self, out: list[dict], final: bool) -> bool:
        """Advance once; True when it made progress that may allow more."""
        s = self.text
        if self.parser == "hermes":
            return self._step_hermes(s, out, final)
        return self._step_llama3(s, out, final)

    def _step_hermes(self, s: str, out: list[dict], final: bool) -> bool:
        if self.mode == "content":
            i = s.find(_OPEN, self.pos)
            if i >= 0:
                self._content(s[self.pos:i], out)
                self.mode, self.call_start = "call", i + len(_OPEN)
                self.call = _Call(self.n_indices)
                self.pos = self.call_start
                return True
            if final:
                return False
            hold = next((k for k in range(min(len(_OPEN) - 1, len(s) - self.pos), 0, -1)
                         if _OPEN.startswith(s[len(s) - k:])), 0)
            self._content(s[self.pos:len(s) - hold], out)
            self.pos = len(s) - hold
            return False
        # inside <tool_call> ... </tool_call>
        end_tag = s.find(_CLOSE, self.call_start)
        body = s[self.call_start:end_tag] if end_tag >= 0 else s[self.call_start:]
        if end_tag < 0 or self.call.header:  # (a call complete before its header went out is checked first)
            lead = _skip_ws(body, 0)
            if lead < len(body) and body[lead] == "{":
                scan = _scan_call(body, lead)
                if not scan.bad:
                    self._calls(self.call.advance(body, scan), out)
        if end_tag < 0:
            return False
        done = self.call.complete(body.strip(), "arguments")
        if done is None:  # unparsable block: content, as in the non-streamed parser
            self._content(_OPEN + body + _CLOSE, out)
        else:
            self._calls(done, out)
        self._end_call()
        self.mode = "content"
        self.pos = end_tag + len(_CLOSE)
        return True

    def _step_llama3(self, s: str, out: list[dict], final: bool) -> bool:
        if self.mode == "start":
            i = _skip_ws(s, self.pos)
            head = s[i:]
            if head.startswith(_PY_TAG):
                self.pos = i + len(_PY_TAG)
                self.mode = "after"
                return True
            if head.startswith("{"):
                self.mode = "after"
                return True
            if head and not _PY_TAG.startswith(head):
                self.mode = "plain"
                return True
            return False
        if self.mode == "plain":  # not a call: everything is content
            self._content(s[self.pos:], out)
            self.pos = len(s)
            return False
        if self.mode == "after":  # between calls: whitespace and ';', then '{'
            i = self.pos
            while i < len(s) and s[i] in _WS + ";":
                i += 1
            if i >= len(s):
                return False
            if s[i] != "{":
                self.mode = "plain" if self.n_calls == 0 else "tail"
                return True
            self.mode, self.call_start, self.pos = "call", i, i
            self.call = _Call(self.n_indices)
            return True
        if self.mode == "tail":  # text after the calls: content (the non-streamed parser gives up here)
            self._content(s[self.pos:], out)
            self.pos = len(s)
            return False
        scan = _scan_call(s, self.call_start)
        if scan.bad:
            return self._not_a_call(len(s))
        if scan.end is None or self.call.header:
            self._calls(self.call.advance(s, scan), out)
        if scan.end is None:
            return False
        done = self.call.complete(s[self.call_start:scan.end], "parameters")
        if done is None:
            return self._not_a_call(scan.end)
        self._calls(done, out)
        self._end_call()
        self.mode, self.pos = "after", scan.end
        return True


    def _not_a_call(self, end: int) -> bool:
        """llama3_json: the object being read is no call. Before anything was sent the whole output is
        content (as in the non-streamed parser); after, the text from here on is."""
        if self.call.header:  # cannot be taken back: the call ends here, what follows is content
            self.call.broken = True
            self._end_call()
            self.mode, self.pos = "tail", end
        else:
            self.call = None
            self.mode = "plain" if self.n_indices == 0 else "tail"
            self.pos = 0 if self.n_indices == 0 else self.call_start
        return True


def stream_tool_deltas(parser: str, pieces: list[str]) -> tuple[list[dict], bool]:
    """All deltas of an output given as pieces (for tests and tools): feed each, then finish."""
    st = ToolCallStreamer(parser)
    out: list[dict] = []
    for p in pieces:
        out += st.feed(p)
    last, called = st.finish()
    return out + last, called


def accumulate(deltas: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls as ``{id, name, arguments}``) of a delta list, as a client assembles them."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.get("id", c["id"])
            fn = tc.get("function", {})
            c["name"] += fn.get("name", "")
            c["arguments"] += fn.get("arguments", "")
    return content, [calls[k] for k in sorted(calls)]
