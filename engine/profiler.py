"""Start-up profile of a replica's iteration cost, for the policies.

FastServe §4.1 relies on iteration time being predictable: skip-join needs
the prefill time of a prompt, and q1 is the minimum iteration time.  At
start the engine replica times a few real iterations of its own model
(prefill at two lengths, a batch-1 decode, and a batch-8 decode for what each
more sequence adds, `decode_per_seq_s`) and fits `LinearCost`.  The
fuller profile for the simulator is `python -m bench profile`.  The
iterations are the server's own: planned by `SchedulerCore` and run by
`IterationDriver.step`, the loop's step without `async_scheduling`.
"""

from __future__ import annotations

import time
from typing import Any

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.iteration import IterationDriver, OnWallClock
from scheduler.job import Job


def _time_iterations(runner: Any, prompt_len: int, decode_steps: int,
                     block_size: int, num_blocks: int) -> tuple[float, float]:
    """(prefill time, fastest decode step) of one job run alone."""
    from engine.sampling_params import SamplingParams

    cfg = SchedulerConfig(block_size=block_size, num_blocks=num_blocks,
                          max_batch_size=1, max_batch_tokens=prompt_len,
                          max_model_len=num_blocks * block_size)
    core = SchedulerCore(cfg, time.monotonic)
    job = Job("profile", list(range(10, 10 + prompt_len)), decode_steps + 1, 0.0)
    core.add(job)
    runner.add_request(job.job_id, SamplingParams(temperature=0.0, ignore_eos=True,
                                                  max_tokens=decode_steps + 1),
                       job.prompt_token_ids)
    driver = IterationDriver(core, OnWallClock(runner))
    times: list[float] = []
    try:
        while core.has_work:
            times.append(driver.step().result.iteration_time)
    finally:
        if job.job_id in core.jobs:  # else the driver removed it when it finished
            runner.remove_request(job.job_id)
    return times[0], min(times[1:]) if len(times) > 1 else times[0]


def estimate_cost(runner: Any, block_size: int, short: int = 16, long: int = 256,
                  decode_steps: int = 4, repeats: int = 3, decode_batch: int = 8) -> LinearCost:
    """Fit `LinearCost` from the fastest of `repeats` timings of each shape.

    The fastest, not one sample or a mean: on a shared machine noise only
    ever adds time, and q1 is the *minimum* iteration time (§4.1).  Every
    quantum, skip-join level and α follows from this fit for the replica's
    whole life, and a single sample once caught a busy moment and set the
    base cost to 0.70 s instead of 0.10 s: quanta 7x too long, and MLFQ
    26 % slower than its simulation.
    """
    num_blocks = -(-(long + decode_steps + 2) // block_size)
    _time_iterations(runner, short, 1, block_size, num_blocks)  # warm-up
    shorts, decodes, longs = [], [], []
    for _ in range(repeats):
        t, d = _time_iterations(runner, short, decode_steps, block_size, num_blocks)
        shorts.append(t)
        decodes.append(d)
        longs.append(_time_iterations(runner, long, 1, block_size, num_blocks)[0])
    t_short, decode, t_long = min(shorts), min(decodes), min(longs)
    per_token = max(0.0, (t_long - t_short) / (long - short))
    base = max(1e-4, t_short - per_token * short)
    # What each more sequence adds to a decode iteration, from the fastest
    # decode at batch `decode_batch` against batch 1: the co-serving budget
    # (ConServe §4.5) adds offline decodes by it.  The decode line goes
    # through the batch-1 time, so q1 (FastServe §4.1) stays what it was.
    per_seq = 0.0
    tps = full_batch_throughput(runner, block_size, decode_batch, repeats=repeats)
    if tps > 0:
        per_seq = max(0.0, (decode_batch / tps - decode) / (decode_batch - 1))
    return LinearCost(base_s=base, prefill_per_token_s=per_token, decode_per_seq_s=per_seq,
                      decode_base_s=decode - per_seq)


def full_batch_throughput(runner: Any, block_size: int, batch_size: int, prompt_len: int = 8,
                          decode_steps: int = 3, repeats: int = 1) -> float:
    """Tokens/s of a decode iteration with `batch_size` jobs (the fastest
    of the timed steps): the replica's speed when its batch is full, which
    bounds its queued work (scheduler/admission.py) until the loop has
    measured its speed under real load."""
    from engine.sampling_params import SamplingParams

    per_job = -(-(prompt_len + decode_steps + 2) // block_size)
    cfg = SchedulerConfig(block_size=block_size, num_blocks=per_job * batch_size,
                          max_batch_size=batch_size,
                          max_batch_tokens=max(prompt_len * batch_size, batch_size),
                          max_model_len=per_job * block_size)
    best = float("inf")
    for r in range(repeats):
        core = SchedulerCore(cfg, time.monotonic)
        driver = IterationDriver(core, OnWallClock(runner))
        ids = [f"throughput-{r}-{i}" for i in range(batch_size)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=decode_steps + 1)
        for i, job_id in enumerate(ids):
            prompt = [10 + (i + k) % 1000 for k in range(prompt_len)]
            core.add(Job(job_id, prompt, decode_steps + 1, 0.0))
            runner.add_request(job_id, params, prompt)
        try:
            while core.has_work:
                it = driver.step()
                chunks = it.plan.chunks
                if chunks and all(c.num_tokens == 1 for c in chunks) \
                        and len(chunks) == batch_size:
                    best = min(best, it.result.iteration_time)
        finally:
            for job_id in ids:
                if job_id in core.jobs:  # else the driver removed it when it finished
                    runner.remove_request(job_id)
    return batch_size / best if best < float("inf") else 0.0
