"""The engine loop thread's nice value (`engine_nice`, deployments/engine_priority.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.config import AppConfig
from deployments import engine_priority
from deployments.engine_priority import AUTO_NICE, loop_nice

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no setpriority here")


def _refuse_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
    """An OS without CAP_SYS_NICE: a nice value below the current one is refused."""
    real = os.setpriority

    def setpriority(which: int, who: int, value: int) -> None:
        if value < os.getpriority(which, who):
            raise PermissionError(1, "Operation not permitted")
        real(which, who, value)

    monkeypatch.setattr(engine_priority.os, "setpriority", setpriority)


def test_the_setting_is_validated() -> None:
    assert AppConfig().engine_nice == "auto"
    assert AppConfig(engine_nice=None).engine_nice is None
    assert AppConfig(engine_nice=-5).engine_nice == -5
    for bad in (-21, 20, "high"):
        with pytest.raises(ValidationError, match="engine_nice"):
            AppConfig(engine_nice=bad)


def _pinned(monkeypatch: pytest.MonkeyPatch, cores: set[int], of: int) -> None:
    monkeypatch.setattr(engine_priority.os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(engine_priority.os, "cpu_count", lambda: of)


def test_auto_only_for_a_replica_pinned_to_part_of_the_node(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(engine_priority.os, "setpriority",
                        lambda which, who, value: taken.append(value))
    _pinned(monkeypatch, {0, 1}, 2)
    assert loop_nice("auto") is None and taken == []
    # An explicit value applies wherever the replica runs.
    assert loop_nice(-4) == -4


def test_auto_takes_what_the_os_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    _pinned(monkeypatch, {0}, 2)
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    assert loop_nice(None) is None
    _refuse_lowering(monkeypatch)
    # Refused: auto leaves the thread as it is; an explicit value stops the
    # start with the field named.
    assert loop_nice("auto") is None
    with pytest.raises(ValueError, match="engine_nice: -3 is not allowed"):
        loop_nice(-3)
    # A value at or above the current one is always allowed, and the check
    # leaves the calling thread as it was.
    assert loop_nice(before + 1) == before + 1
    assert os.getpriority(os.PRIO_PROCESS, tid) == before


def test_auto_asks_for_minus_ten_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(engine_priority.os, "setpriority",
                        lambda which, who, value: taken.append(value))
    _pinned(monkeypatch, {1}, 4)
    assert loop_nice("auto") == AUTO_NICE == -10
    assert taken[0] == AUTO_NICE


def test_every_thread_of_the_replica_gets_the_value() -> None:
    # In a process of its own: a nice value raised cannot come back down
    # without privilege, and this one's threads should not keep it.
    code = """
import os, threading
from deployments.engine_priority import give_nice
def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)
go, ready, seen = threading.Event(), threading.Event(), []
def loop():
    ready.set(); go.wait(5); seen.append(nice(threading.get_native_id()))
    later = threading.Thread(target=lambda: seen.append(nice(threading.get_native_id())))
    later.start(); later.join(5)
base = nice(threading.get_native_id())
t = threading.Thread(target=loop); t.start(); ready.wait(5)
give_nice(None)
assert nice(t.native_id) == base
give_nice(base + 3)
go.set(); t.join(5)
print(base, nice(threading.get_native_id()), *seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    base, main, loop, later = map(int, out.stdout.split())
    # The calling thread, the loop's, and a thread the loop starts afterwards.
    assert main == loop == later == base + 3
