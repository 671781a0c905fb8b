"""A streamed Message's events (Anthropic's Messages API), made from the chat
completion chunks the ingress streams (api/messages_api.py).

    message_start                 the Message, empty, with its input tokens
    ping
    content_block_start           a thinking, text or tool_use block (id, name)
    content_block_delta           thinking_delta (then signature_delta) /
                                  text_delta / input_json_delta
    content_block_stop
    ...                           one block after another
    message_delta                 stop_reason, stop_sequence, output tokens
    message_stop

The text never holds a matched stop sequence (the engine cuts it and names
it in the last chunk's `stop_reason`).  An answer that fails after its
start ends with an `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from api.messages_api import stop_of, thinking_block, tool_use_block, usage


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageEvents:
    def __init__(self, message_id: str, model: str, input_tokens: int,
                 thinking: bool = False) -> None:
        self.message_id, self.model = message_id, model
        # Extended thinking asked for: the reasoning as a thinking block.
        self.thinking = thinking
        self.input_tokens = input_tokens
        self.index = -1  # of the open block
        self.open: str | None = None  # its type
        self.end: dict[str, Any] = {}  # the choice that ended
        self.usage: dict[str, Any] | None = None

    def opening(self) -> list[str]:
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": message}),
                event("ping", {"type": "ping"})]

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk."""
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return []
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning") and self.thinking:
                out += self._thought(delta["reasoning"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason") is not None:
                self.end = choice
        return out

    def failed(self, error: dict[str, Any]) -> list[str]:
        """An answer that failed after its start: an `error` event last."""
        return [event("error", error)]

    def closing(self) -> list[str]:
        """The last events, once the chunks ended."""
        out = self._stop()
        reason, stop = stop_of(self.end)
        tokens = usage(self.usage)["output_tokens"] if self.usage else 0
        out.append(event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
            "usage": {"output_tokens": tokens}}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    # ------------------------------------------------------------------------

    def _thought(self, text: str) -> list[str]:
        out = self._start("thinking", thinking_block("")) if self.open != "thinking" else []
        out.append(event("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": "thinking_delta", "thinking": text}}))
        return out

    def _text(self, text: str) -> list[str]:
        out = self._start("text", {"type": "text", "text": ""}) if self.open != "text" else []
        out.append(event("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": "text_delta", "text": text}}))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if call.get("id") is not None:  # a new call
            block = {**tool_use_block({"id": call["id"], "function": {
                "name": call["function"]["name"], "arguments": ""}}), "input": {}}
            out += self._start("tool_use", block)
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            out.append(event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return out

    def _stop(self) -> list[str]:
        """The open block's end (a thinking block's signature first)."""
        out: list[str] = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": ""}}))
        if self.open is not None:
            out.append(event("content_block_stop", {"type": "content_block_stop",
                                                    "index": self.index}))
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"type": "content_block_start",
                                                 "index": self.index,
                                                 "content_block": block}))
        return out
