"""Prefix caching in the scheduler (scheduler/prefix_cache.py): what a job
adopts, what stays parked, what is evicted first, and that parked blocks
never cost a running job its memory.  The fake engine checks that every
position a job reads holds its own tokens' KV."""

from __future__ import annotations

from scheduler.job import Job
from scheduler.prefix_cache import PrefixCache
from tests.scheduler.conftest import FakeEngine, drain, make_core, make_job, step

BS = FakeEngine.block_size
SYSTEM = [900 + i for i in range(3 * BS)]


def _job(job_id: str, tokens: list[int], max_tokens: int = 3) -> Job:
    return make_job(len(tokens), max_tokens, job_id=job_id, prompt=list(tokens))


def test_a_later_job_adopts_the_full_blocks_of_an_ended_one(clock):
    core, engine = make_core(clock), FakeEngine(clock)
    first = _job("a", SYSTEM + [1, 2, 3])
    core.add(first)
    drain(core, engine)
    assert core.stats().num_cached_blocks == 4  # 3 of the prompt, 1 with outputs
    later = _job("b", SYSTEM + [4, 5])
    core.add(later)
    assert later.num_computed_tokens == len(SYSTEM)
    assert core.blocks.num_used == 3 and core.stats().num_cached_blocks == 1
    drain(core, engine)
    assert later.output_token_ids == [1000, 1001, 1002]
    stats = core.stats()
    assert stats.num_prefix_hit_tokens == len(SYSTEM)
    assert stats.num_prefix_queried_tokens == len(first.prompt_token_ids) + len(
        later.prompt_token_ids)
    core.blocks.check()


def test_a_job_always_computes_its_last_token(clock):
    core, engine = make_core(clock), FakeEngine(clock)
    core.add(_job("a", SYSTEM))
    drain(core, engine)
    again = _job("b", SYSTEM)  # the same prompt, exactly three blocks
    core.add(again)
    assert again.num_computed_tokens == 2 * BS
    plan = step(core, engine)
    (chunk,) = plan.chunks
    assert chunk.start_pos == 2 * BS and chunk.sample


def test_a_conversation_adopts_its_earlier_turn_with_the_answer(clock):
    core, engine = make_core(clock), FakeEngine(clock)
    turn1 = _job("t1", SYSTEM + [1, 2], max_tokens=7)
    core.add(turn1)
    drain(core, engine)
    # Its last token was sampled, never fed back: computed up to the one before.
    computed = len(turn1.prompt_token_ids) + 7 - 1
    turn2 = _job("t2", turn1.prompt_token_ids + turn1.output_token_ids + [5, 6, 7])
    core.add(turn2)
    assert turn2.num_computed_tokens == computed // BS * BS
    drain(core, engine)
    core.blocks.check()


def test_jobs_running_together_share_a_computed_prefix(clock):
    core, engine = make_core(clock), FakeEngine(clock)
    a = _job("a", SYSTEM + [1], max_tokens=20)
    core.add(a)
    step(core, engine)
    b = _job("b", SYSTEM + [2], max_tokens=20)
    core.add(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert core.blocks.num_exclusive(a) == len(a.block_table) - 3
    assert core.blocks.num_exclusive(b) == len(b.block_table) - 3
    core.blocks.check(core.jobs.values())
    drain(core, engine)
    core.blocks.check()


def test_the_same_block_after_another_prefix_is_not_a_hit(clock):
    core, engine = make_core(clock), FakeEngine(clock)
    core.add(_job("a", [1] * BS + SYSTEM))
    drain(core, engine)
    other = _job("b", [2] * BS + SYSTEM)
    core.add(other)
    assert other.num_computed_tokens == 0


def test_parked_blocks_count_as_free_and_go_least_recent_first(clock):
    core = make_core(clock, num_blocks=16, max_model_len=64)
    engine = FakeEngine(clock)
    old, new = _job("old", [1] * (3 * BS) + [9]), _job("new", [2] * (3 * BS) + [9])
    core.add(old)
    drain(core, engine)
    core.add(new)
    drain(core, engine)
    # Three full blocks each (their last token was never fed back).
    assert core.blocks.num_free == 16 and core.stats().num_cached_blocks == 6
    # Takes every free block and two parked ones: old's, tail first.
    big = _job("big", [3] * (12 * BS), max_tokens=2)
    core.add(big)
    step(core, engine)
    assert core.num_preemptions == 0
    assert core.stats().num_cached_blocks == 4
    drain(core, engine)
    # old's blocks went first, tail first; new kept all of its own.
    again_old, again_new = _job("o2", [1] * (3 * BS) + [9]), _job("n2", [2] * (3 * BS) + [9])
    core.add(again_old)
    core.add(again_new)
    assert again_old.num_computed_tokens < 3 * BS
    assert again_new.num_computed_tokens == 3 * BS
    drain(core, engine)
    core.blocks.check()


def test_a_reused_block_does_not_lead_to_the_tail_of_its_old_content():
    """Keys chain by serials that are never reused: once a head is evicted
    and its block holds other tokens, the old tail it led to cannot match
    behind the new content."""
    cache = PrefixCache(BS)
    a = _job("a", [1] * BS + [2] * BS + [3])
    a.block_table[:] = [7, 8]
    a.num_computed_tokens = 2 * BS
    cache.index(a, a.num_computed_tokens)
    cache.forget(a)
    cache.park(7)  # the head is let go first, so it is evicted first
    cache.park(8)
    assert cache.evict() == 7 and cache.num_parked == 1
    b = _job("b", [5] * BS + [6])
    b.block_table[:] = [7]  # block 7 reused for other tokens
    b.num_computed_tokens = BS
    cache.index(b, b.num_computed_tokens)
    # b's head, then a's old second block's tokens: only the head matches.
    c = _job("c", [5] * BS + [2] * BS + [3])
    assert cache.match(c) == [7]
    assert cache.match(_job("d", [1] * BS + [2] * BS + [3])) == []


def test_no_adoption_when_asked_or_when_off(clock):
    for core, kw in ((make_core(clock), {"use_prefix_cache": False}),
                     (make_core(clock, prefix_caching=False), {})):
        engine = FakeEngine(clock)
        core.add(_job("a", SYSTEM + [1]))
        drain(core, engine)
        b = _job("b", SYSTEM + [2])
        core.add(b, **kw)
        assert b.num_computed_tokens == 0
        drain(core, engine)
    assert core.blocks.prefix is None and core.stats().num_cached_blocks == 0


def test_a_recomputed_job_is_not_given_its_own_blocks_back_while_queued(clock):
    """A job preempted for recomputation does not hold parked blocks while
    it waits: the memory its preemption freed stays free."""
    core = make_core(clock, policy="fcfs", num_blocks=16, max_model_len=64,
                     max_batch_tokens=64)
    engine = FakeEngine(clock)
    a = _job("a", [1] * (6 * BS), max_tokens=20)
    b = _job("b", [2] * (6 * BS), max_tokens=20)
    core.add(a)
    core.add(b)
    while not core.num_preemptions:
        step(core, engine)
    victim = a if a.num_preemptions else b
    assert not victim.block_table and victim.num_computed_tokens == 0
    drain(core, engine)
    assert victim.output_token_ids == [1000 + k for k in range(20)]
    core.blocks.check()


def test_a_salt_shares_blocks_only_within_itself(clock):
    """vLLM's `cache_salt`: a tenant's requests share their prefixes with
    each other and with nobody else."""
    core, engine = make_core(clock), FakeEngine(clock)
    a = _job("a", SYSTEM + [1])
    a.cache_salt = "tenant-1"
    core.add(a)
    drain(core, engine)
    for salt, expected in ((None, 0), ("tenant-2", 0), ("tenant-1", len(SYSTEM))):
        b = _job(f"b-{salt}", SYSTEM + [2])
        b.cache_salt = salt
        core.add(b)
        assert b.num_computed_tokens == expected, salt
        drain(core, engine)
    core.blocks.check()
