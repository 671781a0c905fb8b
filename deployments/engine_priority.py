"""The engine replica's CPU scheduling priority (`engine_nice`, Linux).

A CPU engine is pinned to its cores (deployments/engine_pinning.py), but the
node's other processes are not: on a 2-core machine the HTTP proxy, the
ingress and a benchmark client took turns on the engine's core, and its loop
thread, busy 40 s of a 51 s ShareGPT run, waited 9.7 s more to be given the
core back (its `schedstat`: 36,772 involuntary switches against 826 waits of
its own).  At nice -10 for the loop's thread alone it waited 1.1 s, but the
replica's threads that deliver its tokens, on the same core at 0, starved
(median inter-token latency 420-470 ms against 80); with every thread of
the replica at -10 it waited 4.8 s and the server served 1.15-1.16x the
tokens/s, median inter-token latency 66-68 ms against 83
(studies/engine_cpu/vllm_cpu/README.md, "The engine replica ahead of the
node's other processes").  Lowering a nice value needs CAP_SYS_NICE or an
RLIMIT_NICE that allows it; "auto" asks, does without, and asks only where
the replica is pinned to a part of the node's cores (the rest left to the
proxy and the ingress).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Literal

log = logging.getLogger("ray.serve")

# What "auto" asks for: well ahead of processes at the default 0, short of
# the range (-20) that an operator may keep for the system's own.
AUTO_NICE = -10


def _allowed(nice: int) -> OSError | None:
    """None where this thread may take `nice`, else the OS's refusal.  A
    value at or above the thread's own is always allowed (and not tried: an
    unprivileged thread could not come back down); a lower one is taken and
    given back (going up again is always allowed)."""
    if not hasattr(os, "setpriority"):
        return OSError("no setpriority on this platform")
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    if nice >= before:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        return e
    os.setpriority(os.PRIO_PROCESS, tid, before)
    return None


def _cores_left() -> bool:
    """Whether this process is pinned to fewer cores than the node has."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    return len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)


def loop_nice(setting: int | Literal["auto"] | None) -> int | None:
    """The nice value the engine replica's threads are to take (None: leave them).
    An explicit value the OS refuses stops the replica with the field named;
    "auto" falls back to leaving it, with a line in the log."""
    if setting is None:
        return None
    if setting == "auto" and not _cores_left():
        # Unpinned (or on every core): ahead of the proxy and the ingress
        # everywhere, the replica could leave them too little to serve.
        log.info("engine_nice auto: the engine replica is not pinned to a part of the node's "
                 "cores; its nice value stays as it is")
        return None
    wanted = AUTO_NICE if setting == "auto" else setting
    refused = _allowed(wanted)
    if refused is None:
        return wanted
    if setting == "auto":
        log.info("engine_nice auto: the engine replica stays at its nice value (%s)", refused)
        return None
    raise ValueError(f"engine_nice: {setting} is not allowed here ({refused}); "
                     "it needs CAP_SYS_NICE or a matching RLIMIT_NICE, or set null")


def give_nice(nice: int | None) -> None:
    """Give every thread of this replica's process the value `loop_nice`
    allowed, the engine loop's and the ones that deliver its tokens alike
    (pinned to the same cores, they share them as before; a thread's nice
    value is its own on Linux, and threads started later inherit their
    creator's)."""
    if nice is None:
        return
    try:
        tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:  # no /proc: the process (who 0), where POSIX gives it one value
        tids = [0]
    refused = 0
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError:
            refused += 1
    if refused:
        log.warning("engine replica: nice %d refused for %d of its threads", nice, refused)
    log.info("engine replica's threads running at nice %d", nice)
