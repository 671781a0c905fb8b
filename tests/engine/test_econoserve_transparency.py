"""Preemption transparency under `policy: econoserve` (EconoServe §3.3.2):
GTs whose predictions are too short run past their allocation, are
extended from the reserve or paused (their KV dropped, or swapped to a
host tier and back), hosted GTs are evicted when their host needs the
space, and every job still produces the greedy tokens of the reference
forward pass (float32)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from kvstore.tier import LocalHostTier
from scheduler.job import Job
from scheduler.plan import BlockOpKind, Plan
from tests.engine.helpers import hf_greedy, load_hf, random_prompts

NEW = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                       max_model_len=80, num_threads=1)


@pytest.mark.parametrize("pipelining,tier", [(False, False), (True, False), (False, True)],
                         ids=["exact", "pipelined", "exact-swapped"])
def test_econoserve_outputs_match_reference(runner: ModelRunner, tiny_llama_path: Path,
                                            pipelining: bool, tier: bool) -> None:
    prompts = random_prompts([5, 23, 41, 9, 1, 30, 17, 12], seed=3)
    hf = load_hf(tiny_llama_path)
    expected = {j: hf_greedy(hf, p, NEW) for j, p in prompts.items()}
    # Allocations from 2 to 20 tokens against 14 real ones: half run over.
    allocs = dict(zip(prompts, [2, 20, 6, 14, 3, 9, 16, 4]))
    clock = itertools.count()
    # With a host tier, paused GTs swap their KV out (`pause_kv: swap`, the
    # default); without one they drop it.
    swap = dict(swap_mode="reactive", host_kv_blocks=64) if tier else {}
    cfg = SchedulerConfig(policy="econoserve", block_size=4, num_blocks=24, max_batch_size=6,
                          max_batch_tokens=24, max_model_len=80, **swap,
                          econoserve={"pipelining": pipelining, "pt_reserve": 0.1})
    core = SchedulerCore(cfg, lambda: float(next(clock)))
    if tier:
        runner.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
    swapped_pauses = 0
    tokens: dict[str, list[int]] = {}
    for job_id, prompt in prompts.items():
        job = Job(job_id, prompt, NEW, arrival_time=0.0)
        job.allocated_output_len = allocs[job_id]
        core.add(job)
        runner.add_request(job_id, GREEDY, prompt)
        tokens[job_id] = []
    try:
        steps = 0
        while core.has_work:
            plan = core.schedule()
            swapped_pauses += sum(op.kind is BlockOpKind.SWAP_OUT and op.job_id in plan.preempted
                                  for op in plan.block_ops)
            for ev in core.complete(plan, runner.execute(plan)):
                tokens[ev.job_id].append(ev.token_id)
                if ev.finished:
                    runner.remove_request(ev.job_id)
            core.blocks.check(core.jobs.values())
            steps += 1
            assert steps < 2000
        if tier:
            runner.execute(Plan(0, [], block_ops=core.swap.take_pending()))
    finally:
        runner.swapper = None
    if tier:
        assert swapped_pauses > 0 and core.swap.tokens_dropped == 0
    assert tokens == expected
    policy = core.policy
    assert policy.num_overruns > 0
    assert policy.num_paused + policy.num_evicted > 0
    assert core.blocks.num_free == cfg.num_blocks
