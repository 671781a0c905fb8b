"""The LoRA adapters loaded while the application runs
(`/v1/load_lora_adapter`), in one JSON file every Ingress replica reads
and writes: `adapters.json` under `lora_runtime.storage_dir`.

A change holds `adapters.lock` (flock) from its read of the file to the
rename of the new one, so two loads at once on two replicas both land.
Readers take the file as it is (a rename is atomic) and read it again only
when its inode, modification time or size changed, so naming an adapter
costs a `stat` per request; a file changed in the last seconds is read
every time, since two changes within a file time's granularity (a clock
tick) can leave the same stat (git's "racy" files).  The file outlives the application: adapters loaded at
runtime are served again after a restart until they are unloaded.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from api.atomic_write import write_atomically
from api.record_files import locked


class RuntimeAdapter(BaseModel):
    # The adapter's folder, resolved inside `lora_runtime.root`.
    path: str
    # When it was loaded (seconds): its KV cache salt, so that an adapter
    # unloaded and loaded again under its name from another folder never
    # reads the KV of the one before.
    loaded_at: float


_ENTRIES = TypeAdapter(dict[str, RuntimeAdapter])
# A file older than this is trusted to change its stat when it changes.
_SETTLED_S = 2.0


class LoraRegistry:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "adapters.json"
        self._lock = directory / "adapters.lock"
        self._seen: tuple[int, int, int] | None = None
        self._entries: dict[str, RuntimeAdapter] = {}

    def entries(self) -> dict[str, RuntimeAdapter]:
        """The adapters loaded now, by name (read again only if the file changed)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._entries = None, {}
            return self._entries
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._entries = self._read()
            settled = time.time() - st.st_mtime > _SETTLED_S
            self._seen = seen if settled else None
        return self._entries

    def add(self, name: str, path: str, replace: bool = False) -> RuntimeAdapter | None:
        """Record `name` as loaded from `path` now; None if a loaded adapter
        already has the name and not `replace` (nothing changes)."""
        with locked(self._lock):
            entries = self._read()
            if name in entries and not replace:
                return None
            entry = RuntimeAdapter(path=path, loaded_at=time.time())
            self._write({**entries, name: entry})
            return entry

    def remove(self, name: str) -> bool:
        """Forget `name`; whether it was loaded."""
        with locked(self._lock):
            entries = self._read()
            if entries.pop(name, None) is None:
                return False
            self._write(entries)
            return True

    def _read(self) -> dict[str, RuntimeAdapter]:
        try:
            return _ENTRIES.validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return {}

    def _write(self, entries: dict[str, RuntimeAdapter]) -> None:
        write_atomically(self.path, json.dumps(
            {k: v.model_dump() for k, v in entries.items()}, indent=1))
