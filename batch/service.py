"""What `preempt-serve batch` and the `/v1/files` and `/v1/batches` routes
do: create a batch from an input file and start its Ray Job, report it,
resume it, cancel it; delete files, and sweep the expired ones.
Synchronous (files and the Jobs API's HTTP calls); the routes run it in a
thread.

A file a running batch reads or writes (its input, output or error file)
is not deleted: a delete is refused, an expired one waits for the batch to
end.  A deleted results file leaves its tally in the batch's record, so
the batch still reports its counts and usage; a batch that lost its input
or a results file cannot be resumed (a new run would send lines whose
results are gone again).
"""

from __future__ import annotations

import time
from pathlib import Path

from api.batch import BatchObject, BatchOutputLine
from batch.jobs import TERMINAL, Jobs, JobView, entrypoint
from batch.journal import read_results
from batch.lines import first_endpoint
from batch.state import batch_object, batch_usage
from batch.store import BatchRecord, BatchStore, FileRecord, ResultsTally


class BatchConflict(ValueError):
    """The batch is not in a state that allows the operation."""


class Batches:
    def __init__(self, store: BatchStore, jobs: Jobs) -> None:
        self.store = store
        self.jobs = jobs

    def create(self, input_file: FileRecord, endpoint: str | None, app: str,
               max_concurrency: int, metadata: dict[str, str] | None = None,
               model: str | None = None,
               output_expires_after_s: int | None = None,
               window_s: int | None = None) -> BatchRecord:
        """A new batch of `input_file`'s lines, its first run submitted.
        `endpoint` None: the url of the file's first well-formed line."""
        # Before anything is written: no batch without a job to run it.
        self.jobs.check()
        if endpoint is None:
            endpoint = first_endpoint(self.store.content_path(input_file).read_bytes())
        record = self.store.create_batch(input_file, endpoint, app, max_concurrency,
                                         metadata=metadata, model=model,
                                         output_expires_after_s=output_expires_after_s,
                                         window_s=window_s)
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
        if record.expired_at is not None:
            raise BatchConflict(f"batch {record.id} has expired: its completion window ended; "
                                "submit the lines without a result as a new batch")
        if self.store.file(record.input_file_id) is None:
            raise BatchConflict(f"batch {record.id} cannot be resumed: its input file "
                                f"{record.input_file_id} was deleted or has expired")
        if record.deleted_results:
            kinds = " and ".join(sorted(record.deleted_results))
            raise BatchConflict(f"batch {record.id} cannot be resumed: its {kinds} file was "
                                "deleted or has expired, so a new run would send the lines "
                                "whose results it held again")
        record.cancel_requested_at = None
        if max_concurrency is not None:
            record.max_concurrency = max_concurrency
        return self._submit(record)

    def cancel(self, record: BatchRecord) -> BatchRecord:
        """Stop the batch's run; what it wrote stays (a resume continues)."""
        if record.expired_at is not None:
            raise BatchConflict(f"batch {record.id} has expired; there is nothing to cancel")
        job = self.latest_job(record)
        if job is not None and job.status == "SUCCEEDED":
            raise BatchConflict(f"batch {record.id} has completed; there is nothing to cancel")
        if job is not None and job.status not in TERMINAL:
            self.jobs.stop(job.submission_id)
        if record.cancel_requested_at is None:
            record.cancel_requested_at = int(time.time())
            self.store.save_batch(record)
        return record

    def delete(self, record: BatchRecord, with_input: bool = False) -> None:
        """Delete an ended batch: its results files and record, and its
        input file where `with_input` (a Message Batch's own); a running
        one is refused (cancel it first)."""
        job = self.latest_job(record)
        if job is not None and job.status not in TERMINAL:
            raise BatchConflict(f"batch {record.id} has not ended (Ray Job {job.submission_id} "
                                f"is {job.status}); cancel it first")
        ids = [record.output_file_id, record.error_file_id]
        if with_input:
            ids.append(record.input_file_id)
        for file_id in ids:
            file = self.store.file(file_id, expired=True) if file_id else None
            if file is not None:
                self.store.delete_file(file)
        self.store.delete_batch(record)

    # Files ----------------------------------------------------------------

    def delete_file(self, file: FileRecord) -> None:
        """Delete `file`; `BatchConflict` while a batch that uses it runs."""
        self._delete([file], refuse=True)

    def sweep(self, now: float | None = None) -> int:
        """Delete the expired files no running batch uses; how many.  The
        batches and their jobs are read once for them all."""
        now = time.time() if now is None else now
        expired = [f for f in self.store.files(expired=True) if f.expired(now)]
        return self._delete(expired, refuse=False) if expired else 0

    def _delete(self, files: list[FileRecord], refuse: bool) -> int:
        ids = {f.id for f in files}
        users: dict[str, list[BatchRecord]] = {}
        for b in self.store.batches():
            for file_id in {b.input_file_id, b.output_file_id, b.error_file_id} & ids:
                users.setdefault(file_id, []).append(b)
        jobs = self.jobs.infos() if users else {}
        gone = 0
        for file in files:
            running = [(b, job) for b in users.get(file.id, [])
                       if (job := jobs.get(b.jobs[-1]) if b.jobs else None) is not None
                       and job.status not in TERMINAL]
            if running:
                if not refuse:
                    continue  # in use: swept once its batch has ended
                b, job = running[0]
                raise BatchConflict(
                    f"file {file.id} is the {_role(b, file.id)} file of batch {b.id}, whose "
                    f"Ray Job {job.submission_id} is {job.status}; cancel the batch or let "
                    "it end first")
            for b in users.get(file.id, []):
                if file.id != b.input_file_id:
                    kind = "output" if file.id == b.output_file_id else "errors"
                    b.deleted_results[kind] = _tally(
                        read_results(self.store.content_path(file)))
                    self.store.save_batch(b)
            self.store.delete_file(file)
            gone += 1
        return gone

    # Batches --------------------------------------------------------------

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


def _role(record: BatchRecord, file_id: str) -> str:
    if file_id == record.input_file_id:
        return "input"
    return "output" if file_id == record.output_file_id else "error"


def _tally(lines: list[BatchOutputLine]) -> ResultsTally:
    usage = batch_usage(lines)
    return ResultsTally(lines=len(lines), input_tokens=usage.input_tokens if usage else 0,
                        output_tokens=usage.output_tokens if usage else 0)
