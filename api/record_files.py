"""Records kept one file each (stored responses, conversations, chat
completions) in a directory every Ingress replica reads and writes.

`locked`: a lock per record, `<id>.lock` beside `<id>.json`, held (flock)
by a writer from its read of the record to its rename, so two changes at
once both land and a delete never races a change into bringing the record
back.  `read_unexpired`: a record within its retention, counted from its
file's time."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock file `path` (made if missing) for the block."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def delete_record(path: Path) -> bool:
    """Delete the record at `path` under its lock (`<id>.lock`, then
    removed); whether it was there."""
    lock = path.with_suffix(".lock")
    if not path.exists():  # no lock file for an unknown id
        return False
    with locked(lock):
        try:
            path.unlink()
        except FileNotFoundError:
            return False
    lock.unlink(missing_ok=True)
    return True


def read_unexpired(path: Path, model: type[M], retention_s: float) -> M | None:
    """The record at `path`, or None: missing, unreadable, or older than
    `retention_s` (then deleted)."""
    try:
        if time.time() - path.stat().st_mtime > retention_s:
            path.unlink(missing_ok=True)
            return None
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def store_dir(root: Path) -> Path:
    """`root`, made if missing; a ValueError naming the setting where it
    cannot be (at start, so a bad path fails the deployment plainly)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"responses.storage_dir: cannot use {str(root)!r}: {e}") from None
    return root
