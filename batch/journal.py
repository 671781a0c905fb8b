"""A batch's output and error files, written so that a batch can resume.

Each result is one line, written with a single `write` on a file opened
for appending and synced before the next request's result, so a job that
is stopped or killed leaves at most its last line cut short.  Resuming
reads both files, cuts such a partial line off, and skips every input line
whose result is already there:

- a request the server answered (output file, or error file with a
  `response`) by its `custom_id`, which names one line only
  (batch/lines.py);
- a line refused before sending (error file, `error.line`) by its line
  number, since it may have no usable `custom_id`.

So a line's result is written once, however often the batch resumes.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from pydantic import ValidationError

from api.batch import BatchOutputLine, BatchResponse
from batch.lines import Item, Rejected, Request

log = logging.getLogger(__name__)


def complete_bytes(path: Path) -> bytes:
    """The file's complete lines (a line still being written left out);
    empty if it does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    return data[:data.rfind(b"\n") + 1]


def complete_size(path: Path, step: int = 1 << 16) -> int:
    """`len(complete_bytes(path))`, reading only the file's tail: where its
    last newline ends (0 if it does not exist)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - step)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
        return 0


def read_results(path: Path) -> list[BatchOutputLine]:
    """The records of a results file's complete lines; a line that is not
    a record (edited by hand) is skipped with a warning."""
    records = []
    for number, raw in enumerate(complete_bytes(path).splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            records.append(BatchOutputLine.model_validate_json(raw))
        except ValidationError:
            log.warning("%s:%d is not a batch result; ignored", path, number)
    return records


class ResultFile:
    """One append-only JSONL file of results, owned by one writer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def recover(self) -> list[BatchOutputLine]:
        """Cut a partial last line off (a writer stopped mid-line) and
        return the records before it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = len(complete_bytes(self.path))
        if self.path.exists() and self.path.stat().st_size > keep:
            log.warning("%s: dropping a partial last line (%d bytes)", self.path,
                        self.path.stat().st_size - keep)
            os.truncate(self.path, keep)
        return read_results(self.path)

    def append(self, record: BatchOutputLine) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = (json.dumps(record.model_dump(mode="json"), ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:  # one call on a regular file; the loop is for the odd short write
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Journal:
    """What a batch has done so far, and the writer of the rest."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output = ResultFile(output)
        self.errors = ResultFile(errors)
        self.done_ids: set[str] = set()
        self.done_lines: set[int] = set()
        self.completed = 0
        self.failed = 0

    def open(self) -> None:
        """Read what earlier runs wrote (cutting partial lines off)."""
        for record in self.output.recover():
            self._count(record, failed=False)
        for record in self.errors.recover():
            self._count(record, failed=True)

    def _count(self, record: BatchOutputLine, failed: bool) -> None:
        if record.response is not None and record.custom_id is not None:
            self.done_ids.add(record.custom_id)
        elif record.error is not None and record.error.line is not None:
            self.done_lines.add(record.error.line)
        if failed:
            self.failed += 1
        else:
            self.completed += 1

    def is_done(self, item: Item) -> bool:
        if isinstance(item, Request):
            return item.custom_id in self.done_ids
        return item.line in self.done_lines

    def record_response(self, request: Request, response: BatchResponse) -> bool:
        """Write the server's answer: the output file for a 200, the error
        file otherwise.  Returns whether it succeeded."""
        ok = response.status_code == 200
        record = BatchOutputLine(id=_result_id(), custom_id=request.custom_id,
                                 response=response, error=None)
        (self.output if ok else self.errors).append(record)
        self._count(record, failed=not ok)
        return ok

    def record_rejected(self, item: Rejected) -> None:
        record = BatchOutputLine(id=_result_id(), custom_id=item.custom_id, response=None,
                                 error=item.error)
        self.errors.append(record)
        self._count(record, failed=True)

    def close(self) -> None:
        self.output.close()
        self.errors.close()


def _result_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
