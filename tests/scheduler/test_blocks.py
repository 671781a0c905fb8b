"""Reference-counted KV blocks: sharing, freeing, invariants, eviction tallies."""

from __future__ import annotations

import pytest

from scheduler.blocks import BlockAccountingError, BlockManager, ReleaseTally
from tests.scheduler.conftest import make_job


def _leader_and_sibling(bm: BlockManager):
    leader, sib = make_job(14, 4, job_id="L"), make_job(14, 4, job_id="S")
    assert bm.grow(leader, 14)  # 4 blocks, the last one partial
    leader.num_computed_tokens = 14
    bm.share(sib, leader, 3)
    sib.num_computed_tokens = 12
    assert bm.grow(sib, 2)  # its own 4th block
    return leader, sib


def test_shared_blocks_return_to_the_pool_with_their_last_holder():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader, sib = _leader_and_sibling(bm)
    assert sib.block_table[:3] == leader.block_table[:3]
    assert sib.block_table[3] != leader.block_table[3]
    assert bm.num_used == 5 and bm.num_free == 3
    assert bm.num_exclusive(leader) == 1 and bm.num_exclusive(sib) == 1
    bm.check([leader, sib])
    assert bm.free(leader) == 1  # only its own block; the shared stay
    assert bm.num_exclusive(sib) == 4 and bm.num_holders(sib.block_table[0]) == 1
    bm.check([sib])
    assert bm.free(sib) == 4
    assert bm.num_free == 8
    bm.check([])


def test_check_catches_tables_that_disagree_with_the_holders():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader, sib = _leader_and_sibling(bm)
    with pytest.raises(BlockAccountingError):
        bm.check([leader])  # the sibling's references are unaccounted for
    sib.block_table.append(leader.block_table[3])  # forge a reference
    with pytest.raises(BlockAccountingError):
        bm.check([leader, sib])
    sib.block_table.pop()
    bm.check([leader, sib])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_freeing_a_block_another_job_holds_fails_and_changes_nothing(prefix_caching):
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=prefix_caching)
    a, b = make_job(8, 4, job_id="A"), make_job(8, 4, job_id="B")
    assert bm.grow(a, 8) and bm.grow(b, 8)
    b.block_table.append(a.block_table[1])  # forge a reference to a's block
    with pytest.raises(BlockAccountingError, match="held by"):
        bm.free(b)
    b.block_table.pop()
    bm.check([a, b])  # every block still held as before
    assert bm.free(b) == 2 and bm.free(a) == 2
    bm.check([])

def test_share_refuses_blocks_the_source_does_not_hold():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader, sib = _leader_and_sibling(bm)
    other = make_job(14, 4, job_id="O")
    with pytest.raises(BlockAccountingError):
        bm.share(sib, leader, 2)  # already has blocks
    with pytest.raises(BlockAccountingError):
        bm.share(other, leader, 5)  # more than the leader holds
    stolen = make_job(14, 4, job_id="T")
    stolen.block_table.append(leader.block_table[0])
    with pytest.raises(BlockAccountingError):
        bm.share(other, stolen, 1)


def test_release_tally_counts_shared_blocks_once_all_holders_go():
    bm = BlockManager(num_blocks=12, block_size=4)
    leader, sib = _leader_and_sibling(bm)
    third = make_job(14, 4, job_id="T")
    bm.share(third, leader, 3)  # 3 shared blocks now have 3 holders
    tally = ReleaseTally(bm)
    assert tally.take(third) == 0 and tally.freed == 0  # frees nothing alone
    assert not tally.frees_any(third)
    tally.add(third)  # forced in: it counts once its co-holders join
    assert tally.take(sib) == 1
    assert tally.take(leader) == 1 + 3
    assert tally.freed == 5 and tally.frees_any(third)
    # The tally predicts what freeing them all returns.
    assert sum(bm.free(j) for j in (third, sib, leader)) == 5
