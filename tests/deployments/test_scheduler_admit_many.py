"""The Scheduler deployment's `admit_many` and `release_many` (what the
ingress's coalesced calls reach, deployments/coalesce.py): each request is
admitted in turn, as by its own `admit`, so a batch's later requests see its
earlier ones; an offline request that could wait in the pool is refused
before anything is admitted."""

from __future__ import annotations

import asyncio

import pytest

from tests.deployments.test_scheduler_pool import CONSERVE, make  # noqa: F401 - fixture


def _loaded(s: object) -> "asyncio.Future[None]":
    from scheduler.admission import AdmissionBound, load_report
    from scheduler.cost import LinearCost
    from scheduler.job import Job

    decoding = Job("d", [1] * 10, max_tokens=50, arrival_time=0.0)
    decoding.output_token_ids = [3]
    decoding.num_computed_tokens = 10
    report = load_report([decoding], {"d"}, 50.0, 100.0, AdmissionBound(ttft_slo_s=2.0), 8,
                         100, LinearCost(0.1, 0.01, 0.02))
    return s.report_load("r", 100, 90, 0, 1, report)  # type: ignore[attr-defined]


def test_a_batch_is_admitted_in_turn_and_released_together(make) -> None:  # noqa: F811
    async def run() -> None:
        s = make({})
        await _loaded(s)
        # As the one-by-one test in test_scheduler_pool: the first 150-token
        # prompt fits the 2 s objective, the second would wait past it.
        answers = await s.admit_many([
            {"request_id": "a", "prompt_tokens": 150, "max_tokens": 10},
            {"request_id": "b", "prompt_tokens": 150, "max_tokens": 10},
            {"request_id": "c", "prompt_tokens": 1, "max_tokens": 1, "job_class": "offline"}])
        assert answers[0]["admitted"] and answers[0]["replica"] == "r"
        assert not answers[1]["admitted"] and answers[1]["retry_after_s"] >= 0.5
        assert answers[2]["admitted"]  # offline: past the bound, no pool here
        assert set(s.jobs) == {"a", "c"}
        await s.release_many([("a", "finished"), ("c", "aborted")])
        assert s.jobs == {} and s.outcomes == {"finished": 1, "aborted": 1}
        # Room again for a new one.
        again = await s.admit_many([{"request_id": "e", "prompt_tokens": 150,
                                     "max_tokens": 10}])
        assert again[0]["admitted"]

    asyncio.run(run())


def test_an_offline_request_that_could_wait_in_the_pool_is_refused_whole(make) -> None:  # noqa: F811
    async def run() -> None:
        s = make(CONSERVE)
        with pytest.raises(ValueError, match="o1.*offline pool"):
            await s.admit_many([{"request_id": "a", "prompt_tokens": 5, "max_tokens": 5},
                                {"request_id": "o1", "prompt_tokens": 5, "max_tokens": 5,
                                 "job_class": "offline"}])
        assert s.jobs == {}

    asyncio.run(run())


def test_a_malformed_request_names_its_field(make) -> None:  # noqa: F811
    from pydantic import ValidationError

    async def run() -> None:
        s = make({})
        with pytest.raises(ValidationError, match="prompt_tokens"):
            await s.admit_many([{"request_id": "a", "max_tokens": 5}])

    asyncio.run(run())
