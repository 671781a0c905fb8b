"""`GET /openapi.json`, and schemathesis driving the app from it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from api.batch import BatchCreateRequest
from api.openapi import build_openapi
from api.protocol import ChatCompletionRequest, CompletionRequest
from tests.api.conftest import API_KEY
from tests.api.harness import Harness
from tests.api.shapes import assert_error

PATHS = {"/v1/models": {"get"}, "/v1/models/{model}": {"get"}, "/v1/completions": {"post"},
         "/v1/chat/completions": {"get", "post"},
         "/v1/chat/completions/{completion_id}": {"get", "post", "delete"},
         "/v1/chat/completions/{completion_id}/messages": {"get"},
         "/health": {"get"}, "/v1/files": {"get", "post"},
         "/v1/files/{file_id}": {"delete", "get"},
         "/v1/files/{file_id}/content": {"get"}, "/v1/batches": {"get", "post"},
         "/v1/batches/{batch_id}": {"get"}, "/v1/batches/{batch_id}/cancel": {"post"},
         "/tokenize": {"post"}, "/v1/messages": {"post"},
         "/v1/messages/count_tokens": {"post"}, "/v1/messages/batches": {"get", "post"},
         "/v1/messages/batches/{batch_id}": {"get", "delete"},
         "/v1/messages/batches/{batch_id}/cancel": {"post"},
         "/v1/messages/batches/{batch_id}/results": {"get"}, "/detokenize": {"post"}, "/v1/responses": {"post"},
         "/v1/responses/{response_id}": {"get", "delete"},
         "/v1/responses/{response_id}/input_items": {"get"},
         "/v1/responses/{response_id}/cancel": {"post"},
         "/v1/conversations": {"post"},
         "/v1/conversations/{conversation_id}": {"get", "post", "delete"},
         "/v1/conversations/{conversation_id}/items": {"get", "post"},
         "/v1/conversations/{conversation_id}/items/{item_id}": {"get", "delete"}}


def test_document_covers_the_api(served: Harness) -> None:
    doc = served.client.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    assert {p: set(ops) for p, ops in doc["paths"].items()} == PATHS
    # Every route the app serves is described (but the document itself).
    # Starlette's `{name:path}` is OpenAPI's `{name}`.
    served_routes = {(r.path.replace(":path}", "}"), m.lower()) for r in served.app.routes
                     for m in getattr(r, "methods", None) or () if m != "HEAD"}
    assert served_routes - {("/openapi.json", "get")} == {
        (p, m) for p, ms in PATHS.items() for m in ms}
    schemas = doc["components"]["schemas"]
    for name, model in (("CompletionRequest", CompletionRequest),
                        ("ChatCompletionRequest", ChatCompletionRequest),
                        ("BatchCreateRequest", BatchCreateRequest)):
        # Generated from the models: every field of theirs is documented.
        assert set(schemas[name]["properties"]) == set(model.model_fields), name
    assert set(schemas["ErrorBody"]["required"]) == {"message", "type", "code"}
    for path, methods in PATHS.items():
        for method in methods:
            responses = doc["paths"][path][method]["responses"]
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    # Anthropic's API answers Anthropic's errors (but the auth layer's
                    # 401, and a 500 may be either).
                    ref = {"$ref": "#/components/schemas/ErrorResponse"}
                    theirs = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
                    if not path.startswith("/v1/messages") or status == "401":
                        assert schema == ref
                    else:
                        assert schema == ({"oneOf": [theirs, ref]} if status == "500"
                                          else theirs)
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert {"400", "404", "413", "415", "429", "503"} <= set(post["responses"])
    assert "securitySchemes" not in doc["components"]
    create = doc["paths"]["/v1/batches"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchCreateRequest"}
    assert {"400", "404", "503"} <= set(create["responses"])
    upload = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert upload["multipart/form-data"]["schema"]["required"] == ["file", "purpose"]


def test_document_with_a_key_declares_either_header(keyed: Harness) -> None:
    assert_error(keyed.client.get("/openapi.json"), 401)
    doc = keyed.client.get("/openapi.json",
                           headers={"authorization": f"Bearer {API_KEY}"}).json()
    assert doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    assert doc["security"] == [{"bearer": []}, {"x-api-key": []}]  # either one
    # As declared: Anthropic's header opens the document too.
    assert keyed.client.get("/openapi.json", headers={"x-api-key": API_KEY}).json() == doc
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc == build_openapi(auth=True)


def _schema(served: Harness, phases: dict[str, bool]) -> Any:
    config = SchemathesisConfig.from_dict(
        {"phases": {name: {"enabled": on} for name, on in phases.items()}})
    return schemathesis.openapi.from_dict(served.client.get("/openapi.json").json(),
                                          config=config)


# The coverage phase (each field's boundary values and wrong types, half the
# time of the whole) is left to the long run (-m slow); the default run
# keeps the schema's examples and the fuzzing, and tests/api/test_hostile.py
# sends out-of-range and wrong-typed fields by name.
@pytest.fixture
def api_schema(served: Harness) -> Any:
    return _schema(served, {"coverage": False})


@pytest.fixture
def api_schema_boundaries(served: Harness) -> Any:
    return _schema(served, {"coverage": True, "examples": False, "fuzzing": False})


schema = schemathesis.pytest.from_fixture("api_schema")
boundaries = schemathesis.pytest.from_fixture("api_schema_boundaries")
_SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


@schema.parametrize()
@_SETTINGS
def test_schemathesis(case: Any, served: Harness) -> None:
    """Schema-driven requests (valid and invalid) through the real app: no
    5xx, statuses, content types, headers and bodies as documented.

    Left out: `positive_data_acceptance` (the models' cross-field rules, e.g.
    stream_options only with stream, are not expressible in the schema)."""
    _check(case, served)


@pytest.mark.slow
@boundaries.parametrize()
@_SETTINGS
def test_schemathesis_boundaries(case: Any, served: Harness) -> None:
    """`test_schemathesis`'s checks on each field's boundary values."""
    _check(case, served)


def _check(case: Any, served: Harness) -> None:
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    if not kwargs.get("cookies"):
        kwargs.pop("cookies", None)
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    if kwargs.get("files"):
        # httpx renders text and bytes parts only: other generated values as
        # a client would send them, in JSON.
        kwargs["files"] = [(name, (part[0], _text(part[1]), *part[2:]))
                           for name, part in kwargs["files"]]
    response = served.client.request(**kwargs)
    response.request.read()  # a multipart body is streamed; the checks read it
    assert response.status_code < 500, response.text[:500]
    excluded = [positive_data_acceptance]
    if _untyped_on_the_wire(case.query):
        excluded.append(negative_data_rejection)
    case.validate_response(response, transport_kwargs=kwargs, excluded_checks=excluded)


def _untyped_on_the_wire(query: Any) -> bool:
    """Whether a generated `metadata[key]=value` filter holds a value the
    schema calls no string (null, a number, an object): schemathesis writes
    it into the query as its JSON text ("null"), which is a string the
    server rightly takes, so its case is no negative test."""
    return any(name.startswith("metadata[") and (not isinstance(v, str) or _json_not_str(v))
               for name, v in (query or {}).items())


def _json_not_str(text: str) -> bool:
    try:
        return not isinstance(json.loads(text), str)
    except ValueError:
        return False


def _text(value: Any) -> str | bytes:
    return value if isinstance(value, (str, bytes)) else json.dumps(value)
