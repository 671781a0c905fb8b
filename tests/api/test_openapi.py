"""`GET /openapi.json`, and schemathesis driving the app from it."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from api.openapi import build_openapi
from api.protocol import ChatCompletionRequest, CompletionRequest
from tests.api.conftest import API_KEY
from tests.api.harness import Harness
from tests.api.shapes import assert_error

PATHS = {"/v1/models": "get", "/v1/completions": "post", "/v1/chat/completions": "post",
         "/health": "get"}


def test_document_covers_the_api(served: Harness) -> None:
    doc = served.client.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    assert {p: set(ops) for p, ops in doc["paths"].items()} == {
        p: {m} for p, m in PATHS.items()}
    schemas = doc["components"]["schemas"]
    for name, model in (("CompletionRequest", CompletionRequest),
                        ("ChatCompletionRequest", ChatCompletionRequest)):
        # Generated from the models: every field of theirs is documented.
        assert set(schemas[name]["properties"]) == set(model.model_fields), name
    assert set(schemas["ErrorBody"]["required"]) == {"message", "type", "code"}
    for path, method in PATHS.items():
        responses = doc["paths"][path][method]["responses"]
        for status, response in responses.items():
            if status.startswith(("4", "5")):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert {"400", "404", "413", "415", "429"} <= set(post["responses"])
    assert "securitySchemes" not in doc["components"]


def test_document_with_a_key_declares_bearer_auth(keyed: Harness) -> None:
    assert_error(keyed.client.get("/openapi.json"), 401)
    doc = keyed.client.get("/openapi.json",
                           headers={"authorization": f"Bearer {API_KEY}"}).json()
    assert doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc == build_openapi(auth=True)


@pytest.fixture
def api_schema(served: Harness) -> Any:
    return schemathesis.openapi.from_dict(served.client.get("/openapi.json").json())


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis(case: Any, served: Harness) -> None:
    """Schema-driven requests (valid and invalid) through the real app: no
    5xx, statuses, content types, headers and bodies as documented.

    Left out: `positive_data_acceptance` (the models' cross-field rules, e.g.
    stream_options only with stream, are not expressible in the schema)."""
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    if not kwargs.get("cookies"):
        kwargs.pop("cookies", None)
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    response = served.client.request(**kwargs)
    assert response.status_code < 500, response.text[:500]
    case.validate_response(response, transport_kwargs=kwargs,
                           excluded_checks=[positive_data_acceptance])
