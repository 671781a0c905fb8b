"""Where batch files and records live: one directory (`batch.storage_dir`).

    files/<file id>.json            the file's record (FileRecord)
    files/<file id>.jsonl           an uploaded file's content
    batches/<batch id>/batch.json   the batch's record (BatchRecord)
    batches/<batch id>/output.jsonl and errors.jsonl
                                    its results (batch/journal.py); their
                                    file records point here

Ids are checked against their pattern before they touch a path, so no id a
client sends reaches outside the directory.  Records are replaced whole
(written aside, then renamed), so a reader never sees half of one.  A file
past its `expires_at` reads as absent; deleting it (and whether it may be
deleted) is batch/service.py's.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.atomic_write import write_atomically
from api.batch import FileObject
from batch.journal import complete_size
from batch.lines import count_lines

_FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


class TooLarge(ValueError):
    """An upload over the size limit."""


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    created_at: int
    # Orders files made within one second (listings are by creation).
    created_ns: int = 0
    filename: str
    purpose: Literal["batch", "batch_output"]
    # The content, relative to the storage directory.
    path: str
    # An upload's size; results files are measured when asked.
    bytes: int | None = None
    # Unix time after which the file is gone (OpenAI's `expires_after`).
    expires_at: int | None = None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class ResultsTally(BaseModel):
    """What a deleted results file held, so that its batch still reports
    its counts and usage."""

    model_config = ConfigDict(extra="forbid")

    lines: int
    input_tokens: int = 0
    output_tokens: int = 0


class BatchRecord(BaseModel):
    """What a batch was created with, and the Ray Jobs that ran it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    created_at: int
    endpoint: str
    input_file_id: str
    output_file_id: str
    error_file_id: str
    completion_window: str = "24h"
    # When the window ends (`batch.completion_window_hours`), and when a
    # run found it ended and expired what was left.
    expires_at: int | None = None
    expired_at: int | None = None
    # The Serve application its requests go to, and its served model.
    app: str
    model: str | None = None
    max_concurrency: int = Field(..., ge=1)
    metadata: dict[str, str] | None = None
    # Non-blank lines of the input file.
    total: int
    # Ray Job submission ids, oldest first; the last one is the batch's.
    jobs: list[str] = Field(default_factory=list)
    cancel_requested_at: int | None = None
    # Results files deleted (or expired): "output" / "errors" -> their tally.
    deleted_results: dict[Literal["output", "errors"], ResultsTally] = Field(
        default_factory=dict)


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    # Files ----------------------------------------------------------------

    def _files(self) -> Path:
        d = self.root / "files"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def add_file(self, source: BinaryIO, filename: str, max_bytes: int,
                 expires_after_s: int | None = None) -> FileRecord:
        """Store an upload (purpose `batch`), copied in chunks; `TooLarge`
        past `max_bytes`, leaving nothing behind.  `expires_after_s`: its
        lifetime from now (None: kept until deleted)."""
        file_id = f"file-{uuid.uuid4().hex}"
        content = self._files() / f"{file_id}.jsonl"
        size = 0
        try:
            with open(content, "xb") as out:
                while chunk := source.read(1 << 20):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(f"the file exceeds the limit of {max_bytes} bytes")
                    out.write(chunk)
        except BaseException:
            content.unlink(missing_ok=True)
            raise
        now_ns = time.time_ns()
        now = now_ns // 10**9
        record = FileRecord(id=file_id, created_at=now, created_ns=now_ns, filename=filename,
                            purpose="batch", path=str(content.relative_to(self.root)),
                            bytes=size, expires_at=_after(now, expires_after_s))
        self._save_file(record)
        return record

    def _save_file(self, record: FileRecord) -> None:
        write_atomically(self._files() / f"{record.id}.json", record.model_dump_json())

    def file(self, file_id: str, expired: bool = False) -> FileRecord | None:
        """The file's record; None for an unknown id, and for an expired
        file unless `expired`."""
        if not _FILE_ID.fullmatch(file_id):
            return None
        try:
            record = FileRecord.model_validate_json(
                (self.root / "files" / f"{file_id}.json").read_bytes())
        except FileNotFoundError:
            return None
        return record if expired or not record.expired(time.time()) else None

    def files(self, expired: bool = False) -> list[FileRecord]:
        """Every file (with the expired ones if `expired`), oldest first."""
        d = self.root / "files"
        names = [p.stem for p in d.glob("file-*.json")] if d.is_dir() else []
        found = [self.file(n, expired) for n in names]
        return sorted((f for f in found if f is not None),
                      key=lambda f: (f.created_at, f.created_ns, f.id))

    def delete_file(self, record: FileRecord) -> None:
        """The record first: a file whose content outlived a crash here is
        unreachable, never a record without its content."""
        (self.root / "files" / f"{record.id}.json").unlink(missing_ok=True)
        self.content_path(record).unlink(missing_ok=True)

    def content_path(self, record: FileRecord) -> Path:
        return self.root / record.path

    def content_size(self, record: FileRecord) -> int:
        """Bytes of the content a reader gets: an upload's size, a results
        file's complete lines."""
        if record.bytes is not None:
            return record.bytes
        return complete_size(self.content_path(record))

    def file_object(self, record: FileRecord) -> FileObject:
        return FileObject(id=record.id, bytes=self.content_size(record),
                          created_at=record.created_at, filename=record.filename,
                          purpose=record.purpose, expires_at=record.expires_at)

    # Batches --------------------------------------------------------------

    def batch_dir(self, batch_id: str) -> Path:
        return self.root / "batches" / batch_id

    def output_path(self, record: BatchRecord) -> Path:
        return self.batch_dir(record.id) / "output.jsonl"

    def errors_path(self, record: BatchRecord) -> Path:
        return self.batch_dir(record.id) / "errors.jsonl"

    def create_batch(self, input_file: FileRecord, endpoint: str, app: str,
                     max_concurrency: int, metadata: dict[str, str] | None = None,
                     model: str | None = None,
                     output_expires_after_s: int | None = None,
                     window_s: int | None = None) -> BatchRecord:
        batch_id = f"batch_{uuid.uuid4().hex}"
        d = self.batch_dir(batch_id)
        d.mkdir(parents=True)
        now_ns = time.time_ns()
        now = now_ns // 10**9
        outputs = {}
        for name, kind in (("output.jsonl", "output"), ("errors.jsonl", "errors")):
            now_ns += 1  # the error file listed after the output file
            rec = FileRecord(id=f"file-{uuid.uuid4().hex}", created_at=now, created_ns=now_ns,
                             filename=f"{batch_id}_{kind}.jsonl", purpose="batch_output",
                             path=str((d / name).relative_to(self.root)),
                             expires_at=_after(now, output_expires_after_s))
            self._save_file(rec)
            outputs[kind] = rec.id
        record = BatchRecord(
            id=batch_id, created_at=now, endpoint=endpoint, input_file_id=input_file.id,
            output_file_id=outputs["output"], error_file_id=outputs["errors"], app=app,
            model=model, max_concurrency=max_concurrency, metadata=metadata,
            expires_at=_after(now, window_s),
            total=count_lines(self.content_path(input_file).read_bytes()))
        self.save_batch(record)
        return record

    def save_batch(self, record: BatchRecord) -> None:
        write_atomically(self.batch_dir(record.id) / "batch.json", record.model_dump_json())

    def delete_batch(self, record: BatchRecord) -> None:
        """Remove the batch's record and folder (its results files' records
        are the caller's to delete first)."""
        shutil.rmtree(self.batch_dir(record.id), ignore_errors=True)

    def batch(self, batch_id: str) -> BatchRecord | None:
        if not _BATCH_ID.fullmatch(batch_id):
            return None
        try:
            return BatchRecord.model_validate_json(
                (self.batch_dir(batch_id) / "batch.json").read_bytes())
        except FileNotFoundError:
            return None

    def batches(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        root = self.root / "batches"
        found = [self.batch(d.name) for d in root.iterdir()] if root.is_dir() else []
        return sorted((b for b in found if b is not None),
                      key=lambda b: (b.created_at, b.id), reverse=True)

    def copy_input(self, path: Path, max_bytes: int,
                   expires_after_s: int | None = None) -> FileRecord:
        """Store a local file as an upload (`preempt-serve batch submit`)."""
        with open(path, "rb") as f:
            return self.add_file(f, path.name, max_bytes, expires_after_s)


def _after(now: int, seconds: int | None) -> int | None:
    return None if seconds is None else now + seconds

