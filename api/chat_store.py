"""Stored chat completions (`store: true` on `/v1/chat/completions`), beside
the stored responses (`responses.storage_dir`/chat_completions).

    chatcmpl-<hex>.json     one StoredChatCompletion
    chatcmpl-<hex>.lock     held while its metadata is replaced or it is deleted

Every Ingress replica reads and writes the same directory (on a multi-node
cluster, a filesystem every node mounts at this path).  A record's file
time is the time it was stored and stays so when its metadata changes: the
listing orders by it without opening a file, and the retention counts from
it.  Records older than `retention_s` read as missing and are swept; beyond
`max_stored` the oldest go first.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from api.atomic_write import write_atomically
from api.record_files import delete_record, locked, read_unexpired, store_dir

_ID = re.compile(r"chatcmpl-[0-9a-f]{32}")
# A sweep lists the directory: one in this many writes of a process.
_SWEEP_EVERY = 256
# A file written aside (or a lock left) this long ago: its writer died.
_ABANDONED_S = 3600.0


class NoCursor(LookupError):
    """The `after` of a listing names no stored chat completion."""


class StoredChatCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The ChatCompletion object as answered, with the request's settings
    # and `metadata` (api/chat_store_api.py, `stored_object`).
    completion: dict[str, Any]
    # The request's messages in OpenAI's stored shape, each with its id.
    messages: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return str(self.completion["id"])


class ChatCompletionStore:
    def __init__(self, root: Path, retention_s: float, max_stored: int) -> None:
        self.root = store_dir(root)
        self.retention_s = retention_s
        self.max_stored = max_stored
        self._writes = 0

    def put(self, record: StoredChatCompletion) -> None:
        path = self._path(record.id)
        if path is None:
            raise ValueError(f"not a chat completion id: {record.id!r}")
        write_atomically(path, record.model_dump_json())
        # Finer than the filesystem's own clock tick: the listing's order.
        now_ns = time.time_ns()
        os.utime(path, ns=(now_ns, now_ns))
        self._writes += 1
        if self._writes % _SWEEP_EVERY == 0:
            self.sweep()

    def get(self, completion_id: str) -> StoredChatCompletion | None:
        """The record, or None: no such id, deleted, expired, or unreadable."""
        path = self._path(completion_id)
        return None if path is None else read_unexpired(path, StoredChatCompletion, self.retention_s)

    def set_metadata(self, completion_id: str, metadata: dict[str, str]
                     ) -> StoredChatCompletion | None:
        """The record with `metadata` in place of its own; None where it is gone."""
        path = self._path(completion_id)
        if path is None or not path.exists():  # no lock file for an unknown id
            return None
        with self._locked(completion_id):
            record = self.get(completion_id)
            if record is None:
                return None
            stored_ns = path.stat().st_mtime_ns
            record.completion["metadata"] = metadata
            write_atomically(path, record.model_dump_json())
            os.utime(path, ns=(stored_ns, stored_ns))  # its place in the listing
        return record

    def delete(self, completion_id: str) -> bool:
        path = self._path(completion_id)
        return path is not None and delete_record(path)

    def page(self, order: Literal["asc", "desc"], after: str | None, limit: int,
             keep: Callable[[StoredChatCompletion], bool]
             ) -> tuple[list[StoredChatCompletion], bool]:
        """Up to `limit` records that `keep` accepts, in the order they were
        stored (`desc`: newest first), from after the one `after` names;
        and whether more follow.  `NoCursor` where `after` names none.
        Records are read only until the page is full."""
        ids = [p.name[:-len(".json")] for _, p in self._listed()]
        if order == "desc":
            ids.reverse()
        start = 0
        if after is not None:
            if after not in ids:
                raise NoCursor(after)
            start = ids.index(after) + 1
        page: list[StoredChatCompletion] = []
        for record in self._records(ids[start:]):
            if keep(record):
                if len(page) == limit:
                    return page, True
                page.append(record)
        return page, False

    def sweep(self) -> int:
        """Remove expired records, then the oldest beyond `max_stored`, and
        what dead writers left; how many records went."""
        listed = self._listed(sweep=True)
        gone = 0
        for _, path in listed[:max(0, len(listed) - self.max_stored)]:
            gone += self.delete(path.name[:-len(".json")])
        now = time.time()
        for path in [*self.root.glob(".chatcmpl-*"), *self.root.glob("chatcmpl-*.lock")]:
            with contextlib.suppress(FileNotFoundError):
                if (now - path.stat().st_mtime > _ABANDONED_S
                        and not path.with_suffix(".json").exists()):
                    path.unlink(missing_ok=True)
        return gone

    # ------------------------------------------------------------------------

    def _listed(self, sweep: bool = False) -> list[tuple[int, Path]]:
        """(stored time in ns, path) of every record within its retention,
        oldest first; with `sweep`, the expired ones are deleted."""
        limit_ns = time.time_ns() - int(self.retention_s * 1e9)
        listed: list[tuple[int, Path]] = []
        for path in self.root.glob("chatcmpl-*.json"):
            try:
                stored_ns = path.stat().st_mtime_ns
            except FileNotFoundError:  # deleted meanwhile
                continue
            if stored_ns >= limit_ns:
                listed.append((stored_ns, path))
            elif sweep:
                self.delete(path.name[:-len(".json")])
        listed.sort()
        return listed

    def _records(self, ids: list[str]) -> Iterator[StoredChatCompletion]:
        for completion_id in ids:
            record = self.get(completion_id)
            if record is not None:  # deleted since it was listed
                yield record

    def _locked(self, completion_id: str) -> contextlib.AbstractContextManager[None]:
        path = self._path(completion_id, ".lock")
        assert path is not None
        return locked(path)

    def _path(self, completion_id: str, suffix: str = ".json") -> Path | None:
        if not _ID.fullmatch(completion_id):
            return None
        return self.root / f"{completion_id}{suffix}"
