"""A streamed chat answer as the Responses API's semantic events.

`response.created` and `response.in_progress` open the stream; a
reasoning model's reasoning is a reasoning item (`output_item.added`,
`reasoning_text.delta` …, `reasoning_text.done`, `output_item.done`); the
answer's text is a message item (`output_item.added`, `content_part.added`,
`output_text.delta` …, then the `done` events in reverse), each tool call a
function-call item (`function_call_arguments.delta` … `done`); the stream
ends with `response.completed`, or `response.incomplete` when
`max_output_tokens` cut it, carrying the whole Response object.  Every
event has a `sequence_number`; there is no `[DONE]`.
"""

from __future__ import annotations

from typing import Any

from api.responses_api import (
    ResponsesRequest,
    text_part,
    call_item,
    reasoning_item,
    item_id,
    message_item,
    response_object,
    usage_of,
)


class ResponseEvents:
    def __init__(self, req: ResponsesRequest, response_id: str, created: float,
                 stored: bool = False) -> None:
        self.req = req
        self.stored = stored
        self.response_id = response_id
        self.created = created
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self._text: list[str] | None = None  # the open message's text
        self._logprobs: list[dict[str, Any]] = []  # the open message's, so far
        self._pending: list[dict[str, Any]] = []  # of tokens whose text is still held
        self._message_id = ""
        self._call: dict[str, Any] | None = None  # the open call's item
        self._reasoning: list[str] | None = None  # the open reasoning item's text
        self._reasoning_id = ""
        self._finish: str | None = None

    def opening(self, queued: bool = False) -> list[dict[str, Any]]:
        """The first events; `queued`: a background response's, made before
        it runs (`started` follows once the engine took it)."""
        if queued:
            response = self._response("queued", None)
            return [self._event("response.created", response=response),
                    self._event("response.queued", response=response)]
        response = self._response("in_progress", None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def started(self) -> list[dict[str, Any]]:
        return [self._event("response.in_progress", response=self._response("in_progress",
                                                                             None))]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (one choice: n is 1)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            self._pending += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning"):
                events += self._reasoning_delta(delta["reasoning"])
            if delta.get("content"):
                events += self._close_reasoning() + self._close_call()
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return events

    def closing(self, chat_usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The last events, once the answer has ended."""
        events = self._close_reasoning() + self._close_message() + self._close_call()
        status = "incomplete" if self._finish == "length" else "completed"
        response = self._response(status, usage_of(chat_usage))
        return [*events, self._event(f"response.{status}", response=response)]

    def ended(self, status: str, usage: dict[str, Any] | None,
              error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The last events of a background stream stopped before its answer
        ended: `failed` (`response.failed`) or `cancelled` (no event of its
        own in the API: `response.incomplete`, its response saying
        `cancelled`), with the output written so far."""
        events = self._close_reasoning() + self._close_message() + self._close_call()
        response = self._response(status, usage)
        if error is not None:
            response["error"] = error
        kind = "response.failed" if status == "failed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error the stream ends with (its status was already sent)."""
        body = error.get("error", {})
        return [self._event("error", code=str(body.get("code")), message=body.get("message"),
                            param=body.get("param"))]

    # ------------------------------------------------------------------------

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._reasoning is None:
            self._reasoning, self._reasoning_id = [], item_id("rs")
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output),
                                      item=reasoning_item(self._reasoning_id, "",
                                                          "in_progress")))
        self._reasoning.append(text)
        events.append(self._event("response.reasoning_text.delta",
                                  item_id=self._reasoning_id, output_index=len(self.output),
                                  content_index=0, delta=text))
        return events

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return []
        text, self._reasoning = "".join(self._reasoning), None
        item = reasoning_item(self._reasoning_id, text)
        events = [self._event("response.reasoning_text.done", item_id=self._reasoning_id,
                              output_index=len(self.output), content_index=0, text=text),
                  self._event("response.output_item.done", output_index=len(self.output),
                              item=item)]
        self.output.append(item)
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._text is None:
            self._text, self._message_id = [], item_id("msg")
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output),
                                      item=message_item(self._message_id, "", "in_progress")))
            events.append(self._event("response.content_part.added", **self._where(),
                                      part=text_part("")))
        self._text.append(text)
        logprobs, self._pending = self._pending, []
        self._logprobs += logprobs
        events.append(self._event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=logprobs))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        text, where = "".join(self._text), self._where()
        logprobs = self._logprobs + self._pending
        item = message_item(self._message_id, text, logprobs=logprobs)
        self._text, self._logprobs, self._pending = None, [], []
        events = [self._event("response.output_text.done", **where, text=text,
                              logprobs=logprobs),
                  self._event("response.content_part.done", **where,
                              part=text_part(text, logprobs)),
                  self._event("response.output_item.done", output_index=len(self.output),
                              item=item)]
        self.output.append(item)
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "id" in call:  # a new call
            events += self._close_reasoning() + self._close_message() + self._close_call()
            self._call = call_item(item_id("fc"), call, "in_progress")
            events.append(self._event("response.output_item.added",
                                      output_index=len(self.output), item=dict(self._call)))
        assert self._call is not None
        arguments = call.get("function", {}).get("arguments") or ""
        if arguments:
            self._call["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._call["id"],
                                      output_index=len(self.output), delta=arguments))
        return events

    def _close_call(self) -> list[dict[str, Any]]:
        if self._call is None:
            return []
        item, self._call = {**self._call, "status": "completed"}, None
        events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=len(self.output), name=item["name"],
                              arguments=item["arguments"]),
                  self._event("response.output_item.done", output_index=len(self.output),
                              item=item)]
        self.output.append(item)
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._message_id, "output_index": len(self.output),
                "content_index": 0}

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.req, self.response_id, self.created, status,
                               list(self.output), usage, self.stored)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
