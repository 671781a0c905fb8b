"""Pinning the engine's process to CPU cores: every thread, those already
running and those started after, and a refusal naming cores this process
may not use."""

from __future__ import annotations

import os
import threading

import pytest

from engine.threads import pin_process

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def _threads_affinity() -> dict[int, set[int]]:
    out = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            out[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return out


def test_every_thread_is_pinned_and_new_ones_inherit() -> None:
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    stop = threading.Event()
    running = threading.Thread(target=stop.wait, daemon=True)
    running.start()
    try:
        assert pin_process([core]) == {core}
        seen = _threads_affinity()
        assert running.native_id in seen
        assert all(cpus == {core} for cpus in seen.values())
        later: list[set[int]] = []
        t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert later == [{core}]
    finally:
        stop.set()
        pin_process(sorted(allowed))
    assert all(cpus == allowed for cpus in _threads_affinity().values())


def test_refuses_cores_this_process_may_not_use() -> None:
    allowed = os.sched_getaffinity(0)
    before = _threads_affinity()
    absent = max(allowed) + 1000
    with pytest.raises(ValueError, match=rf"\[{absent}\] are not available"):
        pin_process([min(allowed), absent])
    with pytest.raises(ValueError, match="no CPU cores"):
        pin_process([])
    assert _threads_affinity() == before
