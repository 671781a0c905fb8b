"""A forward pass cut between layers (ConServe §4.3) leaves nothing behind:
every job's greedy tokens are those of uninterrupted runs, whether the cut
falls on prefill chunks, on decodes or on both (float32)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from tests.engine.helpers import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(runner: ModelRunner, prompts: dict[str, list[int]], cut: set[int]) -> tuple[dict, int]:
    """Greedy tokens of `prompts` through the scheduler core; the passes of
    the steps in `cut` are marked preemptible and the flag is set first."""
    clock = itertools.count()
    core = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=4, num_blocks=64,
                                         max_batch_size=8, max_batch_tokens=24,
                                         max_model_len=80), lambda: float(next(clock)))
    tokens: dict[str, list[int]] = {}
    for job_id, prompt in prompts.items():
        core.add(Job(job_id, prompt, PARAMS.max_tokens or 0, arrival_time=0.0))
        runner.add_request(job_id, PARAMS, prompt)
        tokens[job_id] = []
    step = interrupted = 0
    while core.has_work:
        plan = core.schedule()
        if step in cut and plan.chunks:
            plan.preemptible_at_layers = True
            runner.preempt_flag.set()
        result = runner.execute(plan)
        assert result.interrupted == (step in cut and bool(plan.chunks))
        assert not runner.preempt_flag.is_set()  # spent by every pass
        interrupted += result.interrupted
        for ev in core.complete(plan, result):
            tokens[ev.job_id].append(ev.token_id)
            if ev.finished:
                runner.remove_request(ev.job_id)
        step += 1
        assert step < 1000
    core.blocks.check()
    return tokens, interrupted


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_opt_path"])
def test_cut_passes_change_no_token(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    runner = ModelRunner(path, "float32", "cpu", num_blocks=64, block_size=4,
                         max_model_len=80, num_threads=1)
    prompts = random_prompts([30, 7, 19, 3], seed=5)
    want, _ = run(runner, prompts, set())
    # Every other pass cut after the first of the two layers: half-written
    # K/V at the new positions of prefill chunks and decodes alike.
    got, n = run(runner, prompts, set(range(0, 400, 2)))
    assert n > 10 and got == want


def test_cut_every_eight_layers_of_smollm2(smollm2_runner: ModelRunner) -> None:
    runner = smollm2_runner
    runner.preempt_flag.every = 8
    try:
        prompts = random_prompts([21, 9, 14], seed=9, vocab=49152)
        want, _ = run(runner, prompts, set())
        got, n = run(runner, prompts, {0, 1, 3, 6, 7, 12})
        assert n == 6 and got == want
    finally:
        runner.preempt_flag.every = 1


def test_a_pass_that_may_not_be_cut_runs_and_spends_the_flag(tiny_llama_path: Path) -> None:
    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=16, block_size=4,
                         max_model_len=32, num_threads=1)
    prompts = random_prompts([6], seed=1)
    want, _ = run(runner, prompts, set())
    clock = itertools.count()
    core = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=4, num_blocks=16,
                                         max_model_len=32), lambda: float(next(clock)))
    core.add(Job("job0", prompts["job0"], 12, arrival_time=0.0))
    runner.add_request("job0", PARAMS, prompts["job0"])
    runner.preempt_flag.set()
    plan = core.schedule()
    result = runner.execute(plan)  # not marked preemptible
    assert not result.interrupted and not runner.preempt_flag.is_set()
    assert [e.token_id for e in core.complete(plan, result)] == want["job0"][:1]
    runner.remove_request("job0")
