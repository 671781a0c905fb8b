"""Anthropic's Messages API (`POST /v1/messages`) on the chat path: a
request is validated as Anthropic's, served as the chat completion it
amounts to (`chat_body`), and answered as a Message object or its stream
of events (api/messages_stream.py; the route is deployments/messages_route.py).

A Message's `content` is its text block (if any text) and a `tool_use`
block per call.  `stop_reason`: `end_turn`, `max_tokens`, `tool_use`, or
`stop_sequence` with the `stop_sequence` that ended it (the engine's
`stop_reason`, the matched stop string).  Errors have Anthropic's shape
(`error_body`).
"""

from __future__ import annotations

import datetime
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator,
    model_validator,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.errors import APIError, PartError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    # Prefix caching is automatic (README, "Prefix caching"): a breakpoint
    # asks for what the server does anyway.
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Strict):
    """An earlier answer's reasoning, sent back as Anthropic's clients do
    (with tools, they must): accepted on assistant messages and left out of
    the prompt, as reasoning models' templates leave earlier reasoning out."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _tag(v: Any) -> str:
    # Tags in brackets: an error names the field (`messages.0.content.0.id`),
    # not the member of the union (api/errors.py leaves bracketed names out).
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return f"[{kind}]"


Block = Annotated[Annotated[TextBlock, Tag("[text]")] | Annotated[ToolUseBlock, Tag("[tool_use]")]
                  | Annotated[ToolResultBlock, Tag("[tool_result]")]
                  | Annotated[ThinkingBlock, Tag("[thinking]")]
                  | Annotated[ThinkingBlock, Tag("[redacted_thinking]")],
                  Discriminator(_tag, custom_error_type="block_type", custom_error_message=(
                      "a content block is text, tool_use, tool_result or thinking"))]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        # A block type we do not serve is named, not lost in a union error.
        if isinstance(v, list):
            for i, b in enumerate(v):
                if not isinstance(b, dict):
                    raise PartError((i,), "a content block is an object with a type")
                kind = b.get("type")
                if kind not in ("text", "tool_use", "tool_result", "thinking",
                                "redacted_thinking"):
                    raise PartError((i, "type"), f"{kind!r} is not supported: this server "
                                    "reads text, tool_use, tool_result and thinking blocks")
        return v

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> "Message":
        # A block the other role sends would be dropped from the prompt: refused.
        theirs = (ThinkingBlock, ToolUseBlock) if self.role == "user" else (ToolResultBlock,)
        for i, b in enumerate(self.blocks()):
            if isinstance(b, theirs):
                owner = "assistant" if self.role == "user" else "user"
                raise PartError(("content", i), f"{b.type} blocks belong to {owner} messages")
        return self

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) \
            else list(self.content)

    def is_empty(self) -> bool:
        """Nothing the prompt would show: no text, call or result (earlier
        reasoning is left out of it)."""
        return not any(isinstance(b, (ToolUseBlock, ToolResultBlock))
                       or (isinstance(b, TextBlock) and b.text) for b in self.blocks())


def _turns(v: list[Message]) -> list[Message]:
    """Anthropic's rules for a conversation: every message has content but an
    optional final assistant one, and a final assistant message is the start
    of the answer (prefill), continued as text.  Shared by `/v1/messages` and
    its `count_tokens`."""
    empty = "all messages must have non-empty content except for the optional final " \
        "assistant message"
    for i, m in enumerate(v):
        if m.is_empty() and not (i == len(v) - 1 and m.role == "assistant"):
            raise PartError((i,), empty)
    last = v[-1]
    if last.role == "assistant" and not last.is_empty():
        blocks = [b for b in last.blocks() if not isinstance(b, ThinkingBlock)]
        if not isinstance(blocks[-1], TextBlock):
            raise PartError((len(v) - 1,), "a final assistant message is continued as "
                            f"text: it cannot end with a {blocks[-1].type} block")
        if blocks[-1].text != blocks[-1].text.rstrip():
            raise PartError((len(v) - 1,), "final assistant content cannot end with "
                            "trailing whitespace")
    return v


class Tool(_Strict):
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class ThinkingEnabled(_Strict):
    """Extended thinking, for a reasoning model (`reasoning_parser`): its
    reasoning comes back as a `thinking` block.  `budget_tokens` is checked
    as Anthropic checks it (at least 1,024, below `max_tokens`); the model
    reasons as long as it does, within `max_tokens`."""

    type: Literal["enabled"]
    budget_tokens: int = Field(..., ge=1024)


Thinking = Annotated[Annotated[ThinkingDisabled, Tag("[disabled]")]
                     | Annotated[ThinkingEnabled, Tag("[enabled]")],
                     Discriminator(_tag, custom_error_type="thinking_type",
                                   custom_error_message="type is enabled or disabled")]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    # Structured output: the answer follows this JSON Schema (a grammar).
    format: JsonOutputFormat | None = None
    # Reasoning effort: not something this server can set.
    effort: str | None = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, v: str | None) -> None:
        if v is not None:
            raise ValueError("not supported: a model's reasoning effort cannot be set here")
        return None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(..., ge=1, le=2**31 - 1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    metadata: Metadata | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    # Extended thinking: "enabled" returns a reasoning model's reasoning.
    thinking: Thinking | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # A cache breakpoint for the whole prompt: prefix caching does it anyway.
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None

    _conversation = field_validator("messages")(classmethod(lambda cls, v: _turns(v)))

    @field_validator("thinking")
    @classmethod
    def _budget_below_max(cls, v: Any, info: ValidationInfo) -> Any:
        limit = info.data.get("max_tokens")
        if isinstance(v, ThinkingEnabled) and limit is not None and v.budget_tokens >= limit:
            raise ValueError(f"budget_tokens must be less than max_tokens ({limit})")
        return v

    @property
    def thinks(self) -> bool:
        return isinstance(self.thinking, ThinkingEnabled)

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this amounts to."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens,
                                "messages": self._chat_messages(), "stream": self.stream}
        if self.messages[-1].role == "assistant" and not self.messages[-1].is_empty():
            body["continue_final_message"] = True
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type == "none"):
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(
                b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            blocks = m.blocks()
            if m.role == "assistant" and m.is_empty():
                continue  # an empty final one: the answer starts afresh
            if m.role == "assistant":
                text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
                calls = [{"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                    for b in blocks if isinstance(b, ToolUseBlock)]
                out.append({"role": "assistant", "content": text or None, **(
                    {"tool_calls": calls} if calls else {})})
                continue
            # A user turn: its tool results first (they answer the calls
            # before it), then its text.
            text = []
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": b.text()})
                elif isinstance(b, TextBlock):
                    text.append(b.text)
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "".join(text)})
        return _merged(out)


class CountTokensRequest(_Strict):
    """`POST /v1/messages/count_tokens`: what the prompt of a Message holds."""

    model: str
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    _conversation = field_validator("messages")(classmethod(lambda cls, v: _turns(v)))


class AnthropicError(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error body of `/v1/messages` (Anthropic's)."""

    type: Literal["error"]
    error: AnthropicError


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns as one, as Anthropic combines them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def check_tools(req: MessagesRequest) -> None:
    """The tool choices Anthropic refuses, refused alike."""
    choice = req.tool_choice
    if choice is None:
        return
    if choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice.name: required with type tool", "tool_choice.name")
    if choice.type in ("any", "tool") and not req.tools:
        raise APIError(400, f"tool_choice: type {choice.type} needs tools", "tool_choice")
    if choice.type == "tool" and choice.name not in {t.name for t in req.tools or []}:
        raise APIError(400, f"tool_choice.name: no tool named {choice.name!r}",
                       "tool_choice.name")


def iso_utc(seconds: float) -> str:
    """RFC 3339 in UTC, as Anthropic's timestamps are."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
    ).replace("+00:00", "Z")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_of(choice: dict[str, Any]) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a chat choice (or
    stream chunk choice) that ended."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish or "",
                                                                  "end_turn"), None


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_object(message_id: str, model: str, chat: dict[str, Any],
                   thinking: bool = False) -> dict[str, Any]:
    """The Message answering a whole chat completion `chat`; with
    `thinking`, its reasoning first as a `thinking` block."""
    choice = chat["choices"][0]
    msg = choice["message"]
    text = msg.get("content") or ""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    if thinking and msg.get("reasoning") is not None:
        content.insert(0, thinking_block(msg["reasoning"]))
    for call in msg.get("tool_calls") or []:
        content.append(tool_use_block(call))
    reason, stop = stop_of(choice)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop,
            "usage": usage(chat["usage"])}


def thinking_block(text: str) -> dict[str, Any]:
    # Anthropic signs its thinking blocks so that they can be sent back;
    # this server keeps no secret to sign with, so the signature is empty.
    # A thinking block sent back on an assistant message is accepted, its
    # signature unchecked, and left out of the prompt (`ThinkingBlock`); on
    # a user message it is refused.
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:  # a call cut short by max_tokens
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


# Chat fields (and values) an error about the chat request may name, and
# what a Messages request calls them.
_NAMES = ((re.compile(r"\btools\.(\d+)\.function\.parameters\b"), r"tools.\1.input_schema"),
          (re.compile(r"\bresponse_format\b"), "output_config.format"),
          # The field, not the word: `stop` as a param, or before its colon.
          (re.compile(r"\bstop\b(?=[:\s]|$)"), "stop_sequences"),
          (re.compile(r"\btool_choice required\b"), "tool_choice any"),
          (re.compile(r"\btool_choice named\b"), "tool_choice tool"))


def messages_error(e: APIError) -> APIError:
    """An error about the chat request a Messages request becomes, in the
    Messages API's terms."""
    message, param = e.message, e.param
    for chat, ours in _NAMES:
        message = chat.sub(ours, message)
        param = None if param is None else chat.sub(ours, param)
    return APIError(e.status, message, param, e.type, e.headers)


def error_body(e: APIError) -> dict[str, Any]:
    """Anthropic's error object for `e`, its message naming the field
    (Anthropic's errors have no field of their own for it)."""
    message = str(e.message)
    if e.param and e.param not in message:
        message = f"{e.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": message}}


Handler = Callable[[Request], Awaitable[Response]]


def anthropic_errors(handler: Handler) -> Handler:
    """`handler` with its `APIError`s answered in Anthropic's shape."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    return wrapped
