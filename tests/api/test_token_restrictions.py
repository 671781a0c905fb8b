"""vLLM's `allowed_token_ids` and `bad_words` on chat and completions: what
reaches the engine, and the 400s that name them."""

from __future__ import annotations

import pytest

from tests.api.harness import Harness

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "Once upon a time"}


def _post(h: Harness, chat: bool, **extra: object) -> tuple[int, dict]:
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    r = h.client.post(path, json={"model": h.model_name, "max_tokens": 4, **body, **extra})
    return r.status_code, r.json()


@pytest.mark.parametrize("chat", [False, True])
def test_they_reach_the_engine_as_token_ids(served: Harness, chat: bool) -> None:
    status, body = _post(served, chat, allowed_token_ids=[5, 17, 17, 300],
                         bad_words=["hello", " world peace"])
    assert status == 200, body
    gen = served.engine.requests[-1]
    assert gen.allowed_token_ids == [5, 17, 17, 300]

    def enc(text: str) -> list[int]:
        return served.ingress.tokenizer(text, add_special_tokens=False)["input_ids"]

    want = []
    for word in ("hello", "world peace"):
        bare, spaced = enc(word), enc(" " + word)
        want.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            want.append(spaced)
    assert gen.bad_words_token_ids == want
    assert len(want) > 2  # " hello" is a word token of its own
    # Without them, nothing is restricted.
    _post(served, chat)
    gen = served.engine.requests[-1]
    assert gen.allowed_token_ids is None and gen.bad_words_token_ids == []


@pytest.mark.parametrize("extra,param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["7"]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [f"w{i}" for i in range(101)]}, "bad_words"),
])
@pytest.mark.parametrize("chat", [False, True])
def test_bad_values_are_400s_naming_the_field(served: Harness, chat: bool,
                                              extra: dict, param: str) -> None:
    status, body = _post(served, chat, **extra)
    assert status == 400, body
    # Named down to the element where one is wrong (`allowed_token_ids.0`).
    assert body["error"]["param"].split(".")[0] == param, body
