"""Siblings of one request (OpenAI `n` > 1) share the prompt's KV blocks:
hold, adopt, release, and what preemption does to shared blocks."""

from __future__ import annotations

import pytest

from scheduler.job import JobState
from scheduler.plan import BlockOpKind, Plan
from tests.scheduler.conftest import (
    FakeEngine, add_siblings, drain, make_core, make_job, step,
)

# A 30-token prompt in blocks of 4: 7 full blocks (28 tokens) before the last
# prompt position are shareable; each sibling computes the last 2 itself.
P, SHARED = 30, 28


def prompt_tokens_computed(plans: list[Plan], prompt_len: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        for c in p.chunks:
            n = max(0, min(c.start_pos + c.num_tokens, prompt_len) - c.start_pos)
            out[c.job_id] = out.get(c.job_id, 0) + n
    return out


def outputs_ok(*jobs) -> None:
    for j in jobs:
        assert j.state is JobState.FINISHED
        assert j.output_token_ids == [1000 + k for k in range(j.max_tokens)]


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_n_siblings_compute_one_prompt_plus_short_tails(clock, policy):
    core = make_core(clock, policy=policy)
    engine = FakeEngine(clock)
    leader = make_job(P, 5, job_id="L")
    core.add(leader)
    sibs = add_siblings(core, engine, leader, 3)
    first = step(core, engine)
    assert [c.job_id for c in first.chunks] == ["L"]  # siblings held meanwhile
    for s in sibs:  # adopted when the leader's prompt was computed
        assert s.block_table == leader.block_table[:7]
        assert s.num_computed_tokens == SHARED
    assert all(core.blocks.num_holders(b) == 4 for b in leader.block_table[:7])
    second = step(core, engine)
    assert {(c.job_id, c.start_pos, c.num_tokens) for c in second.chunks if c.job_id != "L"} == {
        (s.job_id, SHARED, P - SHARED) for s in sibs}
    # 7 shared blocks + one block of its own each, instead of 4 x 8.
    assert core.blocks.num_used == 7 + 4
    plans = [first, second] + drain(core, engine)
    computed = prompt_tokens_computed(plans, P)
    assert computed == {"L": P, **{s.job_id: P - SHARED for s in sibs}}
    assert core.stats().num_shared_prompt_tokens == 3 * SHARED
    outputs_ok(leader, *sibs)
    assert core.blocks.num_free == core.blocks.num_blocks


def test_sibling_is_held_until_the_leader_computed_the_shared_blocks(clock):
    core = make_core(clock, max_batch_tokens=8)
    engine = FakeEngine(clock)
    leader = make_job(P, 3, job_id="L")
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1)
    for done in (8, 16, 24):  # chunked prefill: 24 < 28 tokens, still held
        plan = step(core, engine)
        assert [c.job_id for c in plan.chunks] == ["L"]
        assert leader.num_computed_tokens == done and not s.block_table
        stats = core.stats()
        assert stats.num_waiting == 1 and core.policy.num_waiting() == 0
    step(core, engine)  # the last 6 prompt tokens
    assert s.num_computed_tokens == SHARED and core.policy.num_waiting() == 1
    plan = step(core, engine)
    assert [(c.job_id, c.start_pos, c.num_tokens) for c in plan.chunks] == [
        ("L", P, 1), ("L.1", SHARED, P - SHARED)]
    drain(core, engine)
    outputs_ok(leader, s)


@pytest.mark.parametrize("prompt_len, held", [(4, False), (5, True)])
def test_nothing_is_held_without_a_full_block_before_the_last_position(clock, prompt_len, held):
    core = make_core(clock)
    engine = FakeEngine(clock)
    leader = make_job(prompt_len, 2, job_id="L")
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1)
    assert core.sharing.is_held(s) is held
    plan = step(core, engine)
    assert [c.job_id for c in plan.chunks] == (["L"] if held else ["L", "L.1"])
    drain(core, engine)
    outputs_ok(leader, s)
    assert core.stats().num_shared_prompt_tokens == (4 if held else 0)


def test_sibling_added_after_the_leader_prefilled_shares_at_once(clock):
    core = make_core(clock)
    engine = FakeEngine(clock)
    leader = make_job(P, 4, job_id="L")
    core.add(leader)
    step(core, engine)
    (s,) = add_siblings(core, engine, leader, 1)
    assert not core.sharing.is_held(s)
    assert s.block_table == leader.block_table[:7] and s.num_computed_tokens == SHARED
    plan = step(core, engine)
    assert ("L.1", SHARED, P - SHARED) in {(c.job_id, c.start_pos, c.num_tokens) for c in plan.chunks}
    drain(core, engine)
    outputs_ok(leader, s)


def test_share_prompt_with_checks_its_arguments(clock):
    core = make_core(clock)
    core.add(make_job(P, 4, job_id="L"))
    with pytest.raises(ValueError, match="different prompts"):
        core.add(make_job(P + 1, 4, job_id="x"), share_prompt_with="L")
    with pytest.raises(ValueError, match="unknown"):
        core.add(make_job(P, 4, job_id="y"), share_prompt_with="nobody")
    assert set(core.jobs) == {"L"}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_aborting_the_leader_releases_held_siblings_unshared(clock, prefix_caching):
    core = make_core(clock, max_batch_tokens=8, prefix_caching=prefix_caching)
    engine = FakeEngine(clock)
    leader = make_job(P, 3, job_id="L")
    core.add(leader)
    sibs = add_siblings(core, engine, leader, 2)
    step(core, engine)
    assert core.abort("L")
    assert core.policy.num_waiting() == 2 and core.sharing.num_held == 0
    plan = step(core, engine)
    # The leader's two computed blocks were parked as it went: with the
    # prefix cache, the first sibling adopts them when it comes up.
    start = 8 if prefix_caching else 0
    assert [(c.job_id, c.start_pos) for c in plan.chunks] == [("L.1", start)]
    drain(core, engine)
    outputs_ok(*sibs)
    assert core.stats().num_shared_prompt_tokens == 0
    assert core.blocks.num_free == core.blocks.num_blocks


def test_aborting_a_held_sibling(clock):
    core = make_core(clock, max_batch_tokens=8)
    engine = FakeEngine(clock)
    leader = make_job(P, 3, job_id="L")
    core.add(leader)
    s1, s2 = add_siblings(core, engine, leader, 2)
    step(core, engine)
    assert core.abort(s1.job_id)
    assert s1.state is JobState.ABORTED and s1.job_id not in core.jobs
    assert core.sharing.num_held == 1 and core.stats().num_waiting == 1
    drain(core, engine)
    outputs_ok(leader, s2)
    assert core.num_aborted == 1 and core.stats().num_shared_prompt_tokens == SHARED
    assert core.blocks.num_free == core.blocks.num_blocks


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_siblings_keep_the_shared_blocks_when_the_leader_ends(clock, how):
    core = make_core(clock)
    engine = FakeEngine(clock)
    leader = make_job(P, 1 if how == "finish" else 5, job_id="L")
    core.add(leader)
    sibs = add_siblings(core, engine, leader, 2, max_tokens=5)
    step(core, engine)  # the leader's prefill (and, with max_tokens=1, its end)
    if how == "abort":
        core.abort("L")
    assert "L" not in core.jobs and not leader.block_table
    shared = sibs[0].block_table[:7]
    assert all(core.blocks.holders(b) == {"L.1", "L.2"} for b in shared)
    assert core.blocks.num_used == 7
    drain(core, engine)  # FakeEngine checks the siblings read the leader's KV
    outputs_ok(*sibs)
    assert core.blocks.num_free == core.blocks.num_blocks


def _leader_behind_a_long_job(clock, mode: str):
    """FCFS, 16 blocks: `a` is admitted first; the leader prefills beside
    it in 7-token chunks and is evicted when `a` outgrows the cache."""
    host = 64 if mode != "recompute" else 0
    # Without the prefix cache: the siblings, let go unshared, each
    # prefill alone (with it, they would find each other's blocks).
    core = make_core(clock, num_blocks=16, max_batch_tokens=8, swap_mode=mode,
                     host_kv_blocks=host, prefix_caching=False)
    engine = FakeEngine(clock)
    a = make_job(36, 20, job_id="a")
    leader = make_job(P, 6, job_id="L")
    core.add(a)
    core.add(leader)
    return core, engine, a, leader


@pytest.mark.parametrize("mode", ["recompute", "reactive"])
def test_leader_evicted_before_the_shared_blocks_releases_its_siblings(clock, mode):
    core, engine, a, leader = _leader_behind_a_long_job(clock, mode)
    sibs = add_siblings(core, engine, leader, 2)
    while True:
        computed = leader.num_computed_tokens
        plan = step(core, engine)
        if "L" in plan.preempted:
            break
        assert core.sharing.num_held == 2
    assert 0 < computed < SHARED
    assert core.sharing.num_held == 0 and all(not s.block_table for s in sibs)
    if mode == "reactive":
        assert leader.num_host_blocks > 0
    plans = drain(core, engine)
    firsts = {}
    for p in plans:
        for c in p.chunks:
            firsts.setdefault(c.job_id, c.start_pos)
    assert firsts["L.1"] == 0 and firsts["L.2"] == 0  # each prefilled alone
    assert core.stats().num_shared_prompt_tokens == 0
    outputs_ok(a, leader, *sibs)
    assert core.blocks.num_free == 16 and core.swap.host_used == 0


@pytest.mark.parametrize("mode", ["recompute", "reactive"])
def test_evicted_sibling_drops_only_its_references(clock, mode):
    # 16 blocks; the leader and two siblings grow to 45 tokens each; FCFS
    # evicts the most recently admitted sibling first.
    host = 64 if mode != "recompute" else 0
    core = make_core(clock, num_blocks=16, swap_mode=mode, host_kv_blocks=host)
    engine = FakeEngine(clock)
    leader = make_job(P, 15, job_id="L")
    core.add(leader)
    sibs = add_siblings(core, engine, leader, 2)
    shared = None
    while True:
        plan = core.schedule()
        if plan.preempted:
            break
        core.complete(plan, engine.execute(plan))
        shared = leader.block_table[:7]
    assert plan.preempted == ["L.2"]
    victim = sibs[1]
    assert not victim.block_table
    assert all(core.blocks.holders(b) == {"L", "L.1"} for b in shared)
    core.blocks.check(core.jobs.values())
    outs = [op for op in plan.block_ops if op.kind is BlockOpKind.SWAP_OUT]
    if mode == "reactive":
        # The host copy is the victim's own: all its blocks, shared or not.
        assert [b for op in outs for b in op.device_blocks][:7] == shared
        assert victim.num_host_blocks == sum(op.num_blocks for op in outs) > 7
    else:
        assert outs == [] and victim.num_computed_tokens == 0
    core.complete(plan, engine.execute(plan))
    drain(core, engine)
    outputs_ok(leader, *sibs)
    assert core.blocks.num_free == 16 and core.swap.host_used == 0


def test_evicted_leader_frees_only_its_exclusive_blocks(clock):
    # The leader is the least important job, so FCFS evicts it first.  (The
    # siblings come once it has prefilled: they would not wait for it.)
    core = make_core(clock, num_blocks=16)
    engine = FakeEngine(clock)
    leader = make_job(P, 15, job_id="L", priority=1)
    core.add(leader)
    step(core, engine)
    sibs = add_siblings(core, engine, leader, 2)
    assert all(s.num_computed_tokens == SHARED for s in sibs)
    while True:
        table = list(leader.block_table)
        plan = core.schedule()
        if plan.preempted:
            break
        core.complete(plan, engine.execute(plan))
    assert plan.preempted == ["L"] and leader.num_computed_tokens == 0
    assert core.blocks.owned_by("L") == []
    assert all(core.blocks.holders(b) == {"L.1", "L.2"} for b in table[:7])
    core.complete(plan, engine.execute(plan))
    drain(core, engine)
    outputs_ok(leader, *sibs)
    assert core.blocks.num_free == 16


@pytest.mark.parametrize("mode", ["recompute", "reactive"])
def test_mlfq_evicts_enough_idle_jobs_when_blocks_are_shared(clock, mode):
    # Idle leader and sibling hold 9 blocks (7 shared); a more important
    # job needs 10 of the 16.  Evicting either one frees a single block;
    # evicting both frees all 9.
    host = 64 if mode != "recompute" else 0
    core = make_core(clock, policy="mlfq", num_blocks=16, max_batch_size=1,
                     swap_mode=mode, host_kv_blocks=host)
    engine = FakeEngine(clock)
    leader = make_job(P, 20, job_id="L")
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1)
    while s.num_computed_tokens < P or leader.num_computed_tokens < P:
        step(core, engine)
    assert core.blocks.num_used == 9
    urgent = make_job(40, 2, job_id="urgent", priority=-1)
    core.add(urgent)
    plan = step(core, engine)
    assert [c.job_id for c in plan.chunks] == ["urgent"]
    assert sorted(plan.preempted) == ["L", "L.1"]
    drain(core, engine)
    outputs_ok(leader, s, urgent)
    assert core.blocks.num_free == 16 and core.swap.host_used == 0


def test_proactive_reserve_keeps_an_idle_sibling_that_would_free_nothing(clock):
    # The sibling is less important, so it idles on its 7 adopted blocks:
    # swapping it out would copy 7 blocks and free none.
    core = make_core(clock, policy="mlfq", num_blocks=16, max_batch_size=1,
                     swap_mode="proactive", host_kv_blocks=64, reserve_blocks=16)
    engine = FakeEngine(clock)
    leader = make_job(P, 4, job_id="L")
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1, priority=1)
    step(core, engine)
    plan = step(core, engine)
    assert [c.job_id for c in plan.chunks] == ["L"]
    assert not [op for op in plan.block_ops if op.job_id == "L.1"]
    assert s.block_table == leader.block_table[:7] and s.is_resident
    drain(core, engine)
    outputs_ok(leader, s)
    assert core.blocks.num_free == 16 and core.swap.host_used == 0


def test_fcfs_reclaims_a_waiting_siblings_blocks_once_its_leader_is_gone(clock):
    # The leader ends at its first token; its sibling waits on the 7 blocks
    # it adopted while a more important job needs 10 of the 9 left.  Only
    # evicting the waiting sibling lets anyone run.
    core = make_core(clock, num_blocks=16, max_batch_size=1)
    engine = FakeEngine(clock)
    leader = make_job(P, 1, job_id="L")
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1, max_tokens=3)
    step(core, engine)
    assert "L" not in core.jobs and core.blocks.num_used == 7 and s.block_table
    core.add(make_job(40, 2, job_id="urgent", priority=-1))
    plan = step(core, engine)
    assert [c.job_id for c in plan.chunks] == ["urgent"] and plan.preempted == ["L.1"]
    assert not s.block_table and s.num_computed_tokens == 0
    drain(core, engine)
    outputs_ok(s)
    assert core.blocks.num_free == 16


def test_a_sibling_does_not_wait_for_a_less_important_leader(clock):
    core = make_core(clock, max_batch_tokens=8)
    engine = FakeEngine(clock)
    leader = make_job(P, 3, job_id="L", priority=1)
    core.add(leader)
    (s,) = add_siblings(core, engine, leader, 1, priority=0)
    assert not core.sharing.is_held(s)
    plan = step(core, engine)
    assert [(c.job_id, c.start_pos) for c in plan.chunks] == [("L.1", 0)]


def test_sharing_with_a_held_sibling_means_sharing_with_its_leader(clock):
    core = make_core(clock, max_batch_tokens=8)
    engine = FakeEngine(clock)
    leader = make_job(P, 3, job_id="L")
    core.add(leader)
    (s1,) = add_siblings(core, engine, leader, 1)
    s2 = make_job(P, 3, job_id="S2", prompt=list(leader.prompt_token_ids))
    engine.share_prompt("S2", "L", P)
    core.add(s2, share_prompt_with="L.1")
    assert core.sharing.is_held(s1) and core.sharing.is_held(s2)
    while leader.num_computed_tokens < P:
        step(core, engine)
    assert s1.block_table == s2.block_table == leader.block_table[:7]
    drain(core, engine)
    outputs_ok(leader, s1, s2)
