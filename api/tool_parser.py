"""An answer's text split into its content and its tool calls, as it
streams (`api/tools.py` says what the grammar lets the model write).

A named choice's whole output is its function's arguments: they stream as
the call's `arguments` deltas.  Otherwise each call (a `<tool_call>` block,
or a Llama 3 JSON object: `api/tool_formats.py`) becomes one call, sent
whole in one delta once it is complete (its arguments are only known to be
complete then); the text around the calls is the message's content,
streamed as it comes except a tail that may be the start of a call, and
whitespace (and the format's separator) until text follows it: what lies
before a call, between calls or at the end of an answer with calls is not
content.  A call cut short by `max_tokens` stays in the content, as text.
"""

from __future__ import annotations

import json
import string
import uuid
from typing import Any

from api.tools import ToolUse


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """One answer's parser."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.calls: list[dict[str, Any]] = []
        self._content: list[str] = []
        self._buf = ""  # text not yet known to be content or a call
        self._in_call = False
        self._seen = 0  # how much of an open call's text was found incomplete
        self._blank = ""  # whitespace held back until text follows it
        self._arguments: list[str] = []  # a named call's arguments so far
        self._named_id = _call_id()
        self._names = {t.function.name for t in use.tools}
        # Not content around calls: whitespace, and the format's separator.
        self._sep = use.fmt.separator.strip()
        self._blanks = string.whitespace + self._sep

    # Streaming -------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas that `text`, the answer's
        next piece, completes."""
        if self.use.mode == "named":
            return "", self._named(text)
        self._buf += text
        content: list[str] = []
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        trigger = self.use.fmt.trigger
        while True:
            if not self._in_call:
                k = self._buf.find(trigger)
                if k < 0:
                    cut = len(self._buf) - partial_tail(self._buf, trigger)
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:k])
                self._buf = self._buf[k:]
                self._in_call, self._seen = True, 0
            else:
                e = self.use.fmt.call_end(self._buf, self._seen)
                if e < 0:
                    self._seen = len(self._buf)
                    break
                text, self._buf = self._buf[:e], self._buf[e:]
                self._in_call = False
                call = self._parse(text)
                if call is None:  # not a call after all: it is content
                    content.append(text)
                else:
                    out.append(self._emit("".join(content)))
                    content, self._blank = [], ""
                    deltas.append(call)
        out.append(self._emit("".join(content)))
        return "".join(out), deltas

    def finish(self, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The content and call deltas still held back, and the answer's
        finish reason: `tool_calls` where calls ended it."""
        deltas: list[dict[str, Any]] = []
        if self.use.mode == "named":
            if not self._arguments:
                deltas = self._named("")
            return "", deltas, reason
        rest, self._buf = self._blank + self._buf, ""
        self._blank = ""
        if self.calls:  # no whitespace around what follows the calls
            rest = rest.strip()
        self._content.append(rest)
        if self.calls and reason == "stop":
            reason = "tool_calls"
        return rest, deltas, reason

    # Whole answer ----------------------------------------------------------

    def message(self) -> dict[str, Any]:
        """The answer's `content` and `tool_calls` (after `finish`)."""
        if self.use.mode == "named":
            call = _wire(self._named_id, self.use.name or "", "".join(self._arguments))
            return {"content": None, "tool_calls": [call]}
        content = "".join(self._content)
        if not self.calls:
            return {"content": content}
        return {"content": content if content.strip() else None,
                "tool_calls": [{k: v for k, v in c.items() if k != "index"}
                               for c in self.calls]}

    # ------------------------------------------------------------------------

    def _named(self, text: str) -> list[dict[str, Any]]:
        if not self._arguments:
            self._arguments.append(text)
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.use.name, "arguments": text}}]
        self._arguments.append(text)
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _emit(self, text: str) -> str:
        """Content, less the whitespace (and separator) at its end: held
        until text follows it, dropped where a call follows it; after a
        call, what separates it from the next is not content either."""
        text = self._blank + text
        if self.calls and self._sep:
            text = text.lstrip(self._blanks)
        body = text.rstrip(self._blanks)
        self._blank = text[len(body):]
        if body:
            self._content.append(body)
        return body

    def _parse(self, text: str) -> dict[str, Any] | None:
        call = self.use.fmt.read(text)
        if call is None or call[0] not in self._names:
            return None
        wire = {"index": len(self.calls), **_wire(
            _call_id(), call[0], json.dumps(call[1], ensure_ascii=False))}
        self.calls.append(wire)
        return wire


def _wire(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
