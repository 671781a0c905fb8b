"""OpenAI's stored chat completions, as the wire shows them: the stored
ChatCompletion object (the answer with the settings it was made with and
its `metadata`), the request's messages with their ids, and the queries
and the update body of `/v1/chat/completions` (api/chat_store_route.py;
the store is api/chat_store.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.batch import Metadata
from api.protocol import ChatCompletionRequest


class ChatCompletionUpdate(BaseModel):
    """`POST /v1/chat/completions/{id}`: its metadata, replaced whole
    (null clears it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    metadata: Metadata | None = Field(..., max_length=16)


class _Page(BaseModel):
    model_config = ConfigDict(extra="forbid")

    after: str | None = None
    limit: int = Field(20, ge=1, le=100)
    # Oldest first, as OpenAI lists them.
    order: Literal["asc", "desc"] = "asc"


class MessagesQuery(_Page):
    """`GET /v1/chat/completions/{id}/messages`'s query."""


class ChatCompletionsQuery(_Page):
    """`GET /v1/chat/completions`'s query: `model`, and `metadata[key]=value`
    pairs that a listed completion's metadata must all hold."""

    model: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("metadata", mode="before")
    @classmethod
    def _pairs(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("send metadata filters as metadata[key]=value")
        # `metadata[a][b]=` or `metadata[]=` would be a nested or nameless
        # key: the filter is a flat map of strings.
        if isinstance(v, dict) and any(not k or "[" in k or "]" in k for k in v):
            raise ValueError("send metadata filters as metadata[key]=value, each key a "
                             "plain non-empty name")
        return v

    @classmethod
    def from_params(cls, params: list[tuple[str, str]]) -> "ChatCompletionsQuery":
        """From the query's (name, value) pairs: `metadata[k]=v` as OpenAI's
        clients send a map."""
        fields: dict[str, Any] = {}
        pairs: dict[str, str] = {}
        for name, value in params:
            if name.startswith("metadata[") and name.endswith("]"):
                pairs[name[len("metadata["):-1]] = value
            else:
                fields[name] = value
        if pairs and "metadata" not in fields:  # a bare `metadata=` is refused
            fields["metadata"] = pairs
        return cls.model_validate(fields)

    def matches(self, completion: dict[str, Any]) -> bool:
        if self.model is not None and completion.get("model") != self.model:
            return False
        held = completion.get("metadata") or {}
        return all(held.get(k) == v for k, v in self.metadata.items())


def stored_object(answer: dict[str, Any], req: ChatCompletionRequest) -> dict[str, Any]:
    """The ChatCompletion object a stored completion reads as: the answer,
    with the settings it was made with, as OpenAI's stored objects carry."""
    def dumped(value: BaseModel | list[Any] | str | None) -> Any:
        if isinstance(value, list):
            return [dumped(v) for v in value]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_none=True)
        return value

    return {**answer, "metadata": dict(req.metadata or {}), "seed": req.seed,
            "temperature": req.temperature, "top_p": req.top_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "tools": dumped(req.tools),
            "tool_choice": dumped(req.tool_choice),
            "response_format": dumped(req.response_format),
            "service_tier": req.service_tier or "default", "input_user": req.user}


def stored_messages(completion_id: str, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as `GET .../{id}/messages` lists them: ids
    `<completion id>-<index>`; `content` the text, `content_parts` the parts
    where the message was sent as parts."""
    out = []
    for i, m in enumerate(req.messages):
        parts = (None if m.content is None or isinstance(m.content, str)
                 else [p.model_dump() for p in m.content])
        message: dict[str, Any] = {"id": f"{completion_id}-{i}", "role": m.role,
                                   "content": None if m.content is None else m.text(),
                                   "name": m.name, "content_parts": parts}
        if m.tool_calls is not None:
            message["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out

