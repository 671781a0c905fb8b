"""A chat request's messages (`messages` of `/v1/chat/completions`, and
what the Responses and Messages APIs turn theirs into): text only, with
tool calls and their results."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from api.tools import ToolCall


class _Strict(BaseModel):
    # Strict types as OpenAI's API: "5" is not an integer, true is not 1.
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


def _text_parts(v: Any) -> Any:
    """Clear errors for content parts: this model reads text only."""
    if isinstance(v, list):
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise ValueError(f"content[{i}] must be an object")
            if part.get("type") != "text":
                raise ValueError(f"content[{i}].type {part.get('type')!r} is not supported: "
                                 "this model reads text only")
    return v


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only for an assistant message that made tool calls.
    content: str | list[ContentPart] | None = None
    # Passed to the chat template, which may use it.
    name: str | None = None
    # An earlier answer's calls, and (role `tool`) the call a result answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None

    _parts = field_validator("content", mode="before")(classmethod(
        lambda cls, v: _text_parts(v)))

    @model_validator(mode="before")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("role") == "function":
            raise ValueError("role 'function' is deprecated and not served: send a "
                             "'tool' message with the tool_call_id it answers")
        return v

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only read on assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message "
                             "has one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant "
                             "message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        d = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        return d


def one_ending(continue_final_message: bool, add_generation_prompt: bool | None) -> None:
    """vLLM's and HF's rule for how a chat prompt ends: it either opens a new
    answer or continues the final message (prefill), not both."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("cannot be true with add_generation_prompt: the prompt either "
                         "opens a new answer or continues the final message")


def opens_answer(continue_final_message: bool, add_generation_prompt: bool | None) -> bool:
    """Whether the prompt ends with the header of a new assistant answer:
    unsent, add_generation_prompt is the opposite of continue_final_message."""
    return not continue_final_message if add_generation_prompt is None \
        else add_generation_prompt
