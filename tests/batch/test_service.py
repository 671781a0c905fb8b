"""Batch records, their Batch objects and their runs (batch/store.py,
batch/state.py, batch/service.py), with a fake Ray Jobs API."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from api.batch import BatchError, BatchResponse
from batch.journal import Journal
from batch.lines import Rejected, Request
from batch.service import BatchConflict, Batches
from batch.store import BatchStore, TooLarge
from tests.batch.fakes import FakeJobs

LINES = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                     "body": {"prompt": f"p{i}"}}) for i in range(4)]


@pytest.fixture
def batches(tmp_path: Path) -> Batches:
    return Batches(BatchStore(tmp_path), FakeJobs())


def create(batches: Batches, data: bytes | None = None, endpoint: str | None = None):
    data = data if data is not None else ("\n".join(LINES) + "\n\n").encode()
    f = batches.store.add_file(io.BytesIO(data), "in.jsonl", max_bytes=1 << 20)
    return batches.create(f, endpoint, "llm", 3, metadata={"k": "v"}, model="smollm2")


def test_a_batch_is_recorded_and_its_first_run_submitted(batches: Batches) -> None:
    record = create(batches)
    jobs: FakeJobs = batches.jobs  # type: ignore[assignment]
    assert record.total == 4 and record.endpoint == "/v1/completions"
    assert record.jobs == [f"{record.id}-1"]
    ((sid, entrypoint, meta),) = jobs.submitted
    assert sid == f"{record.id}-1"
    assert entrypoint == f"python -m batch.job --storage-dir {batches.store.root} {record.id}"
    assert meta == {"preempt_serve_batch": record.id, "app": "llm"}
    # Persisted: another process (the job, the CLI) reads the same record.
    assert BatchStore(batches.store.root).batch(record.id) == record


def test_the_batch_object_follows_the_job_and_the_files(batches: Batches) -> None:
    record = create(batches)
    jobs: FakeJobs = batches.jobs  # type: ignore[assignment]
    obj = batches.describe(record)
    assert obj.status == "in_progress" and obj.in_progress_at == 1000
    assert obj.request_counts.model_dump() == {"total": 4, "completed": 0, "failed": 0}
    assert obj.output_file_id is None and obj.error_file_id is None and obj.usage is None
    journal = Journal(*batches.result_paths(record))
    journal.open()
    journal.record_response(Request(1, "c0", "/v1/completions", {}), BatchResponse(
        status_code=200, request_id="r", body={"usage": {"prompt_tokens": 3,
                                                         "completion_tokens": 5}}))
    journal.record_rejected(Rejected(2, None, BatchError(code="invalid_json", message="m",
                                                          line=2)))
    journal.close()
    obj = batches.describe(record)
    assert obj.request_counts.model_dump() == {"total": 4, "completed": 1, "failed": 1}
    assert (obj.output_file_id, obj.error_file_id) == (record.output_file_id,
                                                       record.error_file_id)
    assert (obj.usage.input_tokens, obj.usage.output_tokens, obj.usage.total_tokens) == (3, 5, 8)
    for status, expected in (("PENDING", "validating"), ("SUCCEEDED", "completed"),
                             ("STOPPED", "cancelled"), ("FAILED", "failed")):
        jobs.status[record.jobs[-1]] = status
        obj = batches.describe(record)
        assert obj.status == expected, status
    assert obj.failed_at == 2000 and obj.errors.data[0].code == "job_failed"
    assert obj.errors.data[0].message == "job message"
    # The results files are the batch's output files.
    out = batches.store.file(record.output_file_id)
    assert out is not None and out.purpose == "batch_output"
    assert batches.store.content_path(out) == batches.result_paths(record)[0]
    assert batches.store.file_object(out).bytes == batches.result_paths(record)[0].stat().st_size


def test_without_a_known_job_the_files_decide(batches: Batches) -> None:
    record = create(batches)
    batches.jobs.status.clear()  # type: ignore[attr-defined]
    obj = batches.describe(record)
    assert obj.status == "failed" and obj.errors.data[0].code == "job_missing"


def test_cancel_stops_the_run_and_resume_starts_another(batches: Batches) -> None:
    record = create(batches)
    jobs: FakeJobs = batches.jobs  # type: ignore[assignment]
    with pytest.raises(BatchConflict, match="still running"):
        batches.resume(record)
    record = batches.cancel(record)
    assert jobs.stopped == [f"{record.id}-1"] and record.cancel_requested_at is not None
    obj = batches.describe(record)
    assert obj.status == "cancelled" and obj.cancelling_at == record.cancel_requested_at
    record = batches.resume(record, max_concurrency=7)
    assert record.jobs == [f"{record.id}-1", f"{record.id}-2"]
    assert record.cancel_requested_at is None and record.max_concurrency == 7
    assert batches.describe(record).status == "in_progress"
    jobs.status[record.jobs[-1]] = "SUCCEEDED"
    with pytest.raises(BatchConflict, match="completed"):
        batches.cancel(record)


def test_cancel_while_the_job_still_runs_is_cancelling(batches: Batches) -> None:
    record = create(batches)
    jobs: FakeJobs = batches.jobs  # type: ignore[assignment]
    jobs.stop = lambda sid: jobs.stopped.append(sid)  # type: ignore[method-assign]
    record = batches.cancel(record)
    assert batches.describe(record).status == "cancelling"


def test_an_endpoint_is_taken_from_the_first_line_unless_given(batches: Batches) -> None:
    chat = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                       "body": {}})
    assert create(batches, f"junk\n{chat}\n".encode()).endpoint == "/v1/chat/completions"
    assert create(batches, f"{chat}\n".encode(), "/v1/completions").endpoint == \
        "/v1/completions"


def test_ids_never_reach_outside_the_store(batches: Batches, tmp_path: Path) -> None:
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "file-../../secret", "batch_" + "0" * 31 + "/", ""):
        assert batches.store.file(bad) is None and batches.store.batch(bad) is None
    assert batches.store.batches() == []


def test_an_upload_over_the_limit_leaves_nothing(batches: Batches) -> None:
    with pytest.raises(TooLarge):
        batches.store.add_file(io.BytesIO(b"x" * 5000), "big.jsonl", max_bytes=4096)
    assert list((batches.store.root / "files").iterdir()) == []


def test_batches_are_listed_newest_first(batches: Batches) -> None:
    first, second = create(batches), create(batches)
    second.created_at += 10
    batches.store.save_batch(second)
    assert [b.id for b in batches.store.batches()] == [second.id, first.id]
    objs = batches.describe_all(batches.store.batches())
    assert [o.id for o in objs] == [second.id, first.id]


def test_a_run_that_cannot_be_submitted_is_not_recorded(batches: Batches) -> None:
    record = create(batches)
    jobs: FakeJobs = batches.jobs  # type: ignore[assignment]
    jobs.status[record.jobs[-1]] = "STOPPED"

    def refuse(*args: object) -> None:
        raise RuntimeError("the job server refused it")

    jobs.submit = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        batches.resume(record)
    assert batches.store.batch(record.id).jobs == [f"{record.id}-1"]


def test_a_batch_whose_window_ended_is_expired_and_not_resumed(batches: Batches) -> None:
    from batch.job import mark_expired

    data = ("\n".join(LINES) + "\n").encode()
    f = batches.store.add_file(io.BytesIO(data), "in.jsonl", max_bytes=1 << 20)
    record = batches.create(f, None, "llm", 3, window_s=24 * 3600)
    assert record.expires_at == record.created_at + 24 * 3600
    assert batches.describe(record).expires_at == record.expires_at
    mark_expired(batches.store, record.id)
    batches.jobs.status[record.jobs[-1]] = "SUCCEEDED"  # type: ignore[attr-defined]
    record = batches.store.batch(record.id)
    assert record is not None and record.expired_at is not None
    obj = batches.describe(record)
    assert (obj.status, obj.expired_at) == ("expired", record.expired_at)
    with pytest.raises(BatchConflict, match="has expired"):
        batches.resume(record)
    with pytest.raises(BatchConflict, match="has expired"):
        batches.cancel(record)
    unbounded = batches.create(f, None, "llm", 3)
    assert unbounded.expires_at is None
