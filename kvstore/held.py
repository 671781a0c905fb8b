"""Which of a job's KV blocks a tier can hand back whole: the checkpoint a
job resumes from on another replica (`survival.checkpoint`).  No Ray, no
torch: the directory actor and the engine's tier both use it."""

from __future__ import annotations

from collections.abc import Iterable


def leading_blocks(indices: Iterable[int]) -> int:
    """The length of the run 0, 1, 2, … in `indices`."""
    have = set(indices)
    n = 0
    while n in have:
        n += 1
    return n
