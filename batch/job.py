"""A batch's Ray Job: `python -m batch.job --storage-dir DIR BATCH_ID`.

Sends each line without a result to the batch's Serve application through
a handle to its ingress (`Ingress.batch_request`: validated as the HTTP
route would, run as offline work), `max_concurrency` at a time, and writes
the results (batch/runner.py, batch/journal.py).  Progress shows as a tqdm
bar in the job's logs (`ray job logs`) and as counters in the Ray dashboard:
`batch_requests_done` (by batch and outcome), `batch_request_retries` and
the gauge `batch_requests_remaining`.

Exit status 0 once every line has a result (at the end of the batch's
completion window, the lines left are written as expired and the batch
marked so); 1 when requests stayed refused past the retry budget (resume
the batch to send them again); 2 for a batch that cannot run (unknown,
another run holds it, or its input file is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from api.batch import BatchResponse
from batch.journal import Journal
from batch.lines import parse_batch
from batch.runner import RetriesExhausted, run_batch
from batch.store import BatchStore

log = logging.getLogger("batch.job")


class JobProgress:
    """A tqdm bar on stderr (the job's log) and Ray metrics."""

    def __init__(self, batch_id: str) -> None:
        from ray.util.metrics import Counter, Gauge

        self.tags = {"batch_id": batch_id}
        self.done = Counter("batch_requests_done", "Batch lines with a result, by outcome",
                            tag_keys=("batch_id", "outcome"))
        self.retries = Counter("batch_request_retries",
                               "Requests of a batch retried after a 429/503 or a lost replica",
                               tag_keys=("batch_id",))
        self.remaining = Gauge("batch_requests_remaining", "Batch lines without a result yet",
                               tag_keys=("batch_id",))
        self.batch_id = batch_id
        self.bar: Any = None
        self.left = 0

    def start(self, total: int, done: int) -> None:
        from tqdm import tqdm

        # Not a terminal: redraw at most every few seconds, one line each.
        self.bar = tqdm(total=total, initial=done, desc=self.batch_id, unit="req",
                        file=sys.stderr, mininterval=2.0, ascii=True)
        self.left = total - done
        self.remaining.set(self.left, tags=self.tags)

    def finished(self, ok: bool) -> None:
        self.left -= 1
        self.bar.update(1)
        self.done.inc(1, tags={**self.tags, "outcome": "completed" if ok else "failed"})
        self.remaining.set(self.left, tags=self.tags)

    def retried(self) -> None:
        self.retries.inc(1, tags=self.tags)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def serve_sender(app: str) -> Any:
    """`send(url, body)` through a handle to the application's ingress."""
    from ray import serve

    handle = serve.get_app_handle(app)

    async def send(url: str, body: dict[str, Any]) -> BatchResponse:
        return BatchResponse.model_validate(await handle.batch_request.remote(url, body))

    return send


def run(storage_dir: Path, batch_id: str) -> int:
    store = BatchStore(storage_dir)
    record = store.batch(batch_id)
    if record is None:
        print(f"batch.job: no batch {batch_id!r} in {storage_dir}", file=sys.stderr)
        return 2
    lock = open(store.batch_dir(batch_id) / "lock", "w")
    try:
        # One writer per batch: a second run would write lines twice.
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"batch.job: another run of {batch_id} holds its files", file=sys.stderr)
        return 2
    input_file = store.file(record.input_file_id)
    if input_file is None:
        print(f"batch.job: the input file {record.input_file_id} is gone", file=sys.stderr)
        return 2
    items = parse_batch(store.content_path(input_file).read_bytes(), record.endpoint)
    journal = Journal(store.output_path(record), store.errors_path(record))
    journal.open()

    import ray

    ray.init(log_to_driver=False)
    progress = JobProgress(batch_id)
    try:
        summary = asyncio.run(run_batch(items, journal, serve_sender(record.app),
                                        max_concurrency=record.max_concurrency,
                                        progress=progress, expires_at=record.expires_at))
    except RetriesExhausted as e:
        print(f"batch.job: stopping: {e}; resume the batch to send the rest", file=sys.stderr)
        return 1
    finally:
        progress.close()
        journal.close()
    if summary.expired:
        mark_expired(store, batch_id)
        print(f"batch.job: {batch_id}: its completion window ended; {summary.expired} "
              "lines written as expired", flush=True)
    print(f"batch.job: {batch_id}: {summary.total} lines, {summary.skipped} done before, "
          f"{summary.completed} completed and {summary.failed} failed now, "
          f"{summary.retries} retries", flush=True)
    print(f"output: {store.output_path(record)}\nerrors: {store.errors_path(record)}",
          flush=True)
    return 0


def mark_expired(store: BatchStore, batch_id: str) -> None:
    """Record the expiry on the record as it is now (a cancel may have
    been written since the run read it)."""
    record = store.batch(batch_id)
    if record is not None and record.expired_at is None:
        record.expired_at = int(time.time())
        store.save_batch(record)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch.job", description=__doc__.split("\n")[0])
    p.add_argument("--storage-dir", required=True, type=Path)
    p.add_argument("batch_id")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run(args.storage_dir, args.batch_id)


if __name__ == "__main__":
    sys.exit(main())
