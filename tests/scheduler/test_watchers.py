"""Followers of the block manager's holders and the swap manager's host
copies learn of every job that joined or left, and of nothing else."""

from __future__ import annotations

from scheduler.blocks import BlockManager
from scheduler.swap import SwapManager
from tests.scheduler.conftest import make_job


def test_holding_watchers_see_joins_and_leaves_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = make_job(8, 4, job_id="a"), make_job(8, 4, job_id="b")
    assert bm.grow(a, 8)
    early = bm.watch_holding()
    assert early == {"a"}  # the members at the time it started following
    early.clear()
    late = bm.watch_holding()
    late.clear()
    assert bm.grow(a, 4)  # a holds more: not a change of membership
    assert early == set() and late == set()
    assert bm.grow(b, 8)
    bm.free(a)
    assert early == late == {"a", "b"}
    early.clear()
    assert late == {"a", "b"}  # each follower empties its own set
    bm.free(b)
    assert early == {"b"}


def test_host_watchers_see_swaps_out_and_in():
    bm = BlockManager(num_blocks=16, block_size=4)
    swap = SwapManager(bm, host_capacity_blocks=16)
    a = make_job(8, 4, job_id="a")
    assert bm.grow(a, 8)
    a.num_computed_tokens = 8
    seen = swap.watch_on_host()
    swap.swap_out(a)
    assert seen == {"a"} and swap.host_only == {"a"}
    seen.clear()
    swap.swap_in(a)  # in flight: still on the host, no longer host-only
    assert seen == set() and swap.host_only == set()
    swap.swap_in_done(a)
    assert seen == {"a"} and "a" not in swap.on_host
