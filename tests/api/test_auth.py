"""The optional API key: `AppConfig.api_key` / PREEMPT_SERVE_API_KEY."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import SecretStr, ValidationError

from api.auth import BearerKeyAuth, bearer_token
from api.config import API_KEY_ENV, AppConfig
from tests.api.conftest import API_KEY
from tests.api.harness import Harness, harness, undecorated_ingress
from tests.api.shapes import assert_completion, assert_error

OK = {"prompt": "Hello", "max_tokens": 2}


def auth(value: str) -> dict[str, str]:
    return {"authorization": value}


# Configuration ---------------------------------------------------------------


def test_key_from_the_environment_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert AppConfig().api_key == SecretStr("from-env")
    assert AppConfig(api_key="from-config").api_key == SecretStr("from-config")
    monkeypatch.setenv(API_KEY_ENV, "")
    assert AppConfig().api_key is None
    monkeypatch.delenv(API_KEY_ENV)
    assert AppConfig().api_key is None


@pytest.mark.parametrize("blank", ["", "   "])
def test_blank_key_is_a_config_error(blank: str) -> None:
    with pytest.raises(ValidationError, match="api_key"):
        AppConfig(api_key=blank)


def test_key_is_hidden_in_repr_and_dumps_but_survives_the_builder_hand_off() -> None:
    cfg = AppConfig(api_key="sk-secret-value")
    assert "sk-secret-value" not in repr(cfg)
    assert "sk-secret-value" not in cfg.model_dump_json()
    # The builder hands the replicas `model_dump()`, which keeps the secret.
    assert AppConfig(**cfg.model_dump()).api_key == SecretStr("sk-secret-value")


def test_max_request_bytes_is_validated() -> None:
    assert AppConfig().max_request_bytes == 8 * 1024 * 1024
    with pytest.raises(ValidationError, match="max_request_bytes"):
        AppConfig(max_request_bytes=10)


# Requests --------------------------------------------------------------------


def test_right_key_is_served(keyed: Harness) -> None:
    for header in (f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER   {API_KEY}  "):
        r = keyed.client.post("/v1/completions", json=OK, headers=auth(header))
        assert_completion(r, "/v1/completions", OK)
    r = keyed.client.get("/v1/models", headers=auth(f"Bearer {API_KEY}"))
    assert r.status_code == 200


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY}x",
    f"Bearer {API_KEY[:-1]}", f"Bearer {API_KEY.upper()}", f"Token {API_KEY}",
    f"Bearer {API_KEY} {API_KEY}",
])
def test_missing_or_wrong_key_is_401(keyed: Harness, header: str | None) -> None:
    headers = {} if header is None else auth(header)
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/openapi.json"),
                         ("GET", "/no/such/route"), ("PUT", "/v1/completions")):
        r = keyed.client.request(method, path, content=json.dumps(OK).encode(),
                                 headers=headers)
        err = assert_error(r, 401)
        assert err["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in r.text


def test_health_needs_no_key(keyed: Harness) -> None:
    assert keyed.client.get("/health").status_code == 200
    assert keyed.client.get("/health", headers=auth("Bearer wrong")).status_code == 200


def test_with_the_key_errors_are_the_usual_ones(keyed: Harness) -> None:
    headers = auth(f"Bearer {API_KEY}")
    assert_error(keyed.client.get("/nope", headers=headers), 404)
    assert_error(keyed.client.get("/v1/completions", headers=headers), 405)
    assert_error(keyed.client.post("/v1/completions", content=b"[", headers=headers), 400)


def test_unauthenticated_bodies_are_never_read(keyed: Harness) -> None:
    # 401, not 413: the key is checked before a byte of the body is read.
    r = keyed.client.post("/v1/completions", content=b"x" * (1 << 20))
    assert_error(r, 401)


def test_non_ascii_authorization_bytes() -> None:
    gate = BearerKeyAuth(app=None, api_key=SecretStr("k\u00e9y"))  # type: ignore[arg-type]
    assert gate.authorized([(b"authorization", "Bearer k\u00e9y".encode())])
    assert not gate.authorized([(b"authorization", b"Bearer k\xe9y")])
    assert not gate.authorized([(b"authorization", b"Bearer \xff\xfe")])
    assert not gate.authorized([])
    assert bearer_token([(b"x-other", b"Bearer a"), (b"Authorization", b"Bearer b")]) == b"b"


def test_anthropic_clients_key_in_x_api_key(keyed: Harness) -> None:
    body = {"model": keyed.model_name, "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}]}
    ok = keyed.client.post("/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert ok.status_code == 200, ok.text
    wrong = keyed.client.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
    assert_error(wrong, 401)
    # A Bearer header is read first, whatever `x-api-key` says.
    gate = BearerKeyAuth(app=None, api_key=SecretStr("k"))  # type: ignore[arg-type]
    assert gate.authorized([(b"x-api-key", b"k")])
    assert not gate.authorized([(b"authorization", b"Bearer no"), (b"x-api-key", b"k")])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_the_key_is_never_logged() -> None:
    secret = "sk-never-in-a-log-0042"
    undecorated_ingress()  # importing Serve sets up its logger: do that first
    records = _Records()
    # Serve's logger does not propagate to the root, so listen on both.
    loggers = [logging.getLogger(), logging.getLogger("ray.serve")]
    for lg in loggers:
        lg.addHandler(records)
    try:
        with harness(api_key=secret) as h:
            h.client.post("/v1/completions", json=OK, headers=auth(f"Bearer {secret}x"))
            h.client.post("/v1/completions", json=OK, headers=auth(f"Bearer {secret}"))
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    text = "\n".join(records.lines)
    assert "API key" in text  # that one is required is logged; what it is, never
    assert secret not in text
