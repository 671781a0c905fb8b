"""Structured output on the wire: OpenAI's `response_format` and vLLM's
`structured_outputs` extension, turned into the engine's
`StructuredOutput` (which `engine/structured.py` enforces token by token).

A structure xgrammar cannot build (a schema with an unknown type, a regex
that does not parse) is a 400 naming the field before the request is
admitted.  The check imports xgrammar, and with it torch, into the
ingress on the first structured request, in a worker thread, so that no
other request waits on the import; its verdicts are cached.
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.tools import ToolUse
from engine.sampling_params import StructuredOutput


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`.  The output always follows
    `schema` (whatever `strict` says): a grammar cannot half-enforce it."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only read with type json_schema, not {self.type}")
        return self

    def structure(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if schema is None:
            return StructuredOutput(kind="json_object")
        return StructuredOutput(kind="json_schema", spec=json.dumps(schema, sort_keys=True))


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, "json_" if k == "json" else k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.choice is not None and any(not c for c in self.choice):
            raise ValueError("choice strings must be non-empty")
        if isinstance(self.json_, str) and not self.json_.strip():
            raise ValueError("json must be a JSON Schema, not an empty string")
        return self

    def structure(self) -> StructuredOutput:
        if self.json_object:
            return StructuredOutput(kind="json_object")
        if self.json_ is not None:
            spec = self.json_ if isinstance(self.json_, str) \
                else json.dumps(self.json_, sort_keys=True)
            return StructuredOutput(kind="json_schema", spec=spec)
        if self.regex is not None:
            return StructuredOutput(kind="regex", spec=self.regex)
        if self.choice is not None:
            return StructuredOutput(kind="choice", choices=tuple(self.choice))
        return StructuredOutput(kind="grammar", spec=self.grammar)


@lru_cache(maxsize=1024)
def _problem(so: StructuredOutput) -> str | None:
    from engine.structured import check_structured

    return check_structured(so)


def _tool_problem(use: ToolUse) -> tuple[int, str] | None:
    """The first tool whose parameters xgrammar cannot enforce, and why."""
    for i, t in enumerate(use.tools):
        problem = _problem(StructuredOutput(
            kind="json_schema", spec=json.dumps(t.function.schema(), sort_keys=True)))
        if problem is not None:
            return i, problem
    return None


async def requested_structure(req: Any, use: ToolUse | None) -> StructuredOutput | None:
    """The structure `req` asks for, by its format or the tools it offers
    (`use`: `api.tools.tool_use(req)`; None: free text).  `APIError` 400,
    naming the field, for a structure that cannot be built or a request
    that could not end it."""
    from api.errors import APIError

    fmt: ResponseFormat | None = req.response_format
    ext: StructuredOutputs | None = req.structured_outputs
    structure = fmt.structure() if fmt is not None else None
    param = "response_format"
    if ext is not None:
        if structure is not None:
            raise APIError(400, "send response_format or structured_outputs, not both",
                           "structured_outputs")
        structure, param = ext.structure(), "structured_outputs"
    if use is not None:
        if structure is not None:
            raise APIError(400, f"{param} cannot be combined with tools unless tool_choice "
                           "is none", param)
        structure, param = use.structure(), "tools"
        where = await asyncio.to_thread(_tool_problem, use)
        if where is not None:
            raise APIError(400, f"the function's parameters cannot be enforced: {where[1]}",
                           f"tools.{where[0]}.function.parameters")
    if structure is None:
        return None
    for field, on in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens)):
        if on:
            raise APIError(400, f"{field} cannot be combined with {param}: structured "
                           "output ends at the model's end-of-sequence token", field)
    if structure.kind == "json_schema":
        try:
            json.loads(structure.spec or "")
        except ValueError:
            raise APIError(400, "json must be a JSON Schema (an object, or its JSON text)",
                           param) from None
    problem = await asyncio.to_thread(_problem, structure)
    if problem is not None:
        raise APIError(400, f"{param} cannot be enforced: {problem}", param)
    return structure
