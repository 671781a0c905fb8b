"""Anthropic's Message Batches (`/v1/messages/batches`,
batch/message_batch_routes.py) on the real ingress app without Ray: the
batch's lines are run here by the job's own runner, sent to
`Ingress.batch_request` as the Ray Job sends them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from api.batch import BatchResponse
from batch.journal import Journal
from batch.lines import parse_batch
from batch.runner import run_batch
from tests.api.harness import Harness, harness

anthropic = pytest.importorskip("anthropic")

PARAMS = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    with harness(max_model_len=1024) as h:
        yield h


@pytest.fixture
def client(h: Harness) -> Any:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                               http_client=h.client)


def run_job(h: Harness, batch_id: str, status: str = "SUCCEEDED") -> None:
    """What the batch's Ray Job does, in process; then its job's status."""
    store = h.ingress.batches.store
    record = store.batch(batch_id)
    assert record is not None
    items = parse_batch(store.content_path(store.file(record.input_file_id)).read_bytes(),
                        record.endpoint)
    journal = Journal(store.output_path(record), store.errors_path(record))
    journal.open()

    async def send(url: str, body: dict[str, Any]) -> BatchResponse:
        return BatchResponse.model_validate(await h.ingress.batch_request(url, body))

    try:
        asyncio.run(run_batch(items, journal, send, max_concurrency=4))
    finally:
        journal.close()
    h.jobs.status[record.jobs[-1]] = status


def test_a_message_batch_runs_its_requests_offline_and_returns_their_results(
        client: Any, h: Harness) -> None:
    h.engine.state.answer = "Hello."
    try:
        batch = client.messages.batches.create(requests=[
            {"custom_id": "a", "params": PARAMS},
            {"custom_id": "b", "params": {**PARAMS, "max_tokens": 0}},  # refused when run
            {"custom_id": "c", "params": {**PARAMS, "stop_sequences": ["."]}}])
        assert batch.type == "message_batch" and batch.processing_status == "in_progress"
        assert batch.request_counts.processing == 3 and batch.results_url is None
        # Not ended: no results yet (the client does not even ask).
        early = h.client.get(f"/v1/messages/batches/{batch.id}/results")
        assert early.status_code == 400 and "not ended" in early.json()["error"]["message"]
        run_job(h, batch.id)
    finally:
        h.engine.state.answer = None
    assert all(r.job_class == "offline" for r in h.engine.requests[-2:])
    done = client.messages.batches.retrieve(batch.id)
    assert done.processing_status == "ended" and done.ended_at is not None
    counts = done.request_counts
    assert (counts.succeeded, counts.errored, counts.processing, counts.canceled) == (2, 1, 0, 0)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["a"].type == "succeeded" and results["a"].message.content[0].text == "Hello."
    assert results["c"].message.stop_reason == "stop_sequence"
    assert results["c"].message.content[0].text == "Hello"
    assert results["b"].type == "errored"
    assert results["b"].error.error.type == "invalid_request_error"
    assert "max_tokens" in results["b"].error.error.message
    listed = [b.id for b in client.messages.batches.list(limit=10)]
    assert batch.id in listed
    record = h.ingress.batches.store.batch(batch.id)
    deleted = client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    store = h.ingress.batches.store
    assert all(store.file(f, expired=True) is None for f in (
        record.input_file_id, record.output_file_id, record.error_file_id))
    assert not store.batch_dir(batch.id).exists()


def test_a_cancelled_batch_reports_its_unsent_requests_as_canceled(client: Any,
                                                                   h: Harness) -> None:
    batch = client.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": PARAMS} for i in range(3)])
    cancelling = client.messages.batches.cancel(batch.id)
    assert cancelling.cancel_initiated_at is not None
    assert h.jobs.stopped[-1] == f"{batch.id}-1"
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 3
    results = list(client.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == ["r0", "r1", "r2"]
    assert {r.result.type for r in results} == {"canceled"}


def test_refusals_have_anthropic_shape(client: Any, h: Harness) -> None:
    for body, words in (({"requests": []}, "requests"),
                        ({"requests": [{"custom_id": "bad id", "params": {}}]}, "custom_id"),
                        ({"requests": [{"custom_id": "x", "params": {}},
                                       {"custom_id": "x", "params": {}}]}, "more than one")):
        r = h.client.post("/v1/messages/batches", json=body)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and words in err["error"]["message"], err
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("batch_nope")
    running = client.messages.batches.create(requests=[{"custom_id": "x", "params": PARAMS}])
    with pytest.raises(anthropic.BadRequestError, match="cancel it first"):
        client.messages.batches.delete(running.id)
    # An OpenAI batch is not a Message Batch.
    line = {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "messages": [{"role": "user", "content": "x"}]}}
    f = h.client.post("/v1/files", data={"purpose": "batch"}, files={
        "file": ("in.jsonl", (json.dumps(line) + "\n").encode())}).json()
    openai_batch = h.client.post("/v1/batches", json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()
    assert h.client.get(f"/v1/messages/batches/{openai_batch['id']}").status_code == 404
    assert openai_batch["id"] not in [b.id for b in client.messages.batches.list()]
