"""What `preempt-serve batch` and the `/v1/batches` routes do: create a
batch from an input file and start its Ray Job, report it, resume it,
cancel it.  Synchronous (files and the Jobs API's HTTP calls); the routes
run it in a thread.
"""

from __future__ import annotations

import time
from pathlib import Path

from api.batch import BatchObject
from batch.jobs import TERMINAL, Jobs, JobView, entrypoint
from batch.journal import read_results
from batch.lines import first_endpoint
from batch.state import batch_object
from batch.store import BatchRecord, BatchStore, FileRecord


class BatchConflict(ValueError):
    """The batch is not in a state that allows the operation."""


class Batches:
    def __init__(self, store: BatchStore, jobs: Jobs) -> None:
        self.store = store
        self.jobs = jobs

    def create(self, input_file: FileRecord, endpoint: str | None, app: str,
               max_concurrency: int, metadata: dict[str, str] | None = None,
               model: str | None = None) -> BatchRecord:
        """A new batch of `input_file`'s lines, its first run submitted.
        `endpoint` None: the url of the file's first well-formed line."""
        # Before anything is written: no batch without a job to run it.
        self.jobs.check()
        if endpoint is None:
            endpoint = first_endpoint(self.store.content_path(input_file).read_bytes())
        record = self.store.create_batch(input_file, endpoint, app, max_concurrency,
                                         metadata=metadata, model=model)
        return self._submit(record)

    def _submit(self, record: BatchRecord) -> BatchRecord:
        submission_id = f"{record.id}-{len(record.jobs) + 1}"
        # Recorded first: a job that starts must find itself in the record.
        record.jobs.append(submission_id)
        self.store.save_batch(record)
        try:
            self.jobs.submit(submission_id, entrypoint(self.store.root, record.id),
                             {"preempt_serve_batch": record.id, "app": record.app})
        except BaseException:
            record.jobs.pop()
            self.store.save_batch(record)
            raise
        return record

    def latest_job(self, record: BatchRecord) -> JobView | None:
        return self.jobs.info(record.jobs[-1]) if record.jobs else None

    def resume(self, record: BatchRecord, max_concurrency: int | None = None) -> BatchRecord:
        """A new run of a batch whose last run ended: it sends only the
        lines without a result."""
        job = self.latest_job(record)
        if job is not None and job.status not in TERMINAL:
            raise BatchConflict(f"batch {record.id} is still running (Ray Job "
                                f"{job.submission_id} is {job.status})")
        record.cancel_requested_at = None
        if max_concurrency is not None:
            record.max_concurrency = max_concurrency
        return self._submit(record)

    def cancel(self, record: BatchRecord) -> BatchRecord:
        """Stop the batch's run; what it wrote stays (a resume continues)."""
        job = self.latest_job(record)
        if job is not None and job.status == "SUCCEEDED":
            raise BatchConflict(f"batch {record.id} has completed; there is nothing to cancel")
        if job is not None and job.status not in TERMINAL:
            self.jobs.stop(job.submission_id)
        if record.cancel_requested_at is None:
            record.cancel_requested_at = int(time.time())
            self.store.save_batch(record)
        return record

    def describe(self, record: BatchRecord, job: JobView | None = None,
                 known: bool = False) -> BatchObject:
        """The Batch object; `known`: `job` is already looked up."""
        if not known:
            job = self.latest_job(record)
        return batch_object(record, read_results(self.store.output_path(record)),
                            read_results(self.store.errors_path(record)), job)

    def describe_all(self, records: list[BatchRecord]) -> list[BatchObject]:
        """Several batches with one look at the cluster's jobs."""
        jobs = self.jobs.infos() if records else {}
        return [self.describe(r, jobs.get(r.jobs[-1]) if r.jobs else None, known=True)
                for r in records]

    def result_paths(self, record: BatchRecord) -> tuple[Path, Path]:
        return self.store.output_path(record), self.store.errors_path(record)
