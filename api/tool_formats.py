"""How a model writes a tool call: each model family is trained on its own
text, and a call in another family's text is one the model was never
taught to write.  The grammar (`api/tools.py`) holds the model to its
format, and the parser (`api/tool_parser.py`) reads calls back from it.

- `hermes`: one block per call,

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Qwen 2.5 and 3, Hermes and SmolLM3 are trained on it, and it is what
  the prompt teaches a model whose chat template renders no tools
  (`api/tool_prompt.py`).
- `llama3_json`: the call as a bare JSON object with `parameters`, calls
  separated by `; ` (Llama 3.1–3.3's JSON tool calling; vLLM's
  `llama3_json` parser reads the same):

      {"name": "get_weather", "parameters": {"city": "Paris"}}

`tool_call_format: auto` (the default) picks by the chat template: a
template that writes `<tool_call>` blocks, or renders no tools, gets
`hermes`; one with Llama's `<|python_tag|>` or its `"parameters"` JSON
instructions gets `llama3_json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormatName = Literal["auto", "hermes", "llama3_json"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    # What a call's text begins with: `auto`'s grammar lets the model write
    # free text until it writes this, then holds it to a call, and the
    # parser takes what follows it for a call.
    trigger: str
    # A call's text up to the function's name (it begins with `trigger`).
    head: str
    # The key of a call's arguments object.
    args_key: str
    # What a call ends with after its arguments object.
    closing: str
    # Between two calls.
    separator: str
    # A call ends with an end tag (else where its JSON object closes).
    tagged: bool

    def opening(self, function: str) -> str:
        """A call's text up to its arguments."""
        return f'{self.head}{json.dumps(function)}, "{self.args_key}": '

    def write(self, function: str, arguments: dict[str, Any]) -> str:
        """A whole call, as the model writes it."""
        return (self.opening(function) + json.dumps(arguments, ensure_ascii=False)
                + self.closing)

    def call_end(self, text: str, new: int = 0) -> int:
        """`text` begins with `trigger`: the length of the call there, or
        -1 while it is not complete (it may never be: the parser gives up
        at the answer's end, and the text is content).  `text[:new]` was
        already found incomplete: a call still streaming is not re-read
        whole for every piece, only where a piece can close it."""
        if self.tagged:
            end = text.find(_END_TAG, max(0, new - len(_END_TAG) + 1))
            return -1 if end < 0 else end + len(_END_TAG)
        if text.find("}", new) < 0:  # a JSON object ends only at a '}'
            return -1
        try:
            _, end = _JSON.raw_decode(text)
        except ValueError:
            return -1
        return end

    def read(self, call: str) -> tuple[str, dict[str, Any]] | None:
        """The function and arguments of a call's text (`call_end`'s
        span); None where it is not a call of this format."""
        body = call[len(_BEGIN_TAG):-len(_END_TAG)] if self.tagged else call
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name, args = obj.get("name"), obj.get(self.args_key)
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        return name, args


_BEGIN_TAG, _END_TAG = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
HERMES = ToolFormat("hermes", _BEGIN_TAG, _BEGIN_TAG + '\n{"name": ', "arguments",
                    "}\n" + _END_TAG, "\n", tagged=True)
LLAMA3_JSON = ToolFormat("llama3_json", '{"name":', '{"name": ', "parameters", "}", "; ",
                         tagged=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def tool_format(name: ToolCallFormatName, chat_template: str | None) -> ToolFormat:
    """The format `name` names; for `auto`, the one `chat_template` teaches."""
    if name != "auto":
        return FORMATS[name]
    from api.tool_prompt import renders_tools

    template = chat_template or ""
    if not renders_tools(template) or "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES
