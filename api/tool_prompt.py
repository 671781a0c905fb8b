"""A chat request's conversation as its chat template reads it, tools
included.

A template that renders tools itself (it reads a `tools` variable, as
Qwen's, Hermes' and Llama 3.1's do) gets them as `tools`, and the
conversation's earlier calls and results as OpenAI messages (arguments as
objects, HF's convention).  A template that knows nothing of tools, such
as the shipped SmolLM2's, could not show them to the model: for it the
tools are described in the system message, and the earlier calls and
their results are written into the messages as text in the format the
model is asked to answer in (`api/tools.py`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from api.tool_formats import HERMES, ToolFormat
from api.tools import ToolCall, ToolUse

_READS_TOOLS = re.compile(r"\btools\b")


def chat_prompt(req: Any, tokenizer: Any, *, tools: ToolUse | None) -> str:
    """The prompt text of chat request `req` in the model's template, with
    the tools it offers (`api.tools.tool_use(req)`, derived once by the
    caller), ending as `req` asks (`opens_answer`, `continue_final_message`).
    `APIError` 400 naming the field for what the template cannot take."""
    from api.errors import APIError
    from engine.tokenizer import render_chat

    messages, kwargs = template_input(req.messages, tools, tokenizer.chat_template)
    if req.continue_final_message:
        # HF's prefill: the text ends with the final message's content.
        kwargs["continue_final_message"] = True
    try:
        return render_chat(tokenizer, messages, req.opens_answer, **kwargs)
    except Exception as e:  # a template may reject a role order
        raise APIError(400, f"messages do not fit the chat template: {e}", "messages")


def renders_tools(template: str | None) -> bool:
    """Whether the chat template shows the model its tools itself."""
    return bool(template and _READS_TOOLS.search(template))


def template_input(messages: list[Any], use: ToolUse | None, template: str | None
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The template's messages and its keyword arguments for `messages`
    (`api.protocol.ChatMessage`s) with the tools `use` offers.  `APIError`
    400 for an earlier call whose arguments are not a JSON object."""
    native = renders_tools(template)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d = m.template_dict()
        calls = [(c, _arguments(c, i, j)) for j, c in enumerate(m.tool_calls or [])]
        if native:
            if calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": args}} for c, args in calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            text = f"<tool_response>\n{d['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text  # one turn for a batch of results
                continue
            d = {"role": "user", "content": text, "_results": True}
        elif calls:
            fmt = use.fmt if use is not None else HERMES
            written = fmt.separator.join(fmt.write(c.function.name, args) for c, args in calls)
            d["content"] = "\n".join(([d["content"]] if d["content"] else []) + [written])
        out.append(d)
    for d in out:
        d.pop("_results", None)
    if use is None:
        return out, {}
    if native:
        return out, {"tools": [t.model_dump(exclude_none=True) for t in use.tools]}
    return _with_system(out, tools_instructions(use)), {}


def tools_instructions(use: ToolUse) -> str:
    """The system message's description of the tools and of how to call
    them, for a template that renders no tools."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                       for t in use.tools)
    text = ("# Tools\n\nYou may call one or more functions to help with the user's "
            "request. The functions are described in JSON Schema within <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n{_how_to_call(use.fmt)}")
    if use.mode == "named":
        text += (f"\n\nCall {use.name} now: answer with its arguments only, as one JSON "
                 "object.")
    elif use.mode == "required":
        text += "\n\nAnswer with function calls only."
    return text


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _how_to_call(fmt: ToolFormat) -> str:
    example = (fmt.opening("<function-name>").replace('"<function-name>"', "<function-name>")
               + "<args-json-object>" + fmt.closing)
    if fmt.tagged:
        return ("To call a function, write its name and arguments as a JSON object within "
                f"<tool_call></tool_call> tags:\n{example}")
    return ("To call a function, write its name and arguments as one JSON object, and "
            f"nothing else; separate several calls with {fmt.separator.strip()!r}:\n{example}")


def _arguments(call: ToolCall, i: int, j: int) -> dict[str, Any]:
    from api.errors import APIError

    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise APIError(400, "arguments must be a JSON object, as text",
                       f"messages.{i}.tool_calls.{j}.function.arguments")
    return args
