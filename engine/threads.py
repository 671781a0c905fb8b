"""Thread pinning for CPU execution.

With two busy processes on two cores, OpenMP threads that outnumber the cores
slow every matmul down 10 to 25×, so a replica pins its intra-op pool to
the CPUs it was given.  Ray already sets OMP_NUM_THREADS=1 for a 1-CPU
actor; this makes the choice explicit and visible in one place.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


def pin_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count; returns the count in effect.

    `None` leaves torch's default (OMP_NUM_THREADS or the core count).
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
        try:
            # Inter-op parallelism only matters for graph executors; one
            # thread keeps it from competing with the intra-op pool.  Torch
            # allows this call once, before any inter-op work has started.
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
    return torch.get_num_threads()


def pin_process(cpus: Sequence[int]) -> set[int]:
    """Pin every thread of this process, and the threads it starts later, to
    the CPU cores `cpus` (Linux); returns the set in effect.

    Ray places a replica on a node's CPUs as a count, not as cores, so its
    process shares every core with the node's other processes (the HTTP
    proxy, the ingress, a benchmark client): on a 2-core machine our engine's
    forward passes ran 10 % slower in some runs than in others, and pinned to
    one core (`engine_cpu_ids: [0]`) the same bf16 server served 1.06–1.19×
    its unpinned tokens/s (`studies/engine_cpu/vllm_cpu/README.md`)."""
    wanted = set(cpus)
    if not wanted:
        raise ValueError("no CPU cores to pin to")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pinning to CPU cores needs Linux (os.sched_setaffinity)")
    cores = os.cpu_count() or 1
    missing = sorted(c for c in wanted if c >= cores)
    if missing:
        raise ValueError(f"CPU cores {missing} are not available to this process "
                         f"(this machine has cores 0 to {cores - 1})")
    # sched_setaffinity(0) pins the calling thread only: every thread of the
    # process is pinned by its id, and threads started later inherit it.  The
    # calling thread first: the kernel refuses a set outside the process's
    # cpuset (a container's), before any thread has moved.
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as e:
        raise ValueError(f"CPU cores {sorted(wanted)} are not available to this process "
                         f"({e.strerror})") from None
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return os.sched_getaffinity(0)


def _beside(engine: frozenset[int]) -> None:
    """Move the calling thread off the engine's cores, where others exist,
    and below its priority (Linux; a thread's own nice value)."""
    others = set(range(os.cpu_count() or 1)) - engine
    if others and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, others)
        except OSError:  # outside the container's cpuset: it stays
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


def side_pool(name: str) -> ThreadPoolExecutor:
    """One worker thread for work beside the engine's loop (compiling a
    structured request's grammar: seconds for a large schema).  Threads
    inherit the engine's pinning (`pin_process`), so on a pinned CPU engine
    a plain worker thread would share the loop's one core; this one runs on
    the other cores where there are any, at a lower priority everywhere.
    Call after `pin_process`."""
    engine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else frozenset()
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_beside,
                              initargs=(engine,))


def _read_proc_stat() -> str:
    with open("/proc/stat", encoding="ascii") as f:
        return f.read()


def _busy_idle(text: str) -> dict[int, tuple[int, int]]:
    """Per core, jiffies spent busy and idle so far (idle and iowait)."""
    out = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or len(fields) < 5:
            continue
        ticks = [int(x) for x in fields[:8]]
        idle = ticks[3] + ticks[4]
        out[int(name[3:])] = (sum(ticks) - idle, idle)
    return out


def idlest_cores(count: int, window_s: float = 0.25,
                 read: Callable[[], str] = _read_proc_stat) -> list[int] | None:
    """The `count` cores this process may use that were least busy over the
    last `window_s` (from /proc/stat), or None where there is no choice to
    make (no more cores than `count`) or no /proc/stat to read.  Busy shares
    within the same fifth count as a tie, which goes to the lower id: a
    quarter second's sample flickers, and a restart should not move the
    engine for a difference that small."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if count < 1 or len(allowed) <= count:
        return None
    try:
        before = _busy_idle(read())
        time.sleep(window_s)
        after = _busy_idle(read())
    except (OSError, ValueError):
        return None

    def busy_share(core: int) -> float:
        if core not in before or core not in after:
            return 1.0
        busy = after[core][0] - before[core][0]
        total = busy + after[core][1] - before[core][1]
        return busy / total if total > 0 else 0.0

    return sorted(sorted(allowed, key=lambda c: (int(busy_share(c) * 5), c))[:count])
