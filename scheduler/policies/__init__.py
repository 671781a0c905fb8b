"""Scheduling policies, by the name used in the `policy` config field."""

from __future__ import annotations

from scheduler.policies.fcfs import FCFSPolicy
from scheduler.policy import Policy

POLICIES: dict[str, type[Policy]] = {FCFSPolicy.name: FCFSPolicy}


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
