"""The Scheduler's foresight for the ingress (deployments/dispatch_ahead.py):
an admission answer names the replica the next online request may be sent
to before its own answer only where the application has one live replica
and it starts a newcomer at once; and a replica that reports a job before
the Scheduler placed it there does not count it twice."""

from __future__ import annotations

import asyncio
from typing import Any

from scheduler.admission import AdmissionBound, load_report
from scheduler.cost import LinearCost
from scheduler.job import Job
from scheduler.placement import Placement
from tests.deployments.test_scheduler_pool import make  # noqa: F401 - fixture


def _figures(running: int = 1, waiting_prompt: int = 0, arrived: list[str] | None = None
             ) -> dict[str, Any]:
    """A replica's admission figures: `running` decoding jobs in its batch
    (of 8), and a waiting prompt of `waiting_prompt` tokens if not 0."""
    jobs = []
    for i in range(running):
        j = Job(f"d{i}", [1] * 10, max_tokens=50, arrival_time=0.0)
        j.output_token_ids = [3]
        j.num_computed_tokens = 10
        jobs.append(j)
    batch = {j.job_id for j in jobs}
    if waiting_prompt:
        jobs.append(Job("w", [1] * waiting_prompt, max_tokens=10, arrival_time=0.0))
    out = load_report(jobs, batch, 50.0, 100.0, AdmissionBound(ttft_slo_s=2.0), 8, 100,
                      LinearCost(0.1, 0.01, 0.02))
    if arrived is not None:
        out["arrived"] = arrived
    return out


def _admit(s: Any, rid: str) -> dict[str, Any]:
    return asyncio.run(s.admit(rid, 20, 10))


def test_one_open_replica_is_named(make) -> None:  # noqa: F811
    s = make({})
    asyncio.run(s.report_load("r", 100, 90, 0, 1, _figures()))
    first = _admit(s, "a")
    assert first["admitted"] and first["replica"] == "r" and first["dispatch_ahead"] == "r"
    # Its own prompt now waits there (placed, not yet reported): not at once.
    assert _admit(s, "b")["dispatch_ahead"] is None


def test_a_busy_replica_two_replicas_or_the_setting_off_name_none(make) -> None:  # noqa: F811
    s = make({})
    asyncio.run(s.report_load("r", 100, 90, 0, 1, _figures(waiting_prompt=30)))
    assert _admit(s, "a")["dispatch_ahead"] is None  # a prompt is ahead
    s = make({})
    asyncio.run(s.report_load("r", 100, 90, 0, 8, _figures(running=8)))
    assert _admit(s, "a")["dispatch_ahead"] is None  # no free slot
    s = make({})
    asyncio.run(s.report_load("r", 100, 90, 0, 1, _figures()))
    asyncio.run(s.report_load("q", 100, 90, 0, 1, _figures()))
    assert _admit(s, "a")["dispatch_ahead"] is None  # which one is the answer's
    s = make({"admission": {"dispatch_ahead": False}})
    asyncio.run(s.report_load("r", 100, 90, 0, 1, _figures()))
    assert _admit(s, "a")["dispatch_ahead"] is None


def test_a_job_reported_before_it_was_placed_counts_once() -> None:
    p = Placement(stale_after_s=10.0, block_size=16)
    p.report("r", 100, 90, 0, 1, 0.0, **_figures())
    # The request went ahead of its admission: the replica's report names
    # it before the Scheduler places it.
    p.report("r", 100, 90, 0, 2, 0.1, **_figures(running=2, arrived=["a"]))
    assert p.admit("a", 20, 10, 1, 0.2).admitted
    r = p.replicas["r"]
    assert r.in_transit == {} and r.starts_at_once()
    # Placed normally, it counts until a report names it.
    assert p.admit("b", 20, 10, 1, 0.3).admitted
    assert set(r.in_transit) == {"b"} and not r.starts_at_once()
    p.report("r", 100, 90, 0, 3, 0.4, **_figures(running=3, arrived=["b"]))
    assert r.in_transit == {}
    # One reported but never placed here is forgotten after `stale_after_s`.
    p.report("r", 100, 90, 0, 3, 0.5, **_figures(running=3, arrived=["c"]))
    assert set(r.ahead_of_placing) == {"c"}
    p.report("r", 100, 90, 0, 3, 11.0, **_figures(running=3, arrived=[]))
    assert r.ahead_of_placing == {}
