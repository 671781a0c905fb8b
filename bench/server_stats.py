"""KV state of a running server, and the check that it returns to idle.

What is read (`RayStatsSource`, through Ray Serve handles):

- every `Engine` replica's `stats()`: free / total KV blocks, open streams,
  running and waiting jobs, and the blocks it holds in the host tier
  (`swap.host_used_blocks`).  A handle call goes to one replica, so all
  replicas are reached with `DeploymentHandle.broadcast` (Ray >= 2.60); on
  an older Ray by repeated concurrent calls until every running replica
  (`serve.status()`) has answered, each answer naming its replica;
- the `Scheduler`'s `stats()`: its `kv_tier` entry, when the server has
  one, holds the host KV tier's directory figures (`used_bytes`).

The leak check (`wait_for_idle`): after a run, poll until every engine is
idle (nothing running, waiting or streaming) and its free blocks, its
host-tier blocks and the tier's used bytes are back to what they were
before the run; if that has not happened by the timeout, whatever still
differs is reported as leaked.  A stats source is any object with the
`StatsSource` methods, so the check runs against a fake in tests.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Callable, Protocol

from pydantic import BaseModel, ConfigDict, Field


class StatsSource(Protocol):
    def engines(self) -> list[dict[str, Any]]:
        """One `Engine.stats()` dict per engine replica."""
        ...

    def scheduler(self) -> dict[str, Any] | None:
        """`Scheduler.stats()`, or None when there is none."""
        ...


class EngineKV(BaseModel):
    model_config = ConfigDict(extra="forbid")

    free_blocks: int
    num_blocks: int
    open_streams: int = 0
    num_running: int = 0
    num_waiting: int = 0
    host_used_blocks: int | None = None

    @property
    def idle(self) -> bool:
        return self.open_streams == 0 and self.num_running == 0 and self.num_waiting == 0

    @classmethod
    def of(cls, stats: dict[str, Any]) -> "EngineKV":
        swap = stats.get("swap") or {}
        return cls(
            free_blocks=int(stats["free_blocks"]), num_blocks=int(stats["num_blocks"]),
            open_streams=int(stats.get("open_streams", 0)),
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
            host_used_blocks=(int(swap["host_used_blocks"])
                              if swap.get("host_used_blocks") is not None else None),
        )


class KVSnapshot(BaseModel):
    """The server's KV state at one moment (`t`: seconds on the run's clock)."""

    model_config = ConfigDict(extra="forbid")

    t: float = 0.0
    engines: dict[str, EngineKV] = Field(default_factory=dict)
    # The host tier's used bytes (Scheduler stats "kv_tier"); None when the
    # server does not report it.
    host_used_bytes: int | None = None
    # Requests the Scheduler deployment still holds as admitted ("active_jobs");
    # None when the server does not report it.
    scheduler_jobs: int | None = None

    @property
    def idle(self) -> bool:
        return all(e.idle for e in self.engines.values())

    @property
    def used_blocks(self) -> int:
        return sum(e.num_blocks - e.free_blocks for e in self.engines.values())

    @property
    def num_blocks(self) -> int:
        return sum(e.num_blocks for e in self.engines.values())

    @property
    def host_used_blocks(self) -> int | None:
        vals = [e.host_used_blocks for e in self.engines.values() if e.host_used_blocks is not None]
        return sum(vals) if vals else None

    @property
    def open_streams(self) -> int:
        return sum(e.open_streams for e in self.engines.values())


def read_snapshot(source: StatsSource, t: float = 0.0) -> KVSnapshot:
    engines = {str(s.get("replica", i)): EngineKV.of(s) for i, s in enumerate(source.engines())}
    sched = source.scheduler() or {}
    tier = sched.get("kv_tier")
    used = tier.get("used_bytes") if isinstance(tier, dict) else None
    jobs = sched.get("active_jobs")
    return KVSnapshot(t=t, engines=engines, host_used_bytes=int(used) if used is not None else None,
                      scheduler_jobs=int(jobs) if jobs is not None else None)


class LeakReport(BaseModel):
    """Before / after figures of the idle check and what did not return."""

    model_config = ConfigDict(extra="forbid")

    before: KVSnapshot
    after: KVSnapshot
    idle: bool
    waited_s: float
    timeout_s: float
    # Per replica: free blocks missing, host-tier blocks still held.
    leaked_blocks: dict[str, int] = Field(default_factory=dict)
    leaked_host_blocks: dict[str, int] = Field(default_factory=dict)
    leaked_host_bytes: int | None = None
    # Admitted requests the Scheduler never heard the end of.
    leaked_scheduler_jobs: int | None = None
    missing_replicas: list[str] = Field(default_factory=list)
    new_replicas: list[str] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(before: KVSnapshot, after: KVSnapshot, waited_s: float = 0.0,
            timeout_s: float = 0.0) -> LeakReport:
    """What differs between an idle snapshot and a later one."""
    rep = LeakReport(before=before, after=after, idle=after.idle, waited_s=waited_s,
                     timeout_s=timeout_s)
    for rid, b in before.engines.items():
        a = after.engines.get(rid)
        if a is None:
            rep.missing_replicas.append(rid)
            rep.problems.append(f"engine replica {rid} is gone")
            continue
        if not a.idle:
            rep.problems.append(f"{rid}: not idle ({a.num_running} running, {a.num_waiting} "
                                f"waiting, {a.open_streams} open streams)")
        if a.free_blocks < b.free_blocks:
            rep.leaked_blocks[rid] = b.free_blocks - a.free_blocks
            rep.problems.append(f"{rid}: {b.free_blocks - a.free_blocks} KV blocks not freed")
        held = (a.host_used_blocks or 0) - (b.host_used_blocks or 0)
        if held > 0:
            rep.leaked_host_blocks[rid] = held
            rep.problems.append(f"{rid}: {held} host-tier blocks still held")
    rep.new_replicas = sorted(set(after.engines) - set(before.engines))
    for rid in rep.new_replicas:
        if not after.engines[rid].idle:
            rep.problems.append(f"{rid} (new replica): not idle")
    if before.host_used_bytes is not None and after.host_used_bytes is not None:
        rep.leaked_host_bytes = max(after.host_used_bytes - before.host_used_bytes, 0)
        if rep.leaked_host_bytes:
            rep.problems.append(f"host KV tier: {rep.leaked_host_bytes} bytes still used")
    if before.scheduler_jobs is not None and after.scheduler_jobs is not None:
        rep.leaked_scheduler_jobs = max(after.scheduler_jobs - before.scheduler_jobs, 0)
        if rep.leaked_scheduler_jobs:
            rep.problems.append(f"scheduler: {rep.leaked_scheduler_jobs} admitted requests "
                                "never released")
    return rep


def wait_for_idle(
    source: StatsSource,
    before: KVSnapshot | None,
    timeout_s: float,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> LeakReport:
    """Poll until the server is idle and back to `before` (or just idle when
    `before` is None); the report of the last poll."""
    start = clock()
    while True:
        snap = read_snapshot(source)
        rep = compare(before if before is not None else snap, snap, clock() - start, timeout_s)
        if rep.ok or clock() - start >= timeout_s:
            return rep
        time.sleep(poll_s)


def idle_start(source: StatsSource | None, timeout_s: float, before_what: str) -> KVSnapshot | None:
    """The server's idle state a run's leak check compares against (None
    without a stats source); exits when the server does not go idle."""
    if source is None:
        return None
    start = wait_for_idle(source, None, timeout_s)
    if not start.ok:
        raise SystemExit(f"the server is not idle before the {before_what}: {start.problems}")
    return start.after


class RayStatsSource:
    """Stats of the Serve application `app` on the Ray cluster at `address`."""

    def __init__(self, app: str = "llm", address: str = "auto", timeout_s: float = 10.0) -> None:
        import ray
        from ray import serve

        # log_to_driver off: the replicas' logs would flood the bench output;
        # the handles' own router logs at INFO on the driver.
        ray.init(address=address, namespace="serve", logging_level="ERROR",
                 log_to_driver=False, ignore_reinit_error=True)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        self.app = app
        self.timeout_s = timeout_s
        self.engine = serve.get_deployment_handle("Engine", app_name=app)
        self.sched = serve.get_deployment_handle("Scheduler", app_name=app)

    def running_engines(self) -> int | None:
        from ray import serve

        try:
            dep = serve.status().applications[self.app].deployments["Engine"]
        except (KeyError, AttributeError):
            return None
        return int(dep.replica_states.get("RUNNING", 0))  # type: ignore[call-overload]

    def engines(self) -> list[dict[str, Any]]:
        if hasattr(self.engine, "broadcast"):
            return list(self.engine.broadcast("stats").results(timeout_s=self.timeout_s))
        expected = self.running_engines() or 1
        seen: dict[str, dict[str, Any]] = {}
        # Concurrent calls spread over replicas (the router counts each one
        # in flight as queued); a few rounds reach every replica.
        for _ in range(10):
            calls = [self.engine.stats.remote() for _ in range(2 * expected)]
            for c in calls:
                s = c.result(timeout_s=self.timeout_s)
                seen[str(s.get("replica"))] = s
            if len(seen) >= expected:
                break
        return list(seen.values())

    def scheduler(self) -> dict[str, Any] | None:
        try:
            return dict(self.sched.stats.remote().result(timeout_s=self.timeout_s))
        except Exception:  # noqa: BLE001 - an app without a scheduler has no tier figure
            return None


def add_stats_args(q: argparse.ArgumentParser) -> None:
    from bench.cli_profile import add_server_args

    add_server_args(q)
    q.add_argument("--no-server-stats", action="store_true",
                   help="do not read engine / KV stats (a server that is not ours): "
                        "no leak check")


def stats_source(a: argparse.Namespace) -> StatsSource | None:
    return None if a.no_server_stats else RayStatsSource(app=a.app, address=a.address)
