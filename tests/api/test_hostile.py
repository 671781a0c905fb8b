"""A named corpus of hostile requests, each with the answer it must get.

Every one is a 4xx with OpenAI's error body (`shapes.assert_error`): no
input may make the server answer a 5xx or anything but JSON.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from api.errors import APIError
from api.http import MAX_JSON_DEPTH, is_json_media_type, parse_json_object, read_json_object
from api.protocol import ChatCompletionRequest, CompletionRequest
from tests.api.conftest import MAX_REQUEST_BYTES
from tests.api.harness import Harness
from tests.api.shapes import assert_completion, assert_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_COMPLETION: dict[str, Any] = {"prompt": "Hello", "max_tokens": 3}
OK_CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def post(h: Harness, path: str, content: Any, headers: dict[str, str] | None = None) -> Any:
    if isinstance(content, dict):
        content = json.dumps(content).encode()
    return h.client.post(path, content=content,
                         headers={"content-type": "application/json", **(headers or {})})


def nested(depth: int) -> bytes:
    """An object whose `prompt` is nested so the body is `depth` levels deep."""
    return b'{"prompt": ' + b"[" * (depth - 1) + b"1" + b"]" * (depth - 1) + b"}"


# Bodies --------------------------------------------------------------------

BAD_BODIES: list[tuple[str, bytes, int, str | None]] = [
    ("empty", b"", 400, None),
    ("whitespace", b" \n\t ", 400, None),
    ("json-array", b'[{"prompt": "hi"}]', 400, None),
    ("json-string", b'"hello"', 400, None),
    ("json-null", b"null", 400, None),
    ("json-number", b"42", 400, None),
    ("truncated", b'{"prompt": "hi"', 400, None),
    ("trailing-garbage", b'{"prompt": "hi"} x', 400, None),
    ("single-quotes", b"{'prompt': 'hi'}", 400, None),
    ("utf8-bom", b'\xef\xbb\xbf{"prompt": "hi"}', 400, None),
    ("invalid-utf8", b'{"prompt": "\xff\xfe"}', 400, None),
    ("overlong-utf8", b'{"prompt": "\xc0\xaf"}', 400, None),
    ("utf8-encoded-surrogate", b'{"prompt": "\xed\xa0\x80"}', 400, None),
    ("utf16-body", '{"prompt": "hi"}'.encode("utf-16"), 400, None),
    ("nan", b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("infinity", b'{"prompt": "hi", "temperature": Infinity}', 400, None),
    ("minus-infinity", b'{"prompt": "hi", "top_p": -Infinity}', 400, None),
    ("float-overflow", b'{"prompt": "hi", "temperature": 1e999}', 400, None),
    ("5000-digit-int", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, None),
    ("nested-past-limit", nested(MAX_JSON_DEPTH + 1), 400, "prompt"),
    ("nested-10k", nested(10_000), 400, None),
    ("unclosed-60k", b'{"prompt": ' + b"[" * 60_000, 400, None),
    ("deep-objects", b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, 400, None),
    ("surrogate-in-prompt", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("low-surrogate-in-prompt", b'{"prompt": "\\udfff"}', 400, "prompt"),
    ("surrogate-in-stop", b'{"prompt": "hi", "stop": ["ok", "\\udc00"]}', 400, "stop.1"),
    ("surrogate-in-key", b'{"prompt": "hi", "\\ud800": 1}', 400, None),
    ("surrogate-in-model", b'{"prompt": "hi", "model": "\\ud800"}', 400, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"),
                         [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_malformed_bodies_are_4xx_json(served: Harness, body: bytes, status: int,
                                       param: str | None) -> None:
    assert_error(post(served, COMPLETIONS, body), status, param)


def test_nesting_up_to_the_limit_reaches_validation(served: Harness) -> None:
    # 64 levels is JSON we read; it fails as a prompt, not as JSON.
    err = assert_error(post(served, COMPLETIONS, nested(MAX_JSON_DEPTH)), 400)
    assert err["param"] is not None and err["param"].startswith("prompt")
    assert "nested" not in err["message"]


def test_surrogate_in_chat_message_names_the_field(served: Harness) -> None:
    body = b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}'
    assert_error(post(served, CHAT, body), 400, "messages.0.content")


def test_escaped_surrogate_pair_is_a_character(served: Harness) -> None:
    # "\ud83d\ude00" is one code point (an emoji), valid JSON and valid text.
    r = post(served, COMPLETIONS, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


# Size ------------------------------------------------------------------------


def test_oversized_body_with_content_length_is_413(served: Harness) -> None:
    body = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}).encode()
    assert_error(post(served, COMPLETIONS, body), 413)


def test_oversized_chunked_body_is_413(served: Harness) -> None:
    def chunks() -> Any:
        for _ in range(8):
            yield b"x" * 16384

    r = served.client.post(COMPLETIONS, content=chunks(),
                           headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413)


def test_chunked_body_is_refused_before_it_is_all_read(served: Harness) -> None:
    # TestClient buffers a request body before the app sees it, so this
    # drives the ASGI app directly, counting the chunks it pulls.
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 16384, "more_body": pulled < 1000}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": COMPLETIONS, "raw_path": b"",
             "root_path": "", "query_string": b"", "server": ("testserver", 80),
             "client": ("testclient", 1), "headers": [
                 (b"content-type", b"application/json"),
                 (b"transfer-encoding", b"chunked")]}
    asyncio.run(served.app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["code"] == 413
    assert pulled <= MAX_REQUEST_BYTES // 16384 + 1, f"{pulled} chunks pulled"


def test_a_body_at_the_limit_is_read(served: Harness) -> None:
    body = json.dumps({**OK_COMPLETION, "user": ""}).encode()
    body = body[:-3] + b" " * (MAX_REQUEST_BYTES - len(body)) + body[-3:]
    assert len(body) == MAX_REQUEST_BYTES
    assert post(served, COMPLETIONS, body).status_code == 200


def test_non_numeric_content_length_is_400(served: Harness) -> None:
    # An ASGI server normally refuses this first; the ingress must not 500.
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": [
        (b"content-length", b"\xb2")], "query_string": b""}
    with pytest.raises(APIError) as e:
        asyncio.run(read_json_object(Request(scope, receive), 1024))
    assert e.value.status == 400


# Content types -----------------------------------------------------------------


@pytest.mark.parametrize("content_type", [
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonx", "json", "application/xml", "text/json+", "+json",
    "application/octet-stream",
])
def test_non_json_content_types_are_415(served: Harness, content_type: str) -> None:
    assert_error(post(served, COMPLETIONS, OK_COMPLETION, {"content-type": content_type}), 415)


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
    "application/json;charset=latin-1", "application/vnd.api+json",
    "application/merge-patch+json; q=1", " application/json ",
])
def test_json_content_types_are_read(served: Harness, content_type: str) -> None:
    r = post(served, COMPLETIONS, OK_COMPLETION, {"content-type": content_type})
    assert_completion(r, COMPLETIONS, OK_COMPLETION)


def test_missing_content_type_is_read_as_json(served: Harness) -> None:
    # As vLLM and FastAPI do: curl -d without -H still works.
    r = served.client.post(COMPLETIONS, content=json.dumps(OK_COMPLETION).encode())
    assert "content-type" not in r.request.headers
    assert_completion(r, COMPLETIONS, OK_COMPLETION)


def test_media_type_rule() -> None:
    assert is_json_media_type("application/problem+json")
    assert not is_json_media_type("application/+json")
    assert not is_json_media_type("/+json")
    assert not is_json_media_type("")


# Routes and methods --------------------------------------------------------------


@pytest.mark.parametrize("path", [
    "/", "/v1", "/v1/", "/v1/completions/", "/v2/completions",
    "/v1/embeddings", "/v1/conversation", "/%00", "/..%2f..%2fetc/passwd",
])
def test_unknown_paths_are_404(served: Harness, path: str) -> None:
    for method in ("GET", "POST", "DELETE"):
        assert_error(served.client.request(method, path, content=b"{}"), 404)


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", COMPLETIONS, "POST"), ("PUT", CHAT, "GET, HEAD, POST"),
    ("DELETE", COMPLETIONS, "POST"), ("PATCH", CHAT, "GET, HEAD, POST"),
    ("OPTIONS", COMPLETIONS, "POST"),
    ("POST", "/v1/models", "GET, HEAD"), ("POST", "/health", "GET, HEAD"),
    ("DELETE", "/openapi.json", "GET, HEAD"), ("GET", "/v1/responses", "POST"),
    ("GET", "/tokenize", "POST"),
])
def test_wrong_methods_are_405_with_allow(served: Harness, method: str, path: str,
                                          allow: str) -> None:
    r = served.client.request(method, path, content=b"{}")
    assert_error(r, 405)
    assert set(r.headers["allow"].split(", ")) == set(allow.split(", "))


def test_head_on_get_routes(served: Harness) -> None:
    assert served.client.head("/v1/models").status_code == 200
    assert served.client.head("/health").status_code == 200


# Field values ----------------------------------------------------------------------

_FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
_WRONG_TYPES: list[Any] = ["x", [], {}, True, 1.5, -1, 10**30, [None], {"a": None}]


def test_every_field_null_at_once(served: Harness) -> None:
    for path in (COMPLETIONS, CHAT):
        err = assert_error(post(served, path, {f: None for f in _FIELDS}), 400)
        # Every null that is not allowed is named, not just the first.
        assert err["param"] is not None


@pytest.mark.parametrize("field", _FIELDS)
def test_each_field_null_or_of_a_wrong_type(served: Harness, field: str) -> None:
    for path, base in ((COMPLETIONS, OK_COMPLETION), (CHAT, OK_CHAT)):
        for value in [None, *_WRONG_TYPES]:
            body = {**base, field: value}
            r = post(served, path, body)
            if r.status_code == 200:  # a value of the list that is valid for this field
                assert_completion(r, path, body)
            elif r.status_code == 404:  # `model` names a model we do not serve
                assert field == "model", (field, value, r.text)
            else:  # refused naming this field, not another it upset
                err = assert_error(r, 400)
                assert err["param"] is not None, (field, value, err)
                assert err["param"].split(".")[0] == field, (field, value, err)


_OUT_OF_RANGE: list[tuple[str, Any]] = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 10**30), ("max_tokens", 2**70),
    ("max_tokens", 2**31), ("temperature", -0.1), ("temperature", 1e308),
    ("temperature", 10**400), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("top_k", 2**70), ("n", 0), ("n", 10**9), ("seed", 2**64), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("seed", 10**30), ("min_tokens", -1), ("min_tokens", 2**70),
    ("presence_penalty", 3.0), ("frequency_penalty", -1e9), ("repetition_penalty", 0),
    ("logprobs", 10**30), ("logprobs", -1), ("stop_token_ids", [2**70]),
    ("stop_token_ids", [-1]), ("logit_bias", {"99999999999999999999": 1}),
    ("logit_bias", {"1": 1e9}), ("logit_bias", {"-1": 1}), ("priority", 2**63),
    ("prompt", [2**70]), ("prompt", [-1]), ("prompt", [[]]), ("prompt", ""),
    ("stop", ["a", "b", "c", "d", "e"]),
]


@pytest.mark.parametrize(("field", "value"), _OUT_OF_RANGE,
                         ids=[f"{f}={str(v)[:24]}" for f, v in _OUT_OF_RANGE])
def test_out_of_range_numbers_are_400_naming_the_field(served: Harness, field: str,
                                                       value: Any) -> None:
    err = assert_error(post(served, COMPLETIONS, {**OK_COMPLETION, field: value}), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field, err


def test_beyond_the_context_is_400(served: Harness) -> None:
    assert_error(post(served, COMPLETIONS, {"prompt": "hi " * 400, "max_tokens": 5}), 400,
                 "prompt")
    assert_error(post(served, COMPLETIONS, {"prompt": "hi", "max_tokens": 10_000}), 400,
                 "max_tokens")
    assert_error(post(served, COMPLETIONS, {"prompt": [1, 2, 10**9]}), 400, "prompt")


def test_unknown_model_is_404(served: Harness) -> None:
    err = assert_error(post(served, COMPLETIONS, {**OK_COMPLETION, "model": "gpt-4"}), 404,
                       "model")
    assert err["type"] == "model_not_found"


def test_validation_errors_are_400_naming_every_field(served: Harness) -> None:
    err = assert_error(post(served, COMPLETIONS, {"prompt": "hi", "max_tokens": "ten",
                                                  "temperature": -1}), 400, "max_tokens")
    assert "max_tokens" in err["message"] and "temperature" in err["message"]


# Admission and the happy path ---------------------------------------------------------


def test_refused_admission_is_429_with_retry_after(refusing: Harness) -> None:
    for path, body in ((COMPLETIONS, OK_COMPLETION), (CHAT, {**OK_CHAT, "stream": True})):
        r = post(refusing, path, body)
        assert_error(r, 429)
        assert r.headers["retry-after"] == "2"


def test_well_formed_requests_get_openai_responses(served: Harness) -> None:
    for path, body in [
        (COMPLETIONS, OK_COMPLETION),
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "logprobs": 1}),
        (COMPLETIONS, {"prompt": [1, 2, 3], "echo": True, "max_tokens": 1, "stream": True,
                       "stream_options": {"include_usage": True}}),
        (CHAT, OK_CHAT),
        (CHAT, {**OK_CHAT, "n": 3, "stream": True, "logprobs": True, "top_logprobs": 2}),
    ]:
        assert_completion(post(served, path, body), path, body)


def test_parse_json_object_unit() -> None:
    assert parse_json_object(b'{"a": [1, 2.5, "x", null, true]}') == {
        "a": [1, 2.5, "x", None, True]}
    for bad in (b"[]", b"{", b'{"a": NaN}', b'{"a": 1e400}', b"\xff"):
        with pytest.raises(APIError) as e:
            parse_json_object(bad)
        assert e.value.status == 400
