"""OpenAI's Responses API (`POST /v1/responses`), served as a chat
completion: the request becomes a `ChatCompletionRequest`, its answer an
OpenAI Response object, its stream the Responses API's semantic events.

A request that does not say `store` is stored as the server's
`responses.store` says (api/responses_store.py); a batch line only with
`store: true` (deployments/responses_route.py).  A request naming a stored
`previous_response_id` continues its conversation (its inputs and outputs
come before the new input; its instructions do not, as with OpenAI).  A
conversation can also send its earlier turns, calls and results in `input`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
)

from api.protocol import ChatCompletionRequest
from api.structured import JsonSchemaFormat
from api.tools import FunctionDefinition
from api.unsupported import IncludeObfuscation, refuse_unless_off


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    # Output text's citations and log probabilities (an earlier answer sent
    # back): the text is what the conversation keeps.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    # An earlier answer's item sent back.
    id: str | None = None
    status: str | None = None


class _CallItem(_Strict):
    """What a function call and its output share: the call they belong to."""
    call_id: str = Field(..., min_length=1)
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_CallItem):
    type: Literal["function_call"]
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, v: str) -> str:
        # The chat template reads a call's arguments as an object.
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("must be a JSON object, as text")
        return v


class FunctionCallOutputItem(_CallItem):
    type: Literal["function_call_output"]
    output: str


class ReasoningItem(_Strict):
    """An earlier answer's reasoning item sent back (clients replay a
    response's `output` as the next `input`): accepted, and left out of the
    prompt, as reasoning models' templates leave earlier reasoning out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(v: Any) -> str | None:
    # Tags in brackets: an error names the field (`input.0.content`), not
    # the member of the union (api/errors.py leaves bracketed names out).
    kind = v.get("type", "message") if isinstance(v, dict) else \
        getattr(v, "type", None) or "message"
    return f"[{kind}]"


InputItem = Annotated[
    Annotated[MessageItem, Tag("[message]")]
    | Annotated[FunctionCallItem, Tag("[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("[function_call_output]")]
    | Annotated[ReasoningItem, Tag("[reasoning]")],
    Discriminator(_item_kind, custom_error_type="input_item",
                  custom_error_message="an input item is a message, a function_call, a "
                  "function_call_output or a reasoning item (files and images are not "
                  "served)")]


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat tool's function, flat."""

    type: Literal["function"]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """`text.format`: chat's `response_format` with the schema's fields
    beside its type."""

    name: str | None = None  # type: ignore[assignment]
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(_Strict):
    format: TextFormat | None = None
    # Only the default: this model's answers are not made terser or longer.
    verbosity: Literal["medium"] | None = None


_OFF = {"reasoning": "reasoning settings (effort, summaries) are not served",
        "prompt": "stored prompts are not supported",
        "context_management": "no context compaction is run",
        "background_options": "a background response runs as soon as it can",
        "image": "this model reads text only",
        "access_programs": "no access programs are offered"}


class ResponsesStreamOptions(_Strict):
    include_obfuscation: IncludeObfuscation = False


class ConversationRef(_Strict):
    """`conversation` given as an object."""

    id: str = Field(..., min_length=1)


class ResponsesRequest(_Strict):
    model: str | None = None
    # A string is one user message.
    input: list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, gt=0, le=2**31 - 1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # "auto": items are dropped from the conversation's beginning until it
    # fits the context with room for max_output_tokens (api/
    # responses_truncation.py); "disabled": a conversation too long is a 400.
    truncation: Literal["disabled", "auto"] | None = None
    # The only inclusion served: each output text token's log probability
    # (with `top_logprobs` alternatives).
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # "flex": offline work (api/protocol.py, `job_class`).
    service_tier: Literal["auto", "default", "flex"] | None = None
    # None: the server's default (`responses.store`).
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    # Kept with the response and echoed (OpenAI's limits).
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    # Answered at once as `queued` (or, with `stream`, as its events,
    # which a client can stream again), then polled (deployments/
    # responses_background.py).
    background: bool | None = None
    # Accepted only with the value that asks for nothing (`_OFF`).
    reasoning: dict[str, Any] | None = None
    # A stored conversation (api/conversation_store.py): its items come
    # before `input`, and this input and the answer are added to it.
    conversation: str | ConversationRef | None = None
    # OpenAI's bound on calls to its built-in tools (web search, code
    # interpreter, ...): this server has none, so every answer is within
    # it; function calls are the client's to bound.  Kept and echoed.
    max_tool_calls: int | None = Field(None, ge=1)
    prompt: Any = None
    stream_options: ResponsesStreamOptions | None = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    context_management: Any = None
    background_options: Any = None
    image: Any = None
    access_programs: Any = None

    @field_validator("prompt_cache_retention", "prompt_cache_options", "moderation",
                     mode="before")
    @classmethod
    def _as_on_chat(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse_unless_off(info.field_name, v)  # type: ignore[arg-type]

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator(*_OFF, mode="after")
    @classmethod
    def _off(cls, v: Any, info: Any) -> Any:
        # `completion_window: soonest` is what every background response gets.
        soonest = info.field_name == "background_options" and v == {"completion_window": "soonest"}
        if v not in (None, False, {}, []) and not soonest:
            raise ValueError(f"not supported by this server ({_OFF[info.field_name]})")
        return v

    @field_validator("conversation", mode="after")
    @classmethod
    def _one_context(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("previous_response_id") is not None:
            raise ValueError("a response continues a conversation or a previous response, "
                             "not both")
        return v

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    @field_validator("metadata", mode="after")
    @classmethod
    def _short_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and any(len(k) > 64 for k in v):
            raise ValueError("a metadata key is at most 64 characters")
        return v

    @field_validator("include", "top_logprobs", mode="after")
    @classmethod
    def _logprobs_without_tools(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, []) and info.data.get("tools"):
            raise ValueError("output text logprobs are not served with tools (the answer's "
                             "tokens may be calls, not text)")
        return v

    @property
    def logprobs(self) -> bool:
        """Output text logprobs asked for (`include`, or `top_logprobs` set)."""
        return bool(self.include) or self.top_logprobs is not None

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, v: Any) -> Any:
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    @field_validator("input", mode="after")
    @classmethod
    def _some_input(cls, v: Any) -> Any:
        if not v:
            raise ValueError("input must not be empty")
        return v

    def chat(self, items: list[Any] | None = None) -> ChatCompletionRequest:
        """The chat completion this response is served as, on `items` (the
        conversation: a stored one's items, `items_of`, then `input`; by
        default `input` alone); a 400 naming a chat field, which `responses_error`
        maps back, where it cannot be."""
        return ChatCompletionRequest.model_validate(self._chat_body(
            list(self.input) if items is None else items))

    def input_records(self) -> list[dict[str, Any]]:
        return item_records(self.input)

    def _chat_body(self, items: list[Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(items),
            "temperature": self.temperature,
            "top_p": self.top_p, "stream": self.stream, "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.service_tier == "flex":
            body["service_tier"] = "flex"
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": fmt.model_dump(
                    by_alias=True, exclude={"type"}, exclude_none=True)}
        return body

    def _messages(self, items: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        for item in items:
            if isinstance(item, MessageItem):
                content = item.content if isinstance(item.content, str) \
                    else "".join(p.text for p in item.content)
                out.append({"role": item.role, "content": content})
            elif isinstance(item, ReasoningItem):
                continue
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)  # the calls of one answer
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "content": item.output,
                            "tool_call_id": item.call_id})
        return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}
_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def item_records(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as stored and listed, in OpenAI's shape: each with its
    type, an id (OpenAI's kind, where the client gave none) and a status;
    a message's text as a content part (`input_text`, or `output_text` for
    the assistant's), as the SDKs read it."""
    out = []
    for item in items:
        record = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            record.setdefault("type", "message")
            if isinstance(item.content, str):
                record["content"] = [text_part(item.content) if item.role == "assistant"
                                     else {"type": "input_text", "text": item.content}]
        record.setdefault("id", new_item_id(record["type"]))
        record.setdefault("status", "completed")
        out.append(record)
    return out


def new_item_id(item_type: str) -> str:
    """A new id for an item of `item_type` (`message`, `function_call`, ...)."""
    return item_id(_ID_PREFIX[item_type])


def items_of(records: list[dict[str, Any]]) -> list[Any]:
    """A stored conversation's items (inputs and output items alike) as
    input items."""
    return _ITEMS.validate_python(records)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response_object(req: ResponsesRequest, response_id: str, created: float,
                    status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, stored: bool = False) -> dict[str, Any]:
    """The Response object, echoing the request's settings as OpenAI does;
    `stored`: it is kept (`store`)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) \
        else (req.tool_choice or ("auto" if req.tools else "none"))
    return {
        "id": response_id, "object": "response", "created_at": int(created),
        "background": bool(req.background),
        "service_tier": "flex" if req.service_tier == "flex" else "default",
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": None, "store": stored,
        "conversation": {"id": req.conversation_id} if req.conversation_id else None,
        "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                 if fmt is not None else {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage.get(
                "prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's reasoning (`reasoning_parser`), as its text."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if status == "in_progress"
            else [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text, logprobs)]}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "",
            "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def output_of(chat: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """A whole chat answer's output items and the response's status."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning") is not None:
        output.append(reasoning_item(item_id("rs"), message["reasoning"]))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        output.append(message_item(item_id("msg"), message["content"], logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        output.append(call_item(item_id("fc"), call))
    return output, "incomplete" if choice["finish_reason"] == "length" else "completed"


def now() -> float:
    return time.time()


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
