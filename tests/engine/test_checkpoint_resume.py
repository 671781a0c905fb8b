"""Checkpoint and resume (ConServe §4.4) are transparent: offline jobs whose
KV is checkpointed incrementally, discarded when online work needs the
memory and restored by prefetch produce the greedy tokens of the reference
forward pass, and so do the online jobs beside them (float32)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.job import Job, JobClass
from scheduler.plan import BlockOpKind, Plan
from tests.engine.helpers import hf_greedy, load_hf, random_prompts

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                       max_model_len=80, num_threads=1)


def co_serve(runner: ModelRunner, offline: dict[str, list[int]],
             online: dict[str, list[int]], online_at: int) -> tuple[dict, SchedulerCore]:
    """Offline jobs from the start, online ones at step `online_at`, in a
    KV cache of 22 blocks that cannot hold them all."""
    clock = itertools.count()
    cfg = SchedulerConfig(policy="conserve", block_size=4, num_blocks=22, max_batch_size=8,
                          max_batch_tokens=32, max_model_len=80, host_kv_blocks=128,
                          conserve={"tpot_slo_s": 10.0, "ttft_slo_s": 10.0,
                                    "checkpoint_threshold": 0.0, "checkpoint_max_blocks": 4})
    core = SchedulerCore(cfg, lambda: float(next(clock)),
                         cost=LinearCost(0.01, 0.001, 0.001))
    tokens: dict[str, list[int]] = {}

    def add(jobs: dict[str, list[int]], cls: JobClass) -> None:
        for job_id, prompt in jobs.items():
            core.add(Job(job_id, prompt, NEW, arrival_time=0.0, job_class=cls))
            runner.add_request(job_id, GREEDY, prompt)
            tokens[job_id] = []

    add(offline, JobClass.OFFLINE)
    step = 0
    while core.has_work or step <= online_at:
        if step == online_at:
            add(online, JobClass.ONLINE)
        plan = core.schedule()
        result = runner.execute(plan)
        for ev in core.complete(plan, result):
            tokens[ev.job_id].append(ev.token_id)
            if ev.finished:
                runner.remove_request(ev.job_id)
        core.blocks.check(core.jobs.values())
        step += 1
        assert step < 2000, "no progress"
    runner.execute(Plan(step, [], block_ops=core.swap.take_pending()))
    return tokens, core


def test_discard_and_prefetch_change_no_token(runner: ModelRunner,
                                              tiny_llama_path: Path) -> None:
    offline = {f"off{i}": p for i, p in
               enumerate(random_prompts([18, 25, 9, 30], seed=11).values())}
    online = {f"on{i}": p for i, p in enumerate(random_prompts([28, 20], seed=12).values())}
    hf = load_hf(tiny_llama_path)
    want = {j: hf_greedy(hf, p, NEW) for j, p in {**offline, **online}.items()}
    tier = LocalHostTier(capacity_bytes=10**8)
    runner.set_kv_tier(tier)
    ops: list[BlockOpKind] = []
    real_apply = runner.swapper.apply  # type: ignore[union-attr]

    def spy(block_ops):  # type: ignore[no-untyped-def]
        ops.extend(op.kind for op in block_ops)
        real_apply(block_ops)

    runner.swapper.apply = spy  # type: ignore[union-attr,method-assign]
    try:
        got, core = co_serve(runner, offline, online, online_at=6)
    finally:
        runner.swapper = None
    assert got == want
    swap = core.swap
    # The online burst took checkpointed offline jobs' memory with no copy,
    # and they came back from their checkpoints.
    assert swap.num_checkpoint_discards > 0
    assert BlockOpKind.CHECKPOINT in ops and BlockOpKind.PREFETCH in ops
    assert BlockOpKind.SWAP_OUT not in ops
    assert tier.stats.fetches > 0 and tier.stats.fetch_failures == 0
    tier.flush()
    assert tier.used == 0 and swap.host_used == 0


def test_a_lost_checkpoint_falls_back_to_recompute(runner: ModelRunner,
                                                   tiny_llama_path: Path) -> None:
    """A host tier that refuses every copy: the checkpoints the scheduler
    counted are not there, each resume fails over to recomputation, and
    the tokens are still right."""
    offline = {f"off{i}": p for i, p in
               enumerate(random_prompts([18, 25, 9, 30], seed=21).values())}
    online = {f"on{i}": p for i, p in enumerate(random_prompts([28, 20], seed=22).values())}
    hf = load_hf(tiny_llama_path)
    want = {j: hf_greedy(hf, p, NEW) for j, p in {**offline, **online}.items()}
    tier = LocalHostTier(capacity_bytes=1)
    runner.set_kv_tier(tier)
    try:
        got, core = co_serve(runner, offline, online, online_at=6)
    finally:
        runner.swapper = None
    assert got == want
    assert core.swap.num_checkpoint_discards > 0
    assert core.swap.num_recompute_fallbacks > 0 and tier.stats.offload_failures > 0
