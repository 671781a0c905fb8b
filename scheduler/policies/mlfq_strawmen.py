"""FastServe's strawmen (§4.1), for comparison with skip-join MLFQ."""

from __future__ import annotations

from scheduler.policies.mlfq import MLFQPolicy


class NaiveMLFQPolicy(MLFQPolicy):
    """Strawman: every job joins Q1 (FastServe §4.1)."""

    name = "mlfq-naive"
    variant = "naive"


class FixedPriorityPolicy(MLFQPolicy):
    """Strawman: priority from input length only, never demoted or promoted."""

    name = "fixed-priority"
    variant = "fixed"
