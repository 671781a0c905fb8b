"""The replica-kill study's summary of the replicas' checkpoint lag."""

from __future__ import annotations

from studies.survival.report import exposure


def row(jobs: int, uncovered: int, largest: int, pending: int) -> dict[str, object]:
    return {"resident_jobs": jobs, "uncovered_tokens": uncovered,
            "max_uncovered_tokens": largest, "tier_pending_blocks": pending, "kv_use": 0.5}


def test_lag_is_averaged_per_resident_job_over_busy_samples_only() -> None:
    rows = [row(0, 0, 0, 0),  # idle: no job to lose, left out
            row(4, 200, 90, 2), row(2, 20, 15, 0)]
    ex = exposure(rows)
    assert ex["samples"] == 2
    assert ex["uncovered_tokens_per_job_mean"] == (50 + 10) / 2
    assert ex["tier_pending_blocks_mean"] == 1.0 and ex["tier_pending_blocks_max"] == 2
    assert ex["resident_jobs_mean"] == 3.0
    assert exposure([row(0, 0, 0, 0)]) == {"samples": 0}


def test_lag_splits_by_whether_the_host_tier_was_full() -> None:
    rows = [{**row(4, 400, 200, 0), "host_used_blocks": 95},
            {**row(2, 40, 30, 0), "host_used_blocks": 10},
            {**row(2, 20, 15, 0), "host_used_blocks": 89}]
    ex = exposure(rows, host_blocks=100)
    assert ex["host_full_share"] == round(1 / 3, 3)
    assert ex["uncovered_tokens_per_job_mean_host_full"] == 100.0
    assert ex["uncovered_tokens_per_job_mean_host_not_full"] == 15.0
    assert "host_full_share" not in exposure(rows)
