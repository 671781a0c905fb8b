"""`/v1/files`, `/v1/batches` and `Ingress.batch_request` on the real
ingress app, without Ray (fake Jobs API and engine: tests/api/harness.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api.conftest import API_KEY
from tests.api.harness import Harness, harness
from tests.api.shapes import assert_error

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def jsonl(*bodies: dict[str, Any], url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": b})
                   + "\n" for i, b in enumerate(bodies)).encode()


def upload(h: Harness, data: bytes, **fields: str) -> Any:
    return h.client.post("/v1/files", files={"file": ("in.jsonl", data)},
                         data={"purpose": "batch", **fields})


def create(h: Harness, **body: Any) -> Any:
    if "input_file_id" not in body:
        body["input_file_id"] = upload(h, jsonl(CHAT, CHAT)).json()["id"]
    return h.client.post("/v1/batches", json={"endpoint": "/v1/chat/completions",
                                              "completion_window": "24h", **body})


@pytest.fixture(scope="module")
def small() -> Iterator[Harness]:
    with harness(batch={"max_file_bytes": 2048}) as h:
        yield h


# Files ------------------------------------------------------------------------


def test_an_upload_is_stored_and_served_back(served: Harness) -> None:
    data = jsonl(CHAT, CHAT)
    r = upload(served, data)
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["id"].startswith("file-") and f["object"] == "file"
    assert (f["bytes"], f["filename"], f["purpose"], f["status"]) == (
        len(data), "in.jsonl", "batch", "processed")
    assert served.client.get(f"/v1/files/{f['id']}").json() == f
    content = served.client.get(f"/v1/files/{f['id']}/content")
    assert content.status_code == 200 and content.content == data


def test_upload_errors_name_the_field(served: Harness) -> None:
    def form(**parts: Any) -> Any:
        # (None, value): a plain field; (name, bytes): a file.
        return served.client.post("/v1/files", files=parts)

    assert_error(upload(served, b"{}", purpose="fine-tune"), 400, "purpose")
    assert_error(form(file=("a", b"{}")), 400, "purpose")
    assert_error(form(purpose=(None, "batch"), other=("a", b"{}")), 400, "other")
    assert_error(upload(served, b"{}", x="1"), 400, "x")
    assert_error(form(purpose=(None, "batch"), file=(None, "text, not a file")), 400, "file")
    err = assert_error(upload(served, b"{}", expires_after="3600"), 400, "expires_after")
    assert "expires_after[seconds]" in err["message"]
    assert_error(upload(served, b"{}", **{"expires_after[anchor]": "created_at",
                                          "expires_after[seconds]": "60"}),
                 400, "expires_after.seconds")
    assert_error(upload(served, b"{}", **{"expires_after[anchor]": "now",
                                          "expires_after[seconds]": "3600"}),
                 400, "expires_after.anchor")
    assert_error(upload(served, b"{}", **{"expires_after[seconds]": "3600"}),
                 400, "expires_after.anchor")
    assert_error(served.client.post("/v1/files", json={"purpose": "batch"}), 415)
    assert_error(served.client.post("/v1/files", data={"purpose": "batch"}), 415)
    assert_error(served.client.post("/v1/files", content=b"--x\r\n",
                                    headers={"content-type": "multipart/form-data; boundary=x"}),
                 400)


def test_an_upload_over_the_limit_is_a_413_and_stores_nothing(small: Harness) -> None:
    files = small.ingress.batches.store.root / "files"
    before = set(files.iterdir()) if files.exists() else set()
    assert_error(upload(small, b"x" * 3000), 413, "file")
    # Past the framing allowance too: refused from the declared length.
    assert_error(upload(small, b"x" * (2048 + 70 * 1024)), 413)
    assert (set(files.iterdir()) if files.exists() else set()) == before
    assert upload(small, b"x" * 2000).status_code == 200


@pytest.mark.parametrize("path", ["/v1/files/file-nope", "/v1/files/..%2F..%2Fetc%2Fpasswd",
                                  "/v1/files/file-00000000000000000000000000000000/content",
                                  "/v1/batches/batch_nope", "/v1/batches/batch_x/cancel"])
def test_unknown_ids_are_404(served: Harness, path: str) -> None:
    method = "POST" if path.endswith("/cancel") else "GET"
    assert_error(served.client.request(method, path), 404)


# Batches ----------------------------------------------------------------------


def test_create_starts_a_job_and_reports_the_batch(served: Harness) -> None:
    r = create(served, metadata={"run": "nightly"})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["object"] == "batch" and b["id"].startswith("batch_")
    assert (b["status"], b["endpoint"], b["completion_window"], b["model"]) == (
        "in_progress", "/v1/chat/completions", "24h", "smollm2")
    assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert b["metadata"] == {"run": "nightly"}
    assert b["expires_at"] == b["created_at"] + 24 * 3600  # OpenAI's window, enforced
    sid, entrypoint, meta = served.jobs.submitted[-1]
    assert sid == f"{b['id']}-1" and entrypoint.startswith("python -m batch.job ")
    assert meta == {"preempt_serve_batch": b["id"], "app": "test-app"}
    assert served.client.get(f"/v1/batches/{b['id']}").json() == b


def test_results_show_through_the_batch_and_its_files(served: Harness) -> None:
    b = create(served).json()
    store = served.ingress.batches.store
    record = store.batch(b["id"])
    line = {"id": "batch_req_1", "custom_id": "c0", "error": None,
            "response": {"status_code": 200, "request_id": "r", "body": {"id": "r"}}}
    data = (json.dumps(line) + "\n").encode()
    # A line being written is not shown until it is complete.
    store.output_path(record).write_bytes(data + b'{"id": "batch_req_2", "cust')
    served.jobs.status[f"{b['id']}-1"] = "SUCCEEDED"
    b = served.client.get(f"/v1/batches/{b['id']}").json()
    assert b["status"] == "completed" and b["completed_at"] == 2000
    assert b["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert b["error_file_id"] is None
    f = served.client.get(f"/v1/files/{b['output_file_id']}").json()
    assert (f["purpose"], f["bytes"]) == ("batch_output", len(data))
    assert served.client.get(f"/v1/files/{b['output_file_id']}/content").content == data
    # A results file is not an input file.
    assert_error(create(served, input_file_id=b["output_file_id"]), 400, "input_file_id")


def test_create_errors_name_the_field(served: Harness) -> None:
    file_id = upload(served, jsonl(CHAT)).json()["id"]
    cases = {
        "input_file_id": {"input_file_id": "file-nope"},
        "endpoint": {"input_file_id": file_id, "endpoint": "/v1/embeddings"},
        "completion_window": {"input_file_id": file_id, "completion_window": "48h"},
        "output_expires_after.seconds": {"input_file_id": file_id, "output_expires_after": {
            "anchor": "created_at", "seconds": 60}},
        "metadata": {"input_file_id": file_id, "metadata": {f"k{i}": "v" for i in range(17)}},
        "extra": {"input_file_id": file_id, "extra": 1},
    }
    for param, body in cases.items():
        status = 404 if param == "input_file_id" else 400
        assert_error(create(served, **body), status, param)
    assert_error(served.client.post("/v1/batches", content=b"x",
                                    headers={"content-type": "text/plain"}), 415)
    assert_error(served.client.post("/v1/batches", content=b"[1]"), 400)


def test_list_pages_newest_first(served: Harness) -> None:
    ids = [create(served).json()["id"] for _ in range(3)]
    page = served.client.get("/v1/batches", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [b["id"] for b in page["data"]] == [page["first_id"], page["last_id"]]
    rest = served.client.get("/v1/batches", params={"after": page["last_id"]}).json()
    every = [b["id"] for b in page["data"] + rest["data"]]
    assert len(every) == len(set(every)) and set(ids) <= set(every)
    created = [b["created_at"] for b in page["data"] + rest["data"]]
    assert created == sorted(created, reverse=True)
    assert_error(served.client.get("/v1/batches", params={"limit": 0}), 400, "limit")
    assert_error(served.client.get("/v1/batches", params={"limit": "x"}), 400, "limit")
    assert_error(served.client.get("/v1/batches", params={"order": "asc"}), 400, "order")
    assert_error(served.client.get("/v1/batches", params={"after": "batch_nope"}), 404, "after")


def test_cancel_stops_the_job(served: Harness) -> None:
    b = create(served).json()
    r = served.client.post(f"/v1/batches/{b['id']}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled" and r.json()["cancelling_at"] is not None
    assert served.jobs.stopped[-1] == f"{b['id']}-1"
    served.jobs.status[f"{b['id']}-1"] = "SUCCEEDED"
    assert_error(served.client.post(f"/v1/batches/{b['id']}/cancel"), 400)


def test_without_the_jobs_api_batches_are_503(served: Harness) -> None:
    b = create(served).json()
    file_id = upload(served, jsonl(CHAT)).json()["id"]
    before = len(served.ingress.batches.store.batches())
    served.jobs.down = True
    try:
        for r in (create(served), served.client.get(f"/v1/batches/{b['id']}"),
                  served.client.get("/v1/batches"),
                  served.client.post(f"/v1/batches/{b['id']}/cancel")):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable"
        assert create(served, input_file_id=file_id).status_code == 503
        # No batch without a job to run it.
        assert len(served.ingress.batches.store.batches()) == before
    finally:
        served.jobs.down = False


def test_the_routes_need_the_key(keyed: Harness) -> None:
    assert_error(keyed.client.get("/v1/batches"), 401)
    assert_error(upload(keyed, b"{}"), 401)
    auth = {"authorization": f"Bearer {API_KEY}"}
    assert keyed.client.get("/v1/batches", headers=auth).status_code == 200


# Ingress.batch_request --------------------------------------------------------


def batch_request(h: Harness, url: str, body: Any) -> dict[str, Any]:
    return asyncio.run(h.ingress.batch_request(url, body))


def test_batch_request_runs_the_route_offline(served: Harness) -> None:
    for url, body in (("/v1/chat/completions", {**CHAT, "job_class": "online"}),
                      ("/v1/completions", {"prompt": "hi", "max_tokens": 4})):
        out = batch_request(served, url, body)
        assert out["status_code"] == 200, out
        assert out["request_id"] == out["body"]["id"]
        assert served.engine.requests[-1].job_class == "offline"
        http = served.client.post(url, json=body).json()
        # The same response as over HTTP, but for its ids and times.
        for key in ("id", "created", "metrics"):
            http.pop(key), out["body"].pop(key)
        assert out["body"] == http


BAD_BODIES = [
    {**CHAT, "max_tokens": -1}, {**CHAT, "temperature": "hot"}, {**CHAT, "tools": [{}]},
    {**CHAT, "max_token": 5}, {**CHAT, "model": "gpt-4"}, {"messages": []},
    {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
    {**CHAT, "max_tokens": 10**6}, {**CHAT, "stream_options": {"include_usage": True}},
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_batch_request_refuses_what_the_route_refuses(served: Harness, body: dict) -> None:
    out = batch_request(served, "/v1/chat/completions", body)
    # ASCII-escaped, as a lone surrogate cannot be sent as UTF-8.
    http = served.client.post("/v1/chat/completions", content=json.dumps(body),
                              headers={"content-type": "application/json"})
    assert 400 <= out["status_code"] < 500
    assert (out["status_code"], out["body"]) == (http.status_code, http.json())


@pytest.mark.parametrize("url, body, status, param", [
    ("/v1/chat/completions", {**CHAT, "stream": True}, 400, "stream"),
    ("/v1/embeddings", CHAT, 404, "url"),
    ("/v1/chat/completions", ["not", "an", "object"], 400, "body"),
])
def test_batch_request_refusals_are_answers_not_exceptions(
        served: Harness, url: str, body: Any, status: int, param: str) -> None:
    out = batch_request(served, url, body)
    assert out["status_code"] == status and out["body"]["error"]["param"] == param
    assert out["body"]["error"]["code"] == status


def test_batch_request_at_capacity_is_a_429_to_retry(refusing: Harness) -> None:
    out = batch_request(refusing, "/v1/chat/completions", CHAT)
    assert out["status_code"] == 429 and out["body"]["error"]["type"] == "rate_limit_error"
