from __future__ import annotations

import pytest

from scheduler.blocks import BlockAccountingError, BlockManager
from scheduler.job import InvalidTransition, JobState
from tests.scheduler.conftest import make_job


def test_state_machine_allows_only_documented_moves():
    j = make_job(3, 2)
    j.transition(JobState.RUNNING)
    j.transition(JobState.PREEMPTED)
    j.transition(JobState.RUNNING)
    j.transition(JobState.FINISHED)
    with pytest.raises(InvalidTransition):
        j.transition(JobState.RUNNING)
    w = make_job(3, 2)
    with pytest.raises(InvalidTransition):
        w.transition(JobState.FINISHED)


def test_token_slice_spans_prompt_and_output():
    j = make_job(3, 5, prompt=[1, 2, 3])
    j.output_token_ids += [7, 8]
    assert j.token_slice(0, 5) == [1, 2, 3, 7, 8]
    assert j.token_slice(2, 4) == [3, 7]
    assert j.token_slice(3, 5) == [7, 8]


def test_block_manager_grow_is_all_or_nothing_and_free_checks_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_job(8, 1), make_job(8, 1)
    assert bm.grow(a, 9)  # 3 blocks
    assert len(a.block_table) == 3 and bm.num_free == 1
    assert not bm.grow(b, 8)  # needs 2, has 1
    assert b.block_table == [] and bm.num_free == 1
    b.block_table.append(a.block_table[0])  # forge a stolen block
    with pytest.raises(BlockAccountingError):
        bm.free(b)
    b.block_table.clear()
    assert bm.free(a) == 3
    assert bm.num_free == 4
    bm.check()
