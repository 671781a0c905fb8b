"""CPU seconds of a running Serve application's processes, read from /proc.

Shared by the studies that ask where the host's CPU goes beside the engine
(studies/conserve_live/offline_burst.py, studies/burst/path_cpu.py).
"""

from __future__ import annotations

import os

# Process titles Ray gives the Serve processes, and the names they are
# reported under.
PROCESSES = {"ray::ProxyActor": "http_proxy", "ServeReplica:llm:Ingress": "ingress",
             "ServeReplica:llm:Scheduler": "scheduler", "ServeReplica:llm:Engine": "engine",
             "ServeReplica:llm:Predictor": "predictor", "ray::ServeController": "controller"}


def serve_processes() -> dict[str, str]:
    """pid -> the name of each Serve process now running."""
    out: dict[str, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        for mark, name in PROCESSES.items():
            if mark in title:
                out[pid] = name
    return out


def cpu_s(processes: dict[str, str] | None = None) -> dict[str, float]:
    """User + system CPU seconds of each process by name (summed over the
    processes of one name: a deployment's replicas); every Serve process
    when `processes` (pid -> name) is not given."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, name in (serve_processes() if processes is None else processes).items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process took from `a` to `b`."""
    return {k: round(b[k] - a.get(k, 0.0), 2) for k in sorted(b)}
