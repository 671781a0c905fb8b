"""The burst study keeps running: a smaller burst, a KV tier a tenth of
its prompts, every job finished, and the MLFQ throwing away far less work
when new jobs may not drop started jobs' KV."""

from __future__ import annotations

import pytest

from studies.burst.run import measured_cost, run


@pytest.mark.parametrize("mode", ["recompute", "proactive"])
def test_new_jobs_that_keep_started_jobs_kv_drop_less_work(mode):
    cost = measured_cost()
    new = run("mlfq", mode, False, cost, requests=150, kv_tokens=8192)
    old = run("mlfq", mode, True, cost, requests=150, kv_tokens=8192)
    assert new["finished"] == old["finished"] == 150
    assert new["tokens_dropped"] < old["tokens_dropped"] / 2
    assert new["output_tokens_per_s"] > old["output_tokens_per_s"]
