"""Pinning the engine's process to CPU cores: every thread, those already
running and those started after, and a refusal naming cores this process
may not use; the choice of the least busy cores for `engine_cpu_ids: auto`,
and what the Engine replica does with each setting."""

from __future__ import annotations

import os
import threading

import pytest

import engine.threads as threads_mod
from engine.threads import idlest_cores, pin_process

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


def test_the_side_thread_leaves_the_engine_its_core() -> None:
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    try:
        pin_process([core])
        pool = threads_mod.side_pool("side-test")
        cpus, nice = pool.submit(lambda: (
            os.sched_getaffinity(0),
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).result()
        pool.shutdown()
        # The calling thread keeps the engine's core and its priority.
        assert os.sched_getaffinity(0) == {core}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < nice
    finally:
        pin_process(sorted(allowed))
    others = set(range(os.cpu_count() or 1)) - {core}
    assert cpus == (others or {core}) or not others & allowed
    assert nice >= 10


def test_refuses_cores_this_process_may_not_use() -> None:
    allowed = os.sched_getaffinity(0)
    before = _threads_affinity()
    absent = max(allowed) + 1000
    with pytest.raises(ValueError, match=rf"\[{absent}\] are not available"):
        pin_process([min(allowed), absent])
    with pytest.raises(ValueError, match="no CPU cores"):
        pin_process([])
    # Every thread still running has the cores it had (threads that earlier
    # tests started may end meanwhile, and new ones inherit the process's).
    after = _threads_affinity()
    assert {t: after[t] for t in before.keys() & after.keys()} == {
        t: before[t] for t in before.keys() & after.keys()}
    assert all(cpus == allowed for t, cpus in after.items() if t not in before)


def _stat(per_core: dict[int, tuple[int, int]]) -> str:
    """A /proc/stat text: per core (busy, idle) jiffies (user, and idle)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{c} {b} 0 0 {i} 0 0 0 0 0 0" for c, (b, i) in sorted(per_core.items())]
    lines += ["intr 12345", "ctxt 999"]
    return "\n".join(lines) + "\n"


def _reader(first: dict[int, tuple[int, int]], second: dict[int, tuple[int, int]]):
    texts = iter([_stat(first), _stat(second)])
    return lambda: next(texts)


def test_idlest_cores_picks_the_least_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    before = {0: (100, 100), 1: (100, 100), 2: (100, 100), 3: (100, 100)}
    # Over the window: core 0 fully busy, core 1 idle, core 2 half, core 3 idle.
    after = {0: (200, 100), 1: (100, 200), 2: (150, 150), 3: (100, 200)}
    assert idlest_cores(1, 0.0, _reader(before, after)) == [1]  # ties to the lower id
    assert idlest_cores(2, 0.0, _reader(before, after)) == [1, 3]
    assert idlest_cores(3, 0.0, _reader(before, after)) == [1, 2, 3]
    # All idle: the lowest ids.
    assert idlest_cores(2, 0.0, _reader(before, before)) == [0, 1]
    # Busy shares within the same fifth are a tie: core 0 at 10 % stays first.
    slightly = {0: (110, 190), 1: (100, 200), 2: (100, 200), 3: (100, 200)}
    assert idlest_cores(1, 0.0, _reader(before, slightly)) == [0]


def test_idlest_cores_keeps_to_the_allowed_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5})
    before = {c: (100, 100) for c in range(6)}
    after = {**{c: (100, 200) for c in range(6)}, 2: (200, 100)}
    assert idlest_cores(1, 0.0, _reader(before, after)) == [3]
    assert idlest_cores(2, 0.0, _reader(before, after)) == [3, 5]


def test_idlest_cores_declines_where_there_is_no_choice(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    idle = {0: (1, 1), 1: (1, 1)}
    assert idlest_cores(2, 0.0, _reader(idle, idle)) is None
    assert idlest_cores(3, 0.0, _reader(idle, idle)) is None

    def unreadable() -> str:
        raise OSError("no /proc here")

    assert idlest_cores(1, 0.0, unreadable) is None
    assert idlest_cores(1, 0.0, _reader(idle, idle)) == [0]


def test_idlest_cores_reads_this_machine() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one core: nothing to choose")
    got = idlest_cores(1, 0.05)
    assert got is not None and len(got) == 1 and set(got) <= allowed


def test_engine_replica_pins_as_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from api.config import AppConfig
    from deployments.engine_pinning import pin_replica as _pin

    pinned: list[list[int]] = []
    monkeypatch.setattr(threads_mod, "pin_process",
                        lambda cores: pinned.append(list(cores)) or set(cores))
    monkeypatch.setattr(threads_mod, "idlest_cores", lambda count: [1] * count)
    _pin(AppConfig())
    _pin(AppConfig(engine_cpu_ids=[0]))
    _pin(AppConfig(engine_cpu_ids=None))
    _pin(AppConfig(num_engine_replicas=2))  # auto: several replicas stay unpinned
    assert pinned == [[1], [0]]

    def refuse(cores: object) -> set[int]:
        raise ValueError("CPU cores [0] are not available to this process")

    monkeypatch.setattr(threads_mod, "pin_process", refuse)
    _pin(AppConfig())  # auto: a warning, not a failure
    with pytest.raises(ValueError, match="engine_cpu_ids: CPU cores"):
        _pin(AppConfig(engine_cpu_ids=[0]))
