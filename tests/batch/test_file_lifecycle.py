"""Deleting and expiring batch files (batch/store.py, batch/service.py):
never under a running batch, the batch's counts kept, no resume without
its files."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from api.batch import BatchResponse
from batch.journal import Journal, complete_size
from batch.lines import Request
from batch.service import BatchConflict, Batches
from batch.store import BatchRecord, BatchStore
from tests.batch.fakes import FakeJobs

LINES = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": f"p{i}"}}) + "\n" for i in range(3)).encode()


@pytest.fixture
def batches(tmp_path: Path) -> Batches:
    return Batches(BatchStore(tmp_path), FakeJobs())


def jobs(batches: Batches) -> FakeJobs:
    return batches.jobs  # type: ignore[return-value]


def create(batches: Batches, output_expires_after_s: int | None = None) -> BatchRecord:
    f = batches.store.add_file(io.BytesIO(LINES), "in.jsonl", max_bytes=1 << 20)
    return batches.create(f, None, "llm", 2, output_expires_after_s=output_expires_after_s)


def answer(batches: Batches, record: BatchRecord, custom_id: str, status: int = 200) -> None:
    journal = Journal(*batches.result_paths(record))
    journal.open()
    journal.record_response(Request(1, custom_id, "/v1/completions", {}), BatchResponse(
        status_code=status, request_id="r",
        body={"usage": {"prompt_tokens": 4, "completion_tokens": 6}} if status == 200
        else {"error": {"message": "no"}}))
    journal.close()


def test_files_are_listed_oldest_first_and_deleted(batches: Batches) -> None:
    store = batches.store
    a = store.add_file(io.BytesIO(b"{}\n"), "a.jsonl", 1024)
    b = store.add_file(io.BytesIO(b"{}\n"), "b.jsonl", 1024)
    assert [f.id for f in store.files()][-2:] == [a.id, b.id]
    batches.delete_file(a)
    assert store.file(a.id) is None and not store.content_path(a).exists()
    assert [f.id for f in store.files()] == [b.id]


def test_a_file_a_running_batch_uses_is_not_deleted(batches: Batches) -> None:
    record = create(batches)
    answer(batches, record, "c0")
    for file_id, role in ((record.input_file_id, "input"), (record.output_file_id, "output"),
                          (record.error_file_id, "error")):
        f = batches.store.file(file_id)
        assert f is not None
        with pytest.raises(BatchConflict, match=f"the {role} file of batch {record.id}"):
            batches.delete_file(f)
        assert batches.store.file(file_id) == f
    assert batches.describe(record).request_counts.completed == 1


def test_a_deleted_results_file_leaves_the_counts_and_no_resume(batches: Batches) -> None:
    record = create(batches)
    answer(batches, record, "c0")
    answer(batches, record, "c1")
    answer(batches, record, "c2", status=400)
    jobs(batches).status[record.jobs[-1]] = "SUCCEEDED"
    before = batches.describe(record)
    assert before.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    for file_id in (record.output_file_id, record.error_file_id):
        f = batches.store.file(file_id)
        assert f is not None
        batches.delete_file(f)
        assert batches.store.file(file_id) is None
        assert not batches.store.content_path(f).exists()
    record = batches.store.batch(record.id)
    assert record is not None and set(record.deleted_results) == {"output", "errors"}
    after = batches.describe(record)
    assert after.request_counts == before.request_counts and after.usage == before.usage
    assert after.usage is not None and after.usage.total_tokens == 20
    assert (after.output_file_id, after.error_file_id) == (
        before.output_file_id, before.error_file_id)
    with pytest.raises(BatchConflict, match="errors and output file was deleted"):
        batches.resume(record)
    assert len(record.jobs) == 1


def test_a_batch_without_its_input_is_not_resumed(batches: Batches) -> None:
    record = create(batches)
    batches.cancel(record)
    f = batches.store.file(record.input_file_id)
    assert f is not None
    batches.delete_file(f)
    with pytest.raises(BatchConflict, match="input file .* was deleted or has expired"):
        batches.resume(record)


def test_expired_files_read_as_gone_and_are_swept_once_unused(batches: Batches) -> None:
    store = batches.store
    record = create(batches, output_expires_after_s=3600)
    answer(batches, record, "c0")
    loose = store.add_file(io.BytesIO(b"{}\n"), "x.jsonl", 1024, expires_after_s=3600)
    kept = store.add_file(io.BytesIO(b"{}\n"), "y.jsonl", 1024)
    out = store.file(record.output_file_id)
    assert out is not None and loose.expires_at is not None and out.expires_at is not None
    assert loose.expires_at - loose.created_at == 3600
    assert out.expires_at - record.created_at == 3600
    later = time.time() + 3601
    # The running batch keeps its results file; the loose upload goes.
    assert batches.sweep(now=later) == 1
    assert store.file(loose.id, expired=True) is None
    assert store.file(record.output_file_id, expired=True) is not None
    jobs(batches).status[record.jobs[-1]] = "SUCCEEDED"
    assert batches.sweep(now=later) == 2  # its output and error files
    assert store.file(record.output_file_id, expired=True) is None
    assert store.file(kept.id) is not None
    record = store.batch(record.id)
    assert record is not None
    assert batches.describe(record).request_counts.completed == 1


def test_an_expired_file_is_absent_before_it_is_swept(batches: Batches) -> None:
    store = batches.store
    f = store.add_file(io.BytesIO(b"{}\n"), "x.jsonl", 1024, expires_after_s=3600)
    store._save_file(f.model_copy(update={"expires_at": int(time.time()) - 1}))
    assert store.file(f.id) is None and f.id not in [g.id for g in store.files()]
    assert store.file(f.id, expired=True) is not None


@pytest.mark.parametrize("tail", [b"", b'{"partial'])
def test_complete_size_reads_the_tail_only(tmp_path: Path, tail: bytes) -> None:
    p = tmp_path / "r.jsonl"
    lines = b"".join(b'{"n": %d}\n' % i for i in range(5000))
    p.write_bytes(lines + tail)
    assert complete_size(p) == len(lines)
    assert complete_size(p, step=7) == len(lines)
    p.write_bytes(b"no newline yet")
    assert complete_size(p, step=4) == 0
    assert complete_size(tmp_path / "absent") == 0
