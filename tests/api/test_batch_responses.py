"""`/v1/responses` lines in a batch (`Ingress.batch_request` ->
`ResponsesRoute.batch_response`), on the real ingress app without Ray."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from api.batch import BatchOutputLine, BatchResponse
from batch.state import batch_usage
from tests.api.harness import Harness
from tests.api.shapes import assert_error
from tests.api.test_batch_routes import create, jsonl, upload

RESP = {"model": "smollm2", "input": "hi", "max_output_tokens": 5}


def line(h: Harness, body: Any) -> dict[str, Any]:
    return asyncio.run(h.ingress.batch_request("/v1/responses", body))


def test_a_response_line_runs_offline_as_the_route_answers(served: Harness) -> None:
    out = line(served, RESP)
    assert out["status_code"] == 200, out
    body = out["body"]
    assert out["request_id"] == body["id"] and body["id"].startswith("resp_")
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    assert served.engine.requests[-1].job_class == "offline"
    # Not kept unless the line asks: the output file holds it.
    assert body["store"] is False
    assert_error(served.client.get(f"/v1/responses/{body['id']}"), 404)
    http = served.client.post("/v1/responses", json={**RESP, "store": False}).json()
    for key in ("id", "created_at", "completed_at"):
        http.pop(key, None), body.pop(key, None)
    for item in http["output"] + body["output"]:
        item.pop("id")
    assert body == http


def test_a_line_that_asks_to_store_is_kept_and_continued(served: Harness) -> None:
    first = line(served, {**RESP, "store": True})["body"]
    assert first["store"] is True
    assert served.client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    follow = line(served, {**RESP, "input": "and?", "previous_response_id": first["id"]})
    assert follow["status_code"] == 200, follow
    assert follow["body"]["previous_response_id"] == first["id"]
    assert follow["body"]["usage"]["input_tokens"] > first["usage"]["input_tokens"]


@pytest.mark.parametrize("body, param", [
    ({**RESP, "stream": True}, "stream"),
    ({**RESP, "background": True}, "background"),
    ({**RESP, "max_output_tokens": 0}, "max_output_tokens"),
    ({**RESP, "conversation": "conv_1"}, "conversation"),
    ({**RESP, "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"model": "smollm2"}, "input"),
])
def test_a_bad_response_line_is_an_answer_naming_the_field(
        served: Harness, body: dict[str, Any], param: str) -> None:
    out = line(served, body)
    assert 400 <= out["status_code"] < 500, out
    assert out["body"]["error"]["param"] == param
    if param not in ("stream", "background"):  # refused over HTTP alike
        http = served.client.post("/v1/responses", json=body)
        assert (http.status_code, http.json()) == (out["status_code"], out["body"])


def test_a_batch_may_target_the_responses_endpoint(served: Harness) -> None:
    file_id = upload(served, jsonl(RESP, RESP, url="/v1/responses")).json()["id"]
    r = create(served, input_file_id=file_id, endpoint="/v1/responses")
    assert r.status_code == 200, r.text
    assert (r.json()["endpoint"], r.json()["request_counts"]["total"]) == ("/v1/responses", 2)


def test_usage_adds_responses_and_chat_token_counts() -> None:
    def answered(usage: dict[str, int]) -> BatchOutputLine:
        return BatchOutputLine(id="batch_req_1", custom_id="c", response=BatchResponse(
            status_code=200, body={"usage": usage}))

    usage = batch_usage([answered({"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}),
                         answered({"prompt_tokens": 2, "completion_tokens": 5})])
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (9, 8, 17)
    assert json.loads(usage.model_dump_json())["total_tokens"] == 17
