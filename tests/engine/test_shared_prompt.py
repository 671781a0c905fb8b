"""Siblings sharing a prompt's KV blocks (OpenAI `n` > 1) through the real
`ModelRunner`: every completion gets the greedy tokens of its prompt run
alone, with and without preemption (recompute or swap)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import Plan
from tests.engine.helpers import random_prompts

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# Two requests: 23 prompt tokens x 3 completions, 41 x 2.  Blocks of 4:
# 5 and 10 shared blocks, 20 and 40 prompt tokens not recomputed per sibling.
PROMPTS = random_prompts([23, 41], seed=11)
N = {"job0": 3, "job1": 2}
SHARED_TOKENS = 2 * 20 + 1 * 40


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


def drive_shared(runner: ModelRunner, n: dict[str, int], **sched: object
                 ) -> tuple[dict[str, list[int]], SchedulerCore, int]:
    """Run every prompt of `PROMPTS` as `n[job]` completions, the first one
    leading, to completion; returns each completion's tokens, the core, and
    how many evictions took a job holding shared blocks."""
    clock = itertools.count()
    cfg = dict(block_size=4, max_model_len=80, max_batch_size=32) | sched
    core = SchedulerCore(SchedulerConfig(**cfg),  # type: ignore[arg-type]
                         clock=lambda: float(next(clock)))
    tokens: dict[str, list[int]] = {}
    for leader, prompt in PROMPTS.items():
        for i in range(n[leader]):
            job_id = leader if i == 0 else f"{leader}.{i}"
            core.add(Job(job_id, list(prompt), NEW, arrival_time=0.0),
                     share_prompt_with=leader if i else None)
            runner.add_request(job_id, GREEDY, list(prompt))
            tokens[job_id] = []
    shared_evictions = 0
    for _ in range(2000):
        if not core.has_work:
            break
        sharing = {j.job_id for j in core.jobs.values()
                   if core.blocks.num_exclusive(j) < len(j.block_table)}
        plan = core.schedule()
        shared_evictions += len(sharing.intersection(plan.preempted))
        for ev in core.complete(plan, runner.execute(plan)):
            assert ev.token_id is not None
            tokens[ev.job_id].append(ev.token_id)
            if ev.finished:
                runner.remove_request(ev.job_id)
    assert not core.has_work, "scheduler did not drain"
    core.blocks.check(core.jobs.values())
    assert core.blocks.num_free == core.blocks.num_blocks
    return tokens, core, shared_evictions


@pytest.fixture(scope="module")
def alone(runner: ModelRunner) -> dict[str, list[int]]:
    tokens, core, _ = drive_shared(runner, {j: 1 for j in PROMPTS}, policy="fcfs", num_blocks=96)
    assert core.num_preemptions == 0
    return tokens


def assert_same_as_alone(tokens: dict[str, list[int]], alone: dict[str, list[int]]) -> None:
    for job_id, got in tokens.items():
        assert got == alone[job_id.split(".")[0]], job_id
        assert len(got) == NEW


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_siblings_match_the_prompt_run_alone(runner, alone, policy):
    tokens, core, _ = drive_shared(runner, N, policy=policy, num_blocks=96)
    assert_same_as_alone(tokens, alone)
    assert core.stats().num_shared_prompt_tokens == SHARED_TOKENS
    assert core.num_preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_siblings_match_the_prompt_run_alone_under_recompute_preemption(runner, alone, policy):
    # 24 blocks for five completions of up to 13 blocks each.
    tokens, core, shared_evictions = drive_shared(runner, N, policy=policy, num_blocks=24,
                                                  max_batch_tokens=16)
    assert_same_as_alone(tokens, alone)
    assert shared_evictions > 0, "meant to evict a job that holds shared blocks"
    assert core.stats().num_shared_prompt_tokens > 0


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_siblings_match_the_prompt_run_alone_when_swapped(runner, alone, policy):
    tier = LocalHostTier(capacity_bytes=10**8)
    runner.set_kv_tier(tier)
    try:
        tokens, core, shared_evictions = drive_shared(
            runner, N, policy=policy, num_blocks=24, max_batch_tokens=16,
            swap_mode="reactive", host_kv_blocks=64)
        # Host copies of the last jobs to finish: their DROPs wait for a
        # next plan, which a drained scheduler never makes.
        runner.execute(Plan(0, [], block_ops=core.swap.take_pending()))
    finally:
        runner.swapper = None
    assert_same_as_alone(tokens, alone)
    assert shared_evictions > 0, "meant to swap out a job that holds shared blocks"
    assert core.swap.num_recompute_fallbacks == 0
    assert core.stats().num_shared_prompt_tokens > 0
    tier.flush()
    assert tier.used == 0
