"""A job resumed on another runner from the checkpoints its first runner
left in the shared host tier (`survival.checkpoint`, `SchedulerCore.add(...,
host_blocks=)`): the greedy tokens of an uninterrupted run, with only the
tokens past the last checkpoint recomputed (float32)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver, OnWallClock
from scheduler.job import Job
from scheduler.plan import BlockOpKind
from tests.engine.helpers import random_prompts

BLOCK = 4
PROMPTS = random_prompts([13, 22, 9], seed=11)
MAX_TOKENS = 24


def make_runner(path: Path, tier: LocalHostTier) -> ModelRunner:
    runner = ModelRunner(path, "float32", "cpu", num_blocks=64, block_size=BLOCK,
                         max_model_len=96, num_threads=1, attention_backend="torch")
    runner.set_kv_tier(tier)
    return runner


def make_core(checkpoint: bool, max_model_len: int = 96) -> SchedulerCore:
    clock = itertools.count()
    return SchedulerCore(SchedulerConfig(
        policy="fcfs", block_size=BLOCK, num_blocks=64, max_batch_size=8, max_batch_tokens=32,
        max_model_len=max_model_len, host_kv_blocks=200,
        survival={"checkpoint": checkpoint, "every_blocks": 2}),
        clock=lambda: float(next(clock)))


def serve(runner: ModelRunner, core: SchedulerCore, tokens: dict[str, list[int]],
          max_steps: int = 1_000) -> list[list[tuple[str, int, int, object]]]:
    """Step until done or `max_steps`; returns each plan's (job, start,
    tokens, op kinds) for the checks."""
    driver = IterationDriver(core, OnWallClock(runner))
    plans = []
    for _ in range(max_steps):
        if not core.has_work and not core.swap.pending_ops:  # drops ride on plans
            break
        it = driver.step()
        plans.append([(c.job_id, c.start_pos, c.num_tokens, None) for c in it.plan.chunks]
                     + [(o.job_id, o.first_block, o.num_blocks, o.kind)
                        for o in it.plan.block_ops])
        for ev in it.events:
            assert ev.token_id is not None
            tokens[ev.job_id].append(ev.token_id)
    return plans


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> dict[str, list[int]]:
    runner = make_runner(tiny_llama_path, LocalHostTier(10**8))
    core = make_core(checkpoint=False)
    out: dict[str, list[int]] = {j: [] for j in PROMPTS}
    for j, p in PROMPTS.items():
        core.add(Job(j, p, MAX_TOKENS, arrival_time=0.0))
        runner.add_request(j, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                             ignore_eos=True), p)
    serve(runner, core, out)
    assert all(len(t) == MAX_TOKENS for t in out.values())
    return out


def test_a_job_goes_on_from_its_checkpoints_on_another_runner(
        tiny_llama_path: Path, reference: dict[str, list[int]]) -> None:
    tier = LocalHostTier(10**8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first, core = make_runner(tiny_llama_path, tier), make_core(checkpoint=True)
    got: dict[str, list[int]] = {j: [] for j in PROMPTS}
    for j, p in PROMPTS.items():
        core.add(Job(j, p, MAX_TOKENS, arrival_time=0.0))
        first.add_request(j, params, p)
    plans = serve(first, core, got, max_steps=14)
    checkpointed = {x[0] for plan in plans for x in plan if x[3] is BlockOpKind.CHECKPOINT}
    assert checkpointed == set(PROMPTS)
    # The first runner dies: its device KV is gone, its checkpoints stay.
    del first, core
    second, core = make_runner(tiny_llama_path, tier), make_core(checkpoint=True)
    held: dict[str, int] = {}
    adopted: dict[str, int] = {}
    for j, p in PROMPTS.items():
        assert 0 < len(got[j]) < MAX_TOKENS
        held[j] = tier.held(j)
        job = Job(j, p, MAX_TOKENS, arrival_time=0.0)
        job.output_token_ids = list(got[j])
        core.add(job, host_blocks=held[j])
        adopted[j] = job.num_checkpointed_blocks
        second.add_request(j, params, p, output_token_ids=got[j])
        assert job.num_computed_tokens == min(held[j], (len(p) + len(got[j]) - 1) // BLOCK) * BLOCK
        assert len(p) + len(got[j]) - job.num_computed_tokens < 3 * BLOCK  # the tail only
    plans = serve(second, core, got)
    assert got == reference
    fetched = {x[0]: x[1] + x[2] for plan in plans for x in plan if x[3] is BlockOpKind.PREFETCH}
    assert fetched == adopted and all(n > 0 for n in adopted.values())
    # Each job's first chunk here starts where its checkpoint ends.
    starts: dict[str, int] = {}
    for plan in plans:
        for job_id, start, _, kind in plan:
            if kind is None:
                starts.setdefault(job_id, start)
    assert starts == {j: n * BLOCK for j, n in adopted.items()}
    # Finished, the jobs' host copies were dropped.
    tier.flush()
    assert all(tier.held(j) == 0 for j in PROMPTS)
    assert core.blocks.num_free == core.blocks.num_blocks and core.swap.host_used == 0


def resume_on_split_replica(split: ModelRunner, whole: ModelRunner) -> None:
    """`survival.checkpoint` with a split model (tensor-parallel shards or
    pipeline stages, the first rank `split`, float32, a Ray cluster up):
    each rank checkpoints its slice of every block; once the replica is
    gone, one split the same way fetches every rank's slice (only the tail
    past the checkpoints is recomputed) and goes on with the whole model's
    greedy tokens.  A replica split another way finds nothing to fetch.
    One process holds one group of ranks, so the same group plays the
    replica that takes over, its device KV overwritten by other work."""
    from engine.shards import held_by_every_shard
    from kvstore.directory import KVDirectory
    from kvstore.tier import ObjectStoreTier
    from tests.engine.helpers import drive

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    max_len = split.max_model_len

    def add(core: SchedulerCore, runner: ModelRunner, out: dict[str, list[int]],
            held: dict[str, int] | None = None) -> dict[str, int]:
        """Each job's tokens computed when it is added (those fetched)."""
        computed = {}
        for j, p in PROMPTS.items():
            job = Job(j, p, MAX_TOKENS, arrival_time=0.0)
            job.output_token_ids = list(out[j])
            core.add(job, host_blocks=held[j] if held else 0)
            computed[j] = job.num_computed_tokens
            runner.add_request(j, params, p, output_token_ids=out[j] or None)
        return computed

    want: dict[str, list[int]] = {j: [] for j in PROMPTS}
    core = make_core(False, max_len)
    add(core, whole, want)
    serve(whole, core, want)
    directory = KVDirectory.remote(split.world * 200)  # a slice of each block per rank
    tier = ObjectStoreTier(directory)
    split.set_kv_tier(tier)
    assert split.shards is not None
    split.shards.set_kv_tier(directory)  # type: ignore[attr-defined]
    got: dict[str, list[int]] = {j: [] for j in PROMPTS}
    try:
        core = make_core(True, max_len)
        add(core, split, got)
        serve(split, core, got, max_steps=14)
        # The checkpoint copies queued by then land (they are asynchronous:
        # on a loaded machine some had not within the 14 steps); what is
        # tested is the resume from them.
        tier.flush()
        split.shards.flush_kv_tier()  # type: ignore[attr-defined]
        # The replica dies: its jobs go, and other work overwrites its KV.
        for j in PROMPTS:
            split.remove_request(j)
        split.swapper = None
        filler = random_prompts([60, 60, 60, 60], seed=9)
        drive(split, filler, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              num_blocks=64, block_size=BLOCK, max_model_len=max_len, max_batch_tokens=32)
        assert all(0 < len(t) < MAX_TOKENS for t in got.values())
        held = {j: held_by_every_shard(tier.held, j, split.world) for j in PROMPTS}
        assert all(n > 0 for n in held.values())
        # Unsplit, or split four ways: none of these slices is of its shape.
        assert all(tier.held(j) == 0 and held_by_every_shard(tier.held, j, 4) == 0
                   for j in PROMPTS)
        split.set_kv_tier(tier)
        core = make_core(True, max_len)
        fetched = add(core, split, got, held)
        plans = serve(split, core, got)
    finally:
        split.swapper = None
    assert got == want
    assert core.swap.num_recompute_fallbacks == 0
    # Each job's first chunk after the resume starts where what it fetched
    # ends: only the tail past the checkpoints is recomputed.
    starts: dict[str, int] = {}
    for plan in plans:
        for job_id, start, _, kind in plan:
            if kind is None:
                starts.setdefault(job_id, start)
    assert starts == fetched and all(n > 0 for n in fetched.values())
