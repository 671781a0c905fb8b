"""What a client may rely on in every answer: OpenAI's error body for every
non-2xx, OpenAI's response (or event stream) shape for every 2xx."""

from __future__ import annotations

import json
import time
from types import EllipsisType
from typing import Any

import httpx2

from api.protocol import ChatCompletionRequest, CompletionRequest

_ERROR_KEYS = {"message", "type", "param", "code"}
_FINISH = {"stop", "length"}


def assert_error(r: httpx2.Response, status: int | None = None,
                 param: str | None | EllipsisType = ...) -> dict[str, Any]:
    """`r` is an OpenAI-style JSON error (with `status` / `param` if given)."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == _ERROR_KEYS, err
    assert err["code"] == r.status_code, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    if param is not ...:
        assert err["param"] == param, err
    return err


def expected_choices(path: str, body: dict[str, Any]) -> int:
    """n × prompts of a request the server accepted."""
    if path.endswith("/chat/completions"):
        return ChatCompletionRequest.model_validate(body).n
    req = CompletionRequest.model_validate(body)
    return req.n * len(req.prompts())


def _check_usage(usage: Any) -> None:
    assert isinstance(usage, dict), usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0, usage


def assert_completion(r: httpx2.Response, path: str, body: dict[str, Any]) -> None:
    """`r` is a 200 with the OpenAI shape of the request's endpoint and mode."""
    assert r.status_code == 200, (r.status_code, r.text[:500])
    chat = path.endswith("/chat/completions")
    count = expected_choices(path, body)
    if body.get("stream"):
        _assert_stream(r, chat, count, bool((body.get("stream_options") or {})
                                            .get("include_usage")))
        return
    assert r.headers["content-type"].startswith("application/json")
    out = r.json()
    assert out["object"] == ("chat.completion" if chat else "text_completion"), out
    assert isinstance(out["id"], str) and out["id"], out
    assert isinstance(out["created"], int) and abs(out["created"] - time.time()) < 3600
    assert isinstance(out["model"], str)
    assert [c["index"] for c in out["choices"]] == list(range(count)), out["choices"]
    for c in out["choices"]:
        assert c["finish_reason"] in _FINISH, c
        assert c["logprobs"] is None or isinstance(c["logprobs"], dict), c
        if chat:
            assert c["message"]["role"] == "assistant", c
            assert isinstance(c["message"]["content"], str), c
        else:
            assert isinstance(c["text"], str), c
    _check_usage(out["usage"])


def _assert_stream(r: httpx2.Response, chat: bool, count: int, include_usage: bool) -> None:
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events and events[-1] == "[DONE]", r.text[-500:]
    finished: dict[int, str] = {}
    usage_chunks = 0
    for raw in events[:-1]:
        chunk = json.loads(raw)
        assert "error" not in chunk, chunk
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        if not chunk["choices"]:
            usage_chunks += 1
            _check_usage(chunk["usage"])
            continue
        for c in chunk["choices"]:
            assert 0 <= c["index"] < count, c
            assert c["index"] not in finished, ("a chunk after the finish", c)
            if chat:
                assert isinstance(c["delta"], dict), c
            else:
                assert isinstance(c["text"], str), c
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in _FINISH, c
                finished[c["index"]] = c["finish_reason"]
    assert sorted(finished) == list(range(count)), finished
    assert usage_chunks == (1 if include_usage else 0)
