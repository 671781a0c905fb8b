"""Tool calling on the wire: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, turned into what the request asks of the engine.

Tool calls are written in the model family's format (`api/tool_formats.py`:
Hermes' `<tool_call>` blocks, or Llama 3's bare JSON objects), and every
call the model writes is held to its function's `parameters` schema by a
grammar (xgrammar's structural tags), so a call's arguments always parse
and follow the schema:

- `auto` (the default with tools): free text, and once the model begins a
  call (`<tool_call>`, or `{"name":`) the rest of it is constrained to one
  of the tools;
- `required`: only tool calls, at least one, separated as the format
  separates them;
- a named function: the output is that function's arguments as JSON (no
  block around them), as vLLM serves a named choice;
- `none`: no tool is offered (the prompt does not list them) and nothing
  is constrained.

`parallel_tool_calls: false` stops the grammar after the first call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.tool_formats import HERMES, ToolFormat
from engine.sampling_params import StructuredOutput

# The arguments of a function that declares no `parameters`: OpenAI reads
# that as an empty parameter list.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON Schema of the arguments object.
    parameters: dict[str, Any] | None = None
    # The arguments always follow `parameters`, whatever `strict` says: a
    # grammar cannot half-enforce a schema.
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else _NO_PARAMETERS


class ToolDefinition(_Strict):
    # OpenAI's `custom` tools (free-form input) are not served: a 400 here.
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    # The arguments as JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(_Strict):
    id: str = Field(..., min_length=1)
    type: Literal["function"]
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request's tools ask of one of its answers."""

    tools: tuple[ToolDefinition, ...]
    # "auto", "required" or "named"
    mode: str
    # The function a named choice forces.
    name: str | None = None
    parallel: bool = True
    fmt: ToolFormat = HERMES

    def structure(self) -> StructuredOutput:
        """The grammar its output must follow."""
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutput(kind="json_schema",
                                    spec=json.dumps(fn.schema(), sort_keys=True))
        form = self.fmt
        tags = [{"type": "tag", "begin": form.opening(t.function.name),
                 "content": {"type": "json_schema", "json_schema": t.function.schema()},
                 "end": form.closing} for t in self.tools]
        if self.mode == "required":
            fmt: dict[str, Any] = {"type": "tags_with_separator", "tags": tags,
                                   "separator": form.separator, "at_least_one": True,
                                   "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": [form.trigger], "tags": tags,
                   "at_least_one": False, "stop_after_first": not self.parallel}
        return StructuredOutput(kind="structural_tag", spec=json.dumps(
            {"type": "structural_tag", "format": fmt}, sort_keys=True))


def tool_use(req: Any, fmt: ToolFormat = HERMES) -> ToolUse | None:
    """What `req`'s tools ask for, its calls written in `fmt` (None: no
    tool is offered).  `APIError` 400 naming the field for a choice that
    cannot be served."""
    from api.errors import APIError

    tools: list[ToolDefinition] | None = getattr(req, "tools", None)
    choice: ToolChoice | None = getattr(req, "tool_choice", None)
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise APIError(400, f"function names must be unique (repeated: {', '.join(dup)})",
                       "tools")
    if choice == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, "
                           "which is not among the tools", "tool_choice")
        return ToolUse(tuple(tools), "named", choice.function.name, parallel, fmt)
    return ToolUse(tuple(tools), choice or "auto", None, parallel, fmt)
