"""Errors about the chat request a Response becomes, named in the Responses
API's terms (`deployments/responses_route.py`, `responses_background.py`)."""

from __future__ import annotations

from api.errors import APIError


def param_of(chat_param: str | None) -> str | None:
    """The Responses field a chat field's error is about."""
    if chat_param is None:
        return None
    head, _, rest = chat_param.partition(".")
    if head == "tools":  # tools.1.function.parameters -> tools.1.parameters
        return chat_param.replace(".function.", ".", 1)
    mapped = {"messages": "input", "max_completion_tokens": "max_output_tokens",
              "max_tokens": "max_output_tokens", "response_format": "text.format"}.get(head)
    return mapped if mapped is not None else chat_param


# Chat fields named in an error's message, and the Responses fields they are.
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
          ("response_format", "text.format"), ("messages", "input"))


def responses_error(e: APIError) -> APIError:
    """An error about the chat request a Response becomes, in the Responses
    API's terms: its `param` and the fields its message names."""
    message = e.message
    for chat, ours in _NAMES:
        message = message.replace(chat, ours)
    return APIError(e.status, message, param_of(e.param), e.type, e.headers)
