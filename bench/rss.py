"""Resident memory of a server running on this machine, sampled over a run.

Which processes are the server:

- `--server-pid PID`: that process (e.g. `serve run`, which starts the Ray
  head node as its children) and all its descendants, looked up again at
  every sample since Ray starts and ends workers as it goes;
- otherwise: the Ray processes of the local session (the latest one,
  `/tmp/ray/session_latest`, or under `$RAY_TMPDIR`): those whose command line
  names its session folder (gcs_server, raylet, dashboard, monitors) and
  all their descendants (the workers the raylet spawned, titled `ray::…`).
  Without a session folder, every process that looks like Ray by name and
  command line, and the raylets' descendants.  This process and its
  children never count (a bench command connected to the cluster is a Ray
  driver itself).

The figure is the sum of the processes' RSS.  Memory shared between them
(the plasma object store, shared libraries) counts once per process that
maps it, so the sum overstates the machine's use; what matters for a leak
is its trend, which this keeps.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import psutil
from pydantic import BaseModel, ConfigDict, Field

MB = 1024 * 1024

# Ray's own processes: executable names, and what their command lines
# carry (workers rename themselves "ray::ClassName.method").
_RAY_NAMES = frozenset({"raylet", "gcs_server", "plasma_store"})
_RAY_CMDLINE_MARKS = (
    "ray::",
    "ray/_private/workers/default_worker.py",
    "ray/dashboard/",
    "ray-dashboard-",
    "ray/_private/log_monitor.py",
    "ray/_private/runtime_env/agent",
    "ray/autoscaler/_private/monitor.py",
)


def is_ray_process(name: str, cmdline: Iterable[str]) -> bool:
    """Does a process with this name and command line belong to Ray?"""
    if name in _RAY_NAMES:
        return True
    line = " ".join(cmdline)
    return any(m in line for m in _RAY_CMDLINE_MARKS) or line.startswith("raylet")


def _own_tree() -> set[int]:
    me = psutil.Process()
    try:
        return {me.pid, *(c.pid for c in me.children(recursive=True))}
    except psutil.Error:
        return {me.pid}


def ray_temp_dir() -> Path:
    """Where Ray keeps its sessions: `$RAY_TMPDIR/ray`, else `$TMPDIR/ray`,
    else /tmp/ray (as Ray itself decides on Linux)."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / "ray"


def latest_session() -> str | None:
    """Name of the local Ray session folder (session_2024-…), if any."""
    link = ray_temp_dir() / "session_latest"
    try:
        return link.resolve(strict=True).name
    except OSError:
        return None


def server_processes(server_pid: int | None = None,
                     session: str | None = None) -> list[psutil.Process]:
    """The processes whose memory counts as the server's (module docstring);
    `session` defaults to `latest_session()`."""
    if server_pid is not None:
        root = psutil.Process(server_pid)
        try:
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return [root]
    session = session or latest_session()
    own = _own_tree()
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.pid in own or p.pid in found:
            continue
        try:
            name, cmd = p.info["name"] or "", p.info["cmdline"] or []
            if session is not None:
                root = any(session in arg for arg in cmd)
            else:
                root = is_ray_process(name, cmd)
            if not root:
                continue
            found[p.pid] = p
            if session is not None or name == "raylet":
                for c in p.children(recursive=True):
                    if c.pid not in own:
                        found.setdefault(c.pid, c)
        except psutil.Error:
            continue
    return list(found.values())


def total_rss(procs: Iterable[psutil.Process]) -> tuple[int, int]:
    """Summed RSS in bytes and how many of the processes were still there."""
    total = n = 0
    for p in procs:
        try:
            total += p.memory_info().rss
            n += 1
        except psutil.Error:  # ended since it was listed, or not ours to read
            continue
    return total, n


class RssSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    t: float  # seconds since the sampler started
    rss_mb: float
    num_procs: int


class RssSeries(BaseModel):
    """The samples of one run and what they say."""

    model_config = ConfigDict(extra="forbid")

    source: str  # "pid 1234 and descendants" or "ray processes of the local session"
    interval_s: float
    samples: list[RssSample] = Field(default_factory=list)

    @property
    def start_mb(self) -> float | None:
        return self.samples[0].rss_mb if self.samples else None

    @property
    def peak_mb(self) -> float | None:
        return max(s.rss_mb for s in self.samples) if self.samples else None

    @property
    def end_mb(self) -> float | None:
        return self.samples[-1].rss_mb if self.samples else None

    def after(self, t: float) -> list[RssSample]:
        return [s for s in self.samples if s.t >= t]

    def slope_mb_per_hour(self, since: float = 0.0) -> float | None:
        """Least-squares slope of RSS over time from `since` on (MB/hour);
        None with fewer than 3 samples or no time span."""
        pts = self.after(since)
        if len(pts) < 3:
            return None
        t = np.array([s.t for s in pts])
        if float(t.max() - t.min()) <= 0:
            return None
        y = np.array([s.rss_mb for s in pts])
        return float(np.polyfit(t, y, 1)[0] * 3600.0)


class RssStats(BaseModel):
    """Start, peak and end of a series (MB), as results report them."""

    model_config = ConfigDict(extra="forbid")

    source: str
    num_samples: int
    start_mb: float | None
    peak_mb: float | None
    end_mb: float | None

    @classmethod
    def of(cls, series: RssSeries) -> "RssStats":
        return cls(source=series.source, num_samples=len(series.samples),
                   start_mb=series.start_mb, peak_mb=series.peak_mb, end_mb=series.end_mb)


class PeriodicSampler:
    """Calls `probe(t)` every `interval` seconds on a background thread
    (t: seconds since start), once at start and once at stop; a probe that
    raises is skipped, the thread goes on."""

    def __init__(self, probe: Callable[[float], None], interval: float) -> None:
        self.probe = probe
        self.interval = interval
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-sampler")
        self._t0 = 0.0

    def _sample(self) -> None:
        try:
            self.probe(time.perf_counter() - self._t0)
        except Exception:  # noqa: BLE001 - a missed sample is not a failed run
            self.errors += 1

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            self._sample()
            next_at += self.interval
            self._stop.wait(max(next_at - time.perf_counter(), 0.0))

    def start(self) -> "PeriodicSampler":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def __enter__(self) -> "PeriodicSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RssSampler:
    """Samples the server's summed RSS every `interval` seconds."""

    def __init__(self, server_pid: int | None = None, interval: float = 1.0) -> None:
        self.server_pid = server_pid
        source = (f"pid {server_pid} and descendants" if server_pid is not None
                  else "ray processes of the local session")
        self.series = RssSeries(source=source, interval_s=interval)
        self._lock = threading.Lock()
        self._sampler = PeriodicSampler(self._probe, interval)

    def _probe(self, t: float) -> None:
        rss, n = total_rss(server_processes(self.server_pid))
        with self._lock:
            self.series.samples.append(RssSample(t=t, rss_mb=rss / MB, num_procs=n))

    def snapshot(self) -> RssSeries:
        with self._lock:
            return self.series.model_copy(deep=True)

    def __enter__(self) -> "RssSampler":
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sampler.stop()


def check_pid(pid: int | None) -> None:
    """Fail early, before any load is sent, on a pid that is not running."""
    if pid is not None and not psutil.pid_exists(pid):
        raise SystemExit(f"--server-pid {pid}: no such process")

