"""Thread pinning for CPU execution.

With two busy processes on two cores, OpenMP threads that outnumber the cores
slow every matmul down 10 to 25× (ARCHITECTURE.md, measured facts), so a
replica pins its intra-op pool to the CPUs it was given.  Ray already sets
OMP_NUM_THREADS=1 for a 1-CPU actor; this makes the choice explicit and
visible in one place.
"""

from __future__ import annotations

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
