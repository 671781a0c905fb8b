"""A template that renders tools itself gets them, and the conversation's
calls and results, as OpenAI messages (arguments as objects); one that
does not gets them written into the messages."""

from __future__ import annotations

from typing import Any

from api.protocol import ChatCompletionRequest
from api.tool_prompt import chat_prompt, renders_tools, template_input
from api.tools import tool_use
from engine.model_source import resolve_model
from engine.tokenizer import load_tokenizer

# A minimal template in the shape of Qwen's: it reads `tools`, each call's
# arguments as an object, and a result's `tool_call_id`.
NATIVE = (
    "{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{%- for m in messages %}[{{ m.role }}]"
    "{%- for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %}{{ m.content }}"
    "{%- endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def _request(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_7"}],
        "tools": [WEATHER], **extra})


def test_a_template_that_reads_tools_renders_them_itself() -> None:
    assert renders_tools(NATIVE) and not renders_tools("{{ messages }} toolset")
    tok = load_tokenizer(resolve_model("embedded:smollm2"))
    tok.chat_template = NATIVE
    req = _request()
    text = chat_prompt(req, tok, tools=tool_use(req))
    assert text == ("TOOLS:get_weather;[system]Be brief.[user]Oslo?"
                    "[assistant]CALL get_weather(Oslo)[tool]<call_7>-3 C[assistant]")
    # tool_choice none: the template is not handed the tools.
    req = _request(tool_choice="none")
    assert not chat_prompt(req, tok, tools=tool_use(req)).startswith("TOOLS")


def test_a_template_without_tools_reads_them_in_the_system_message() -> None:
    req = _request()
    messages, kwargs = template_input(req.messages, tool_use(req), template="{{ messages }}")
    assert kwargs == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in system
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    # Without a system message of its own, the tools get one.
    bare = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Oslo?"}], "tools": [WEATHER]})
    messages, _ = template_input(bare.messages, tool_use(bare), template=None)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
