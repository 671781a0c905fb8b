"""The free pool hands a job its blocks in runs of consecutive ids
(scheduler/free_blocks.py) without holding any block back."""

from __future__ import annotations

import random

import pytest

from scheduler.blocks import BlockManager
from scheduler.free_blocks import FreeBlocks
from scheduler.job import Job


def _runs(table: list[int]) -> list[int]:
    """Lengths of the runs of consecutive ids in a block table."""
    runs = [1]
    for a, b in zip(table, table[1:]):
        if b == a + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def _job(i: int, prompt_len: int = 40) -> Job:
    return Job(job_id=f"j{i}", prompt_token_ids=list(range(prompt_len)), max_tokens=4096,
               arrival_time=0.0)


def _grow_together(block_run: int) -> list[Job]:
    """Thirty jobs of a 40-token prompt (3 blocks of 16), then a token each
    per step for 400 steps, as a decode batch grows."""
    bm = BlockManager(num_blocks=4096, block_size=16, block_run=block_run)
    jobs = [_job(i) for i in range(30)]
    for j in jobs:
        assert bm.grow(j, 40)
        j.num_computed_tokens = 40
    for _ in range(400):
        for j in jobs:
            assert bm.grow(j, 1)
            j.num_computed_tokens += 1
    bm.check(jobs)
    return jobs


def test_jobs_growing_together_get_runs_not_interleaved_blocks() -> None:
    for j in _grow_together(block_run=8):
        runs = _runs(j.block_table)
        # 440 tokens = 28 blocks: the prompt's 3 and the 7 set aside after
        # them make a first run of 10, then runs of 8.
        assert len(j.block_table) == 28
        assert min(runs[:-1]) >= 8, (j.job_id, runs)
    # First come, first served (run=1): the decodes' blocks interleave.
    assert max(max(_runs(j.block_table)[1:]) for j in _grow_together(block_run=1)) == 1


def test_nothing_is_held_back_when_the_pool_runs_short() -> None:
    # Every free block set aside for other jobs: a new job still gets all of them.
    bm = BlockManager(num_blocks=64, block_size=16)
    jobs = [_job(i, prompt_len=16) for i in range(8)]
    for j in jobs:
        assert bm.grow(j, 16)
        j.num_computed_tokens = 16
    assert bm.num_free == 56
    late = _job(99, prompt_len=56 * 16)
    assert bm.grow(late, 56 * 16)
    assert bm.num_free == 0 and len(late.block_table) == 56
    assert not bm.grow(jobs[0], 17)
    bm.check([*jobs, late])


def test_a_freed_block_is_reused_after_the_rest_of_the_pool() -> None:
    bm = BlockManager(num_blocks=32, block_size=16, block_run=1)
    a, b = _job(1, 16), _job(2, 16)
    assert bm.grow(a, 16)
    first = a.block_table[0]
    bm.free(a)
    taken = []
    for i in range(31):
        j = _job(10 + i, 16)
        assert bm.grow(j, 16)
        taken += j.block_table
    assert first not in taken
    assert bm.grow(b, 16) and b.block_table == [first]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_grow_and_free_keep_the_accounting(prefix_caching: bool) -> None:
    rng = random.Random(7)
    bm = BlockManager(num_blocks=200, block_size=16, prefix_caching=prefix_caching)
    live: list[Job] = []
    for step in range(3000):
        if live and rng.random() < 0.15:
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.3:
            j = _job(step, rng.randint(1, 120))
            if bm.grow(j, len(j.prompt_token_ids)):
                j.num_computed_tokens = len(j.prompt_token_ids)
                live.append(j)
        elif live:
            j = rng.choice(live)
            if bm.grow(j, 1):
                j.output_token_ids.append(step)  # the token the step computes
                j.num_computed_tokens += 1
        if step % 100 == 0:
            bm.check(live)
    bm.check(live)
    for j in live:
        bm.free(j)
    bm.check([])
    assert bm.num_free == 200


def test_the_queue_is_compacted_and_stays_consistent() -> None:
    pool = FreeBlocks(16, run=4)
    for i in range(200):
        got = pool.take(f"o{i}", None, 4)
        pool.give_back(got)
        assert len(pool._queue) <= 4 * 16 + 4
    assert pool.check() == set(range(16))


def test_run_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="run"):
        FreeBlocks(8, run=0)
