"""The co-serving budget against a replica whose decodes pay for their
context, which the start-up fit does not see (ConServe §4.5;
scheduler/cost_fit.py)."""

from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.cost_fit import IterationShape, LiveCost, typical_batch
from scheduler.job import JobClass
from tests.scheduler.conftest import FakeClock, FakeEngine, make_job

# The start-up fit: 10 ms + 1 ms per token, contexts free.
STARTUP = LinearCost(base_s=0.010, prefill_per_token_s=0.001, decode_per_seq_s=0.001)
TPOT = 0.06


def true_time(shape: IterationShape) -> float:
    """What the replica really takes: 50 µs more per decode context token."""
    return (0.010 + 0.001 * (shape.prefill_tokens + shape.decodes)
            + 5e-5 * shape.decode_context)


def run(cost: LinearCost | LiveCost) -> tuple[list[float], int]:
    """Two online jobs decode 120 tokens each at ~250-token contexts beside
    an offline backlog; returns the true times of the co-serving iterations
    that decoded online jobs, and the offline tokens computed meanwhile."""
    clock = FakeClock()
    core = SchedulerCore(SchedulerConfig(
        policy="conserve", block_size=4, num_blocks=1024, max_batch_size=16,
        max_batch_tokens=64, max_model_len=512,
        conserve={"tpot_slo_s": TPOT, "ttft_slo_s": 1.0}), clock, cost=cost)
    engine = FakeEngine(clock)
    for _ in range(12):
        job = make_job(240, 120)
        job.job_class = JobClass.OFFLINE
        core.add(job)
    online = [make_job(200, 120) for _ in range(2)]
    for job in online:
        core.add(job)
    times, offline_tokens = [], 0
    while any(j.job_id in core.jobs for j in online):
        plan = core.schedule()
        shape = IterationShape.of((c.start_pos, c.num_tokens) for c in plan.chunks)
        t = true_time(shape)
        if any(c.job_id in {j.job_id for j in online} and c.start_pos >= 200
               for c in plan.chunks):
            times.append(t)
            offline_tokens += sum(c.num_tokens for c in plan.chunks
                                  if core.jobs[c.job_id].job_class is JobClass.OFFLINE)
        core.complete(plan, engine.execute(plan))
        if isinstance(cost, LiveCost):
            cost.observe(shape, t)
    return times, offline_tokens


def test_the_live_fit_keeps_online_decodes_within_the_objective() -> None:
    times, offline_tokens = run(LiveCost(STARTUP, typical_batch(16, 64, 512)))
    assert len(times) >= 100
    # After its first iterations, the fit has learnt the context's cost.
    late = times[20:]
    assert max(late) <= TPOT * 1.05
    assert offline_tokens > 0  # the budget's room still goes to offline work


def test_the_startup_fit_alone_overshoots() -> None:
    times, _ = run(STARTUP)
    late = times[20:]
    assert sum(t > TPOT * 1.2 for t in late) > len(late) // 2
