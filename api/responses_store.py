"""Stored responses: what `previous_response_id`, `GET /v1/responses/{id}`,
its input items and `DELETE` read (`responses.storage_dir`).

    <response id>.json      one StoredResponse
    <response id>.alive     touched while a background response runs
    <response id>.cancel    a cancellation asked of a background response
                            (on whichever replica the request landed)
    <response id>.events    a streamed background response's events, one
                            JSON line each, appended as they happen (what
                            a client that reconnects reads again)

A record holds the Response object as it was answered, the conversation
it continued (the inputs and outputs of the responses before it in its
chain, so a follow-up reads one file however long the chain, and still
finds its context after an earlier response of the chain is deleted) and
its own input items.  Every Ingress replica reads and writes the same
directory, so a follow-up may land on any of them; on a multi-node cluster
it must be a filesystem every node mounts at this path.  Records are
replaced whole (written aside, then renamed), so a reader never sees half
of one.  Ids are checked against their pattern before they touch a path.
Records older than `retention_hours` are gone (read as missing, and swept),
and beyond `max_stored` the oldest are swept first, with any file a writer
that died left aside.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from api.atomic_write import write_atomically
from api.record_files import read_unexpired, store_dir

_ID = re.compile(r"resp_[0-9a-f]{32}")
# A sweep lists the directory: one in this many writes of a process.
_SWEEP_EVERY = 256
# A file written aside this long ago was never renamed: its writer died.
_ABANDONED_S = 3600.0


class StoredResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The Response object, as `POST /v1/responses` answered it.
    response: dict[str, Any]
    # The conversation before this request's input: the chain's inputs and
    # outputs, oldest first.
    context: list[dict[str, Any]]
    # This request's own input items, each with its id.
    input_items: list[dict[str, Any]]
    # Run in the background (`background: true`): polled, cancellable.
    background: bool = False

    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up continues: the context, this input, this output."""
        return [*self.context, *self.input_items, *self.response["output"]]


class ResponseStore:
    def __init__(self, root: Path, retention_s: float, max_stored: int) -> None:
        self.root = store_dir(root)
        self.retention_s = retention_s
        self.max_stored = max_stored
        self._writes = 0

    def put(self, record: StoredResponse) -> None:
        path = self._path(record.response["id"])
        if path is None:
            raise ValueError(f"not a response id: {record.response['id']!r}")
        write_atomically(path, record.model_dump_json())
        self._writes += 1
        if self._writes % _SWEEP_EVERY == 0:
            self.sweep()

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None: no such id, deleted, expired, or unreadable."""
        path = self._path(response_id)
        return None if path is None else read_unexpired(path, StoredResponse, self.retention_s)

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        if path is None:
            return False
        self.clear_marks(response_id)
        self._path(response_id, ".events").unlink(missing_ok=True)  # type: ignore[union-attr]
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    # A streamed background response's events -------------------------------

    def log_events(self, response_id: str, events: list[dict[str, Any]]) -> None:
        """Append `events` (one write: a reader sees whole lines or none of
        this call's but the last, which it leaves until it is whole)."""
        path = self._path(response_id, ".events")
        assert path is not None
        if events:
            with open(path, "a") as f:
                f.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in events))

    def has_events(self, response_id: str) -> bool:
        path = self._path(response_id, ".events")
        return path is not None and path.exists()

    def read_events(self, response_id: str, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The whole event lines from byte `offset` on, and the offset after
        them."""
        path = self._path(response_id, ".events")
        if path is None:
            return [], offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        whole = data[:data.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines()], offset + len(whole)

    # A background response's marks ---------------------------------------

    def touch(self, response_id: str) -> None:
        """The replica running `response_id` is alive."""
        path = self._path(response_id, ".alive")
        assert path is not None
        path.touch()

    def silent_for(self, response_id: str) -> float:
        """Seconds since the runner last touched it (or since the record
        was written, where it never did)."""
        for suffix in (".alive", ".json"):
            path = self._path(response_id, suffix)
            try:
                return time.time() - path.stat().st_mtime if path else float("inf")
            except FileNotFoundError:
                continue
        return float("inf")

    def ask_cancel(self, response_id: str) -> None:
        path = self._path(response_id, ".cancel")
        assert path is not None
        path.touch()

    def cancel_asked(self, response_id: str) -> bool:
        path = self._path(response_id, ".cancel")
        return path is not None and path.exists()

    def clear_marks(self, response_id: str) -> None:
        for suffix in (".alive", ".cancel"):
            path = self._path(response_id, suffix)
            if path is not None:
                path.unlink(missing_ok=True)

    def sweep(self) -> int:
        """Remove expired records, then the oldest beyond `max_stored`;
        how many went."""
        now = time.time()
        kept: list[tuple[float, Path]] = []
        gone = 0
        for path in self.root.glob("resp_*.json"):
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:  # another replica swept it
                continue
            if now - mtime > self.retention_s:
                self.delete(path.stem)
                gone += 1
            else:
                kept.append((mtime, path))
        for path in self.root.glob(".resp_*"):  # a write cut short before its rename
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime > _ABANDONED_S:
                    path.unlink(missing_ok=True)
        kept.sort()
        for _, path in kept[:max(0, len(kept) - self.max_stored)]:
            self.delete(path.stem)
            gone += 1
        return gone

    def _path(self, response_id: str, suffix: str = ".json") -> Path | None:
        if not _ID.fullmatch(response_id):
            return None
        return self.root / f"{response_id}{suffix}"
