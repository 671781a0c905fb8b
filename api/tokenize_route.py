"""`POST /tokenize` and `POST /detokenize`, vLLM's tokenizer endpoints.

A client counts a prompt's tokens here exactly as the server counts them
for a request: a `prompt` as `/v1/completions` encodes it, `messages` (with
their `tools`) rendered by the same chat template and the same tool
description as `/v1/chat/completions` (`api/tool_prompt.py`).  Nothing is
generated and the engine is not asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import (
    BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.chat_messages import ChatMessage, one_ending, opens_answer
from api.config import AppConfig
from api.errors import APIError, validation_error
from api.http import read_json_object
from api.models_route import unknown_model
from api.openapi_ops import post_op
from api.tool_formats import ToolFormat
from api.tools import ToolChoice, ToolDefinition


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizePromptRequest(_Strict):
    model: str | None = None
    prompt: str
    # The tokenizer's own special tokens (a BOS), as /v1/completions adds them.
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # As /v1/chat/completions renders it: by default ending where the answer
    # begins.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, v: bool, info: ValidationInfo) -> bool:
        one_ending(v, info.data.get("add_generation_prompt"))
        return v

    @property
    def opens_answer(self) -> bool:
        return opens_answer(self.continue_final_message, self.add_generation_prompt)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def encode(tokenizer: Any, text: str, param: str, chat: bool = False,
           add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (`chat`: a rendered chat template, which carries
    its own special tokens); a 400 naming `param` for text the tokenizer
    cannot encode."""
    from engine.tokenizer import encode_chat_text

    try:
        if chat:
            return encode_chat_text(tokenizer, text)
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as e:  # e.g. text the tokenizer cannot encode
        raise APIError(400, f"{param} cannot be tokenized: {e}", param)


def chat_ids(req: Any, tokenizer: Any, fmt: ToolFormat) -> tuple[Any, str, list[int]]:
    """Chat request `req`'s tool use (`api.tools.tool_use`, in format
    `fmt`), its prompt text in the model's template and the text's token
    ids: what the ingress serves, `/tokenize` counts and a Response's
    truncation measures, rendered one way."""
    from api.tool_prompt import chat_prompt
    from api.tools import tool_use

    tools = tool_use(req, fmt)
    text = chat_prompt(req, tokenizer, tools=tools)
    return tools, text, encode(tokenizer, text, "messages", chat=True)


class TokenizeRoutes:
    def __init__(self, tokenizer: Any, cfg: AppConfig, tool_format: ToolFormat,
                 names: Callable[[], list[str]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        # The served models' names (adapters loaded at runtime among them):
        # the adapters tokenize as their base model does.
        self.names = names or (lambda: [cfg.model_name, *cfg.lora_adapters])
        self.max_model_len = cfg.max_model_len
        self.max_request_bytes = cfg.max_request_bytes

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        body = await read_json_object(request, self.max_request_bytes)
        chat = "messages" in body
        req = self._validate(body, TokenizeChatRequest if chat else TokenizePromptRequest)
        if isinstance(req, TokenizeChatRequest):
            ids = chat_ids(req, self.tokenizer, self.tool_format)[2]
        else:
            ids = encode(self.tokenizer, req.prompt, "prompt",
                         add_special_tokens=req.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len,
                               "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        req = self._validate(await read_json_object(request, self.max_request_bytes),
                             DetokenizeRequest)
        assert isinstance(req, DetokenizeRequest)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    def _validate(self, body: dict[str, Any], model: type[BaseModel]) -> BaseModel:
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e)
        name = getattr(req, "model", None)
        names = self.names()
        if name is not None and name not in names:
            raise unknown_model(name, names)
        return req


# `GET /openapi.json`'s part (api/openapi.py builds the document).
MODELS: list[tuple[type[BaseModel], Any]] = [
    (TokenizePromptRequest, "validation"),
    (TokenizeChatRequest, "validation"),
    (DetokenizeRequest, "validation"),
]
_ERRORS = {
    "400": "a field is invalid or the text cannot be tokenized",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "the `model` is not served",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "500": "an internal error",
}
_TOKENS: dict[str, Any] = {
    "type": "object", "required": ["count", "max_model_len", "tokens"],
    "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                   "tokens": {"type": "array", "items": {"type": "integer"}},
                   "token_strs": {"type": "array", "items": {"type": "string"}}},
}
_TEXT: dict[str, Any] = {"type": "object", "required": ["prompt"],
                         "properties": {"prompt": {"type": "string"}}}


def tokenize_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]
                   ) -> dict[str, Any]:
    def op(summary: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
        return post_op(summary, body, ok, _ERRORS, error_ref)

    either = {"anyOf": [refs[(TokenizePromptRequest, "validation")],
                        refs[(TokenizeChatRequest, "validation")]]}
    return {
        "/tokenize": {"post": op("The token ids of a prompt, or of chat messages as the "
                                 "chat template renders them", either, _TOKENS)},
        "/detokenize": {"post": op("The text of token ids",
                                   refs[(DetokenizeRequest, "validation")], _TEXT)},
    }
