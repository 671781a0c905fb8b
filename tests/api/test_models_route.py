"""`GET /v1/models/{model}` as OpenAI's `models.retrieve` calls it, and the
`max_tokens` each route uses when the client sends none (OpenAI's and
vLLM's: 16 for completions, the rest of the context for chat)."""

from __future__ import annotations

import time

from tests.api.conftest import MAX_MODEL_LEN
from tests.api.harness import Harness
from tests.api.shapes import assert_error


def test_retrieve_answers_the_listed_model(served: Harness) -> None:
    listed = served.client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [served.model_name]
    time.sleep(1.1)  # a model's `created` is not the time of the call
    one = served.client.get(f"/v1/models/{served.model_name}")
    assert one.status_code == 200
    assert one.json() == listed[0]
    assert one.json()["object"] == "model"
    assert served.client.head(f"/v1/models/{served.model_name}").status_code == 200


def test_retrieve_of_another_model_is_a_404(served: Harness) -> None:
    # "": `/v1/models/` (a model id may hold slashes, so the route takes any path).
    for name in ("gpt-4o", "org/" + served.model_name, served.model_name + "x", ""):
        r = served.client.get(f"/v1/models/{name}")
        err = assert_error(r, 404, "model")
        assert err["type"] == "model_not_found" and repr(name) in err["message"]
    assert_error(served.client.post(f"/v1/models/{served.model_name}"), 405)


def _asked(served: Harness, path: str, body: dict[str, object]) -> tuple[int, int]:
    """The (prompt tokens, max_tokens) the request reached the scheduler with."""
    r = served.client.post(path, json={"model": served.model_name, **body})
    assert r.status_code == 200, r.text
    _, prompt_tokens, max_tokens, _, _ = served.scheduler.admitted[-1]
    return prompt_tokens, max_tokens


def test_completions_default_to_16_tokens_chat_to_the_context(served: Harness) -> None:
    assert _asked(served, "/v1/completions", {"prompt": "Once upon a time"})[1] == 16
    assert _asked(served, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40})[1] == 40
    # `null` is the rest of the context, as vLLM reads it.
    prompt, asked = _asked(served, "/v1/completions", {"prompt": "Once upon a time",
                                                       "max_tokens": None})
    assert prompt + asked == MAX_MODEL_LEN
    prompt, asked = _asked(served, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}]})
    assert prompt + asked == MAX_MODEL_LEN

