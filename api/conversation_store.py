"""Stored conversations (`/v1/conversations`), beside the stored responses
(`responses.storage_dir`/conversations).

    conv_<hex>.json     one ConversationRecord: its metadata and items
    conv_<hex>.lock     held while a writer reads, changes and replaces it

Every Ingress replica reads and writes the same directory (on a multi-node
cluster, a filesystem every node mounts at this path).  A change (items
added by a Response or a client, an item deleted, metadata replaced) holds
the conversation's lock from its read to its rename, so two Responses
ending at once on one conversation both add their items; a reader never
sees half a record.  Conversations are kept until deleted (OpenAI's are not
subject to the responses' retention), so they are not swept.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from api.atomic_write import write_atomically
from api.record_files import delete_record, locked, store_dir
from api.responses_api import new_item_id

_ID = re.compile(r"conv_[0-9a-f]{48}")


class NoItem(LookupError):
    """No item of that id in the conversation."""


class ConversationRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    created_at: int
    metadata: dict[str, str]
    # Oldest first, each with its id.
    items: list[dict[str, Any]]

    def item(self, item_id: str) -> dict[str, Any] | None:
        return next((i for i in self.items if i["id"] == item_id), None)


class ConversationStore:
    def __init__(self, root: Path) -> None:
        self.root = store_dir(root)

    def create(self, metadata: dict[str, str], items: list[dict[str, Any]]
               ) -> ConversationRecord:
        record = ConversationRecord(id=f"conv_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}",
                                    created_at=int(time.time()), metadata=metadata, items=[])
        _add(record, items)
        self._write(record)
        return record

    def get(self, conv_id: str) -> ConversationRecord | None:
        """The record, or None: no such id, deleted, or unreadable."""
        path = self._path(conv_id)
        if path is None:
            return None
        try:
            return ConversationRecord.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            return None

    def add_items(self, conv_id: str, items: list[dict[str, Any]]
                  ) -> list[dict[str, Any]] | None:
        """Append `items` (an id already in the conversation is replaced by
        a new one); the items as added, or None where it is gone."""
        added: list[dict[str, Any]] = []
        found = self._change(conv_id, lambda r: added.extend(_add(r, items)))
        return None if found is None else added

    def delete_item(self, conv_id: str, item_id: str) -> ConversationRecord | None:
        """The record without the item; None: no such conversation;
        `NoItem`: no such item in it (nothing written)."""
        def drop(record: ConversationRecord) -> None:
            kept = [i for i in record.items if i["id"] != item_id]
            if len(kept) == len(record.items):
                raise NoItem(item_id)
            record.items = kept

        return self._change(conv_id, drop)

    def set_metadata(self, conv_id: str, metadata: dict[str, str]
                     ) -> ConversationRecord | None:
        return self._change(conv_id, lambda r: setattr(r, "metadata", metadata))

    def delete(self, conv_id: str) -> bool:
        path = self._path(conv_id)
        return path is not None and delete_record(path)

    # ------------------------------------------------------------------------

    def _change(self, conv_id: str, change: Callable[[ConversationRecord], Any]
                ) -> ConversationRecord | None:
        path = self._path(conv_id)
        if path is None or not path.exists():  # no lock file for an unknown id
            return None
        with self._locked(conv_id):
            record = self.get(conv_id)
            if record is None:
                return None
            change(record)
            self._write(record)
        return record

    def _locked(self, conv_id: str) -> contextlib.AbstractContextManager[None]:
        path = self._path(conv_id, ".lock")
        assert path is not None
        return locked(path)

    def _write(self, record: ConversationRecord) -> None:
        path = self._path(record.id)
        assert path is not None
        write_atomically(path, record.model_dump_json())

    def _path(self, conv_id: str, suffix: str = ".json") -> Path | None:
        if not _ID.fullmatch(conv_id):
            return None
        return self.root / f"{conv_id}{suffix}"


def _add(record: ConversationRecord, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    taken = {i["id"] for i in record.items}
    added = []
    for item in items:
        if item.get("id") in taken or "id" not in item:
            item = {**item, "id": new_item_id(item["type"])}
        taken.add(item["id"])
        added.append(item)
    record.items.extend(added)
    return added
