"""Prefill: a chat request whose prompt ends inside its final message
(`continue_final_message`, vLLM's and HF's), and Anthropic's last assistant
message, which the answer continues."""

from __future__ import annotations

from typing import Any

import pytest

from api.protocol import ChatCompletionRequest
from engine.model_source import resolve_model
from engine.tokenizer import load_tokenizer
from tests.api.harness import Harness

USER = {"role": "user", "content": "Name three colours."}
START = {"role": "assistant", "content": "Sure: red,"}


def _template(messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    tok = load_tokenizer(resolve_model("embedded:smollm2"))
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _chat(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/chat/completions", json={
        "model": h.model_name, "max_tokens": 4, **body})


def test_the_prompt_ends_inside_the_final_message(served: Harness) -> None:
    served.engine.state.answer = " green and blue."
    r = _chat(served, messages=[USER, START], continue_final_message=True)
    assert r.status_code == 200, r.text
    sent = served.engine.requests[-1].prompt_token_ids
    assert sent == _template([USER, START], continue_final_message=True)
    text = served.engine.state.tokenizer.decode(sent)
    assert text.endswith("<|im_start|>assistant\nSure: red,")
    # The response holds the continuation only, as vLLM's does.
    assert r.json()["choices"][0]["message"]["content"] == " green and blue."
    assert r.json()["usage"]["prompt_tokens"] == len(sent)
    # /tokenize counts the same prompt.
    t = served.client.post("/tokenize", json={"messages": [USER, START],
                                              "continue_final_message": True}).json()
    assert t["tokens"] == sent


def test_add_generation_prompt_false_ends_after_the_last_turn(served: Harness) -> None:
    assert _chat(served, messages=[USER, START], add_generation_prompt=False).status_code == 200
    closed = served.engine.requests[-1].prompt_token_ids
    assert closed == _template([USER, START], add_generation_prompt=False)
    assert served.engine.state.tokenizer.decode(closed).endswith("Sure: red,<|im_end|>\n")
    assert _chat(served, messages=[USER, START]).status_code == 200
    opened = served.engine.requests[-1].prompt_token_ids
    assert opened == _template([USER, START], add_generation_prompt=True)
    assert opened[:len(closed)] == closed and len(opened) > len(closed)


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"add_generation_prompt": 0}, "add_generation_prompt"),
])
def test_contradictions_and_wrong_types_are_400s_naming_the_field(
        served: Harness, body: dict[str, Any], param: str) -> None:
    r = _chat(served, messages=[USER, START], **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = served.client.post("/tokenize", json={"messages": [USER, START], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_legacy_completions_still_refuse_the_chat_fields(served: Harness) -> None:
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "x", "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_unsent_add_generation_prompt_is_the_opposite_of_continuing() -> None:
    m = [USER]
    assert ChatCompletionRequest.model_validate({"messages": m}).opens_answer
    assert not ChatCompletionRequest.model_validate(
        {"messages": m, "continue_final_message": True}).opens_answer
    assert not ChatCompletionRequest.model_validate(
        {"messages": m, "add_generation_prompt": False}).opens_answer


anthropic = pytest.importorskip("anthropic")


@pytest.fixture
def client(wide: Harness) -> Any:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                               http_client=wide.client)


def test_a_last_assistant_message_is_continued(client: Any, wide: Harness) -> None:
    wide.engine.state.answer = '"city": "Oslo"}'
    messages = [{"role": "user", "content": "A city as JSON."},
                {"role": "assistant", "content": [{"type": "text", "text": "{"}]}]
    msg = client.messages.create(model=wide.model_name, max_tokens=16, messages=messages)
    sent = wide.engine.requests[-1].prompt_token_ids
    assert sent == _template([{"role": "user", "content": "A city as JSON."},
                              {"role": "assistant", "content": "{"}],
                             continue_final_message=True)
    assert msg.content[0].text == '"city": "Oslo"}' and msg.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=wide.model_name, messages=messages)
    assert counted.input_tokens == len(sent) == msg.usage.input_tokens


@pytest.mark.parametrize("last, words", [
    ({"role": "assistant", "content": "Sure: "}, "trailing whitespace"),
    ({"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                        "input": {}}]}, "tool_use"),
])
def test_anthropics_prefill_rules_are_400s(client: Any, wide: Harness,
                                           last: dict[str, Any], words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=wide.model_name, max_tokens=8, messages=[
            {"role": "user", "content": "Hi"}, last])
    assert words in str(e.value) and "messages" in str(e.value)
