"""The registry of runtime LoRA adapters (deployments/lora_registry.py):
changes from many writers at once all land, and readers see each change."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from deployments.lora_registry import LoraRegistry


def test_concurrent_loads_all_land_and_readers_see_every_change(tmp_path: Path) -> None:
    writers = [LoraRegistry(tmp_path) for _ in range(8)]
    reader = LoraRegistry(tmp_path)
    assert reader.entries() == {}
    threads = [threading.Thread(target=w.add, args=(f"a{i}", f"/x/{i}"))
               for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(reader.entries()) == [f"a{i}" for i in range(8)]
    assert writers[0].add("a3", "/y") is None  # taken
    replaced = writers[0].add("a3", "/y", replace=True)
    assert replaced is not None and reader.entries()["a3"] == replaced
    assert writers[1].remove("a3") and not writers[1].remove("a3")
    assert "a3" not in reader.entries()


def test_a_settled_file_is_read_again_only_when_it_changes(tmp_path: Path) -> None:
    reg = LoraRegistry(tmp_path)
    reg.add("a", "/x")
    old = reg.path.stat().st_mtime - 10
    os.utime(reg.path, (old, old))
    first = reg.entries()
    assert reg.entries() is first  # cached: same file, settled
    LoraRegistry(tmp_path).add("b", "/y")
    assert sorted(reg.entries()) == ["a", "b"]
