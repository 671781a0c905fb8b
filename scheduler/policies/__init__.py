"""Scheduling policies, by the name used in the `policy` config field."""

from __future__ import annotations

from scheduler.policies.conserve import ConservePolicy
from scheduler.policies.econoserve import EconoservePolicy
from scheduler.policies.fcfs import FCFSPolicy
from scheduler.policies.mlfq import MLFQPolicy
from scheduler.policies.mlfq_strawmen import FixedPriorityPolicy, NaiveMLFQPolicy
from scheduler.policy import Policy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (FCFSPolicy, MLFQPolicy, NaiveMLFQPolicy, FixedPriorityPolicy,
                             ConservePolicy, EconoservePolicy)
}


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
