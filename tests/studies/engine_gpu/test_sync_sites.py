"""`studies.engine_gpu.sync_sites`: synchronization warnings counted by the
innermost frame of the repository's code and by thread; other warnings
shown as before."""

from __future__ import annotations

import threading
import traceback
import warnings
from pathlib import Path

from studies.engine_gpu.sync_sites import MESSAGE, SyncSites

ROOT = Path(__file__).resolve().parents[3]


def _waits_here() -> None:
    warnings.warn(MESSAGE, UserWarning)  # as torch's TORCH_WARN reaches Python


def test_counts_each_site_and_thread_and_passes_other_warnings_on() -> None:
    sites = SyncSites(ROOT)
    sites.start()
    try:
        for _ in range(3):
            _waits_here()
        worker = threading.Thread(target=_waits_here, name="loop")
        worker.start()
        worker.join()
        shown: list[str] = []
        sites._shown = lambda message, *rest: shown.append(str(message))
        warnings.warn("something else", UserWarning)
        assert shown == ["something else"]
    finally:
        sites.stop()
    summary = sites.summary()
    assert summary["total"] == 4
    here = f"tests/studies/engine_gpu/test_sync_sites.py:{_waits_here.__code__.co_firstlineno + 1}"
    assert {(s["site"], s["thread"], s["count"]) for s in summary["by_site"]} == {
        (f"{here} _waits_here", "MainThread", 3), (f"{here} _waits_here", "loop", 1)}
    assert warnings.showwarning is not sites._show


def test_a_stack_without_repository_frames_counts_as_outside() -> None:
    sites = SyncSites(ROOT / "no_such_folder")
    assert sites.record(MESSAGE, traceback.extract_stack())
    assert not sites.record("another warning", traceback.extract_stack())
    assert sites.summary()["by_site"][0]["site"] == "outside the repository"
