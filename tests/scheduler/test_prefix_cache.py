"""Prefix caching in the scheduler (scheduler/prefix_cache.py): what a job
adopts, what stays parked, what is evicted first, and that parked blocks
never cost a running job its memory.  The fake engine checks that every
position a job reads holds its own tokens' KV."""

from __future__ import annotations

import pytest

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
    assert cache.park([7]) == []  # the head is let go first, so it is evicted first
    assert cache.park([8]) == []
    assert cache.evict_many(1) == [7] and cache.num_parked == 1
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


# Looked up again when a job starts ------------------------------------------

_CONSERVE = {"tpot_slo_s": 10.0, "ttft_slo_s": 10.0}


@pytest.mark.parametrize("policy", ["fcfs", "mlfq", "conserve", "econoserve"])
def test_a_burst_computes_its_shared_prompt_once(clock, policy):
    """Jobs arriving together, before anyone has computed the prompt they
    share: those that start after the first prefill adopt its blocks."""
    kw = {"conserve": _CONSERVE} if policy == "conserve" else {}
    core = make_core(clock, policy=policy, max_batch_tokens=len(SYSTEM) + 2, **kw)
    engine = FakeEngine(clock)
    jobs = [_job(f"j{i}", SYSTEM + [i + 1, i + 2], max_tokens=4) for i in range(4)]
    for job in jobs:
        core.add(job)
        assert job.num_computed_tokens == 0  # nothing cached when they came
    plans = drain(core, engine)
    firsts: dict[str, int] = {}
    for plan in plans:
        for c in plan.chunks:
            firsts.setdefault(c.job_id, c.start_pos)
    assert sorted(firsts.values()) == [0, len(SYSTEM), len(SYSTEM), len(SYSTEM)]
    for job in jobs:
        assert job.output_token_ids == [1000, 1001, 1002, 1003]
        assert job.num_cached_tokens == firsts[job.job_id]
    stats = core.stats()
    assert stats.num_prefix_hit_tokens == 3 * len(SYSTEM)
    assert stats.num_prefix_hit_tokens <= stats.num_prefix_queried_tokens
    core.blocks.check()


@pytest.mark.parametrize("policy", ["fcfs", "mlfq", "conserve", "econoserve"])
def test_a_job_short_of_room_beside_its_adopted_blocks_is_left_as_it_was(clock, policy):
    """With no room for the rest of its prompt, the blocks it adopted go
    back parked, its counts and the cache's statistics as before; the
    policy then treats it as it would without the cache."""
    kw: dict = {"conserve": _CONSERVE} if policy == "conserve" else {}
    if policy == "econoserve":  # its prompts in arrival order, as the others'
        kw["econoserve"] = {"ordering": False, "pt_reserve": 0.0}
    core = make_core(clock, policy=policy, num_blocks=8, max_model_len=32,
                     max_batch_tokens=64, **kw)
    engine = FakeEngine(clock)
    a = _job("a", SYSTEM + [1], max_tokens=1)
    hog = _job("hog", [7] * (4 * BS), max_tokens=12)
    late = _job("w", SYSTEM + [2] * (3 * BS))  # 3 blocks a computes, 3 more
    for job in (a, hog, late):
        core.add(job)
    assert late.num_computed_tokens == 0  # nothing cached yet
    plan = step(core, engine)  # a and hog fill the cache; a ends
    assert {c.job_id for c in plan.chunks} == {"a", "hog"}
    assert core.stats().num_cached_blocks == 3
    before = core.stats()
    plan = step(core, engine)
    mine = [c for c in plan.chunks if c.job_id == "w"]
    # Planned only as it would be without the cache (conserve's chunk into
    # the free blocks), never on the adopted blocks it had no room beside.
    assert all(c.start_pos == 0 for c in mine)
    after = core.stats()
    assert after.num_prefix_hit_tokens == before.num_prefix_hit_tokens
    assert after.num_prefix_queried_tokens == before.num_prefix_queried_tokens
    core.blocks.check(core.jobs.values())
    drain(core, engine)
    assert late.output_token_ids == [1000, 1001, 1002]
    core.blocks.check()


def test_a_job_that_found_nothing_is_not_looked_up_again_for_nothing(clock, monkeypatch):
    """Until a block is indexed, a lookup that found nothing would find
    nothing again (evictions only take entries away): it is skipped."""
    core, engine = make_core(clock), FakeEngine(clock)
    calls: list[str] = []
    match = PrefixCache.match

    def counted(self, job, count=True):
        calls.append(job.job_id)
        return match(self, job, count)

    monkeypatch.setattr(PrefixCache, "match", counted)
    blocks = core.blocks
    w = _job("w", SYSTEM + [1])  # never added: looked up by hand
    assert blocks.claim_cached(w) == 0 and calls == ["w"]
    assert blocks.reclaim_cached(w) is None and calls == ["w"]
    core.add(_job("x", [3] * (2 * BS) + [1]))
    drain(core, engine)  # indexes two blocks, none of them w's
    assert blocks.reclaim_cached(w) is None and calls == ["w", "x", "w"]
    assert blocks.reclaim_cached(w) is None and calls == ["w", "x", "w"]
    core.add(_job("y", SYSTEM + [2]))
    drain(core, engine)
    parked = core.stats().num_cached_blocks
    adopted = blocks.reclaim_cached(w)
    assert adopted is not None and adopted.num_blocks == 3
    assert w.num_computed_tokens == len(SYSTEM) == w.num_cached_tokens
    blocks.undo_adoption(w, adopted)
    assert w.num_computed_tokens == 0 == w.num_cached_tokens and not w.block_table
    assert core.stats().num_cached_blocks == parked
    blocks.check()


def test_a_job_needing_every_prompt_logit_never_adopts(clock):
    core = make_core(clock, policy="fcfs", max_batch_tokens=len(SYSTEM) + 1)
    engine = FakeEngine(clock)
    a, b = _job("a", SYSTEM + [1]), _job("b", SYSTEM + [2])
    core.add(a)
    core.add(b, use_prefix_cache=False)
    plans = drain(core, engine)
    assert [c.start_pos for p in plans for c in p.chunks if c.job_id == "b"][0] == 0
    assert b.num_cached_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_a_job_preempted_for_recomputation_gets_its_parked_blocks_back(clock, policy):
    """While it waits it holds nothing (the memory its preemption freed
    stays free); when it starts again it adopts those of its blocks still
    parked."""
    core = make_core(clock, policy=policy, num_blocks=16, max_model_len=64,
                     max_batch_tokens=64, swap_mode="recompute")
    engine = FakeEngine(clock)
    a = _job("a", [1] * (4 * BS), max_tokens=24)
    b = _job("b", [2] * (4 * BS), max_tokens=24)
    core.add(a)
    core.add(b)
    while not core.num_preemptions:
        step(core, engine)
    victim = a if a.num_preemptions else b
    assert not victim.block_table and victim.num_computed_tokens == 0
    computed = victim.num_tokens - 1
    restarts = []
    while core.has_work:
        plan = step(core, engine)
        restarts += [c.start_pos for c in plan.chunks
                     if c.job_id == victim.job_id and not restarts]
    # Nothing else needed its blocks meanwhile past the prompt's head.
    assert restarts and restarts[0] > 0 and restarts[0] % BS == 0
    assert restarts[0] <= computed // BS * BS
    assert victim.output_token_ids == [1000 + k for k in range(24)]
    assert victim.num_cached_tokens == 0  # its own KV, not a cache hit
    core.blocks.check()


def test_a_swap_in_short_of_room_leaves_its_parked_blocks_as_they_were():
    """`keep_for_swap_in` takes a job's still-cached leading blocks only when
    the rest of its blocks can be had; a swap-in that must wait changes
    nothing: no block taken and given back, no parked block moved in the
    eviction order, no change for the policies' holding followers."""
    from scheduler.blocks import BlockManager

    blocks = BlockManager(12, BS, prefix_caching=True)
    job = _job("j", [1] * (6 * BS) + [9])
    late = _job("l", [2] * (2 * BS) + [9])
    for j in (job, late):
        assert blocks.grow(j, j.num_tokens - 1)
        j.num_computed_tokens = j.num_tokens - 1
    own, later = list(job.block_table), list(late.block_table)
    blocks.free(job)  # swapped out: its six blocks parked, tail first
    blocks.free(late)
    hog = _job("h", [3] * (7 * BS) + [9])
    assert blocks.grow(hog, 7 * BS)  # the four free blocks, then job's last three
    parked = blocks.prefix.parked()
    assert parked == own[2::-1] + later[::-1] and blocks.num_free == 5
    followed = blocks.watch_holding()
    followed.clear()
    # Six blocks wanted: its first three, still parked (they leave the free
    # count), and three fresh, of which two are left.
    assert blocks.keep_for_swap_in(job, 6) is None
    assert not job.block_table and blocks.prefix.parked() == parked
    assert not followed and blocks.num_free == 5
    blocks.free(hog)
    assert blocks.keep_for_swap_in(job, 6) == 3
    assert job.block_table == own[:3] and blocks.num_free == 9
    blocks.take(job, 3)
    blocks.check()


def test_evicting_many_takes_the_longest_parked_first_and_unindexes_them():
    cache = PrefixCache(BS)
    a = _job("a", [1] * BS + [2] * BS + [3] * BS + [4])
    a.block_table[:] = [5, 6, 7]
    a.num_computed_tokens = 3 * BS
    cache.index(a, a.num_computed_tokens)
    cache.forget(a)
    assert cache.park([5, 6, 7, 99]) == [99]  # tail first; 99 is not indexed
    assert cache.evict_many(2) == [7, 6] and cache.parked() == [5]
    assert not cache.is_indexed(7) and not cache.is_indexed(6) and cache.is_indexed(5)
    # Only the head is still found.
    assert cache.match(_job("b", [1] * BS + [2] * BS + [3] * BS + [4])) == [5]



def test_a_job_swapped_back_in_is_indexed_again_without_reading_its_tokens_again(monkeypatch):
    """A job swapped out whose parked blocks were evicted meanwhile comes back
    in fresh blocks; they are indexed again from what the cache read of its
    tokens the first time (`Job.block_tokens`), not read and packed anew,
    and a later job with the same tokens finds the new blocks."""
    from scheduler.blocks import BlockManager

    blocks = BlockManager(8, BS, prefix_caching=True)
    job = _job("j", [1] * BS + [2] * BS + [3] * BS + [4])
    assert blocks.grow(job, 3 * BS)
    job.num_computed_tokens = 3 * BS
    blocks.free(job)  # swapped out: three blocks indexed, parked
    read = list(job.block_tokens)
    assert len(read) == 3
    hog = _job("h", [5] * (8 * BS) + [9])
    assert blocks.grow(hog, 8 * BS)  # every block, the parked ones evicted
    assert blocks.prefix.num_parked == 0
    blocks.free(hog)
    packed: list[tuple[int, ...]] = []
    monkeypatch.setattr(blocks.prefix, "_pack", lambda *ids: packed.append(ids) or b"")
    assert blocks.keep_for_swap_in(job, 3) == 0  # nothing of its own left: one block looked up
    blocks.take(job, 3)
    fresh = list(job.block_table)
    blocks.prefix.index(job, job.num_computed_tokens)
    assert not packed and all(a is b for a, b in zip(job.block_tokens, read, strict=True))
    monkeypatch.undo()
    later = _job("l", [1] * BS + [2] * BS + [3] * BS + [8])
    assert blocks.prefix.match(later) == fresh
    blocks.check()


def test_a_block_with_a_token_in_flight_is_read_once_the_token_lands():
    """A block holding a token still in flight (scheduler/ahead.py) is neither
    indexed nor remembered; once the token lands it is read as it is."""
    from scheduler.plan import PENDING_TOKEN

    cache = PrefixCache(BS)
    job = _job("a", [1] * (BS + BS // 2))
    job.output_token_ids = [2] * (BS // 2 - 1) + [PENDING_TOKEN]
    job.block_table[:] = [4, 5]
    job.num_computed_tokens = 2 * BS
    cache.index(job, job.num_computed_tokens)
    assert cache.is_indexed(4) and not cache.is_indexed(5) and len(job.block_tokens) == 1
    job.output_token_ids[-1] = 3
    cache.index(job, job.num_computed_tokens)
    assert cache.is_indexed(5) and len(job.block_tokens) == 2
    later = _job("b", [1] * (BS + BS // 2) + [2] * (BS // 2 - 1) + [3, 6])
    assert cache.match(later) == [4, 5]


def test_contents_whose_hashes_collide_are_never_confused(monkeypatch):
    """Keys hold a hash of the tokens; a hit compares the tokens, so where
    every hash collides a content matches only itself, and a second content
    under the same predecessor is simply not indexed."""
    import scheduler.prefix_cache as module

    monkeypatch.setattr(module, "hash", lambda tokens: 0, raising=False)
    cache = PrefixCache(BS)
    a = _job("a", [1] * BS + [2] * BS + [3])
    a.block_table[:] = [5, 6]
    a.num_computed_tokens = 2 * BS
    cache.index(a, a.num_computed_tokens)
    b = _job("b", [4] * BS + [6])
    b.block_table[:] = [9]
    b.num_computed_tokens = BS
    cache.index(b, b.num_computed_tokens)
    assert cache.is_indexed(5) and cache.is_indexed(6) and not cache.is_indexed(9)
    assert cache.match(_job("c", [1] * BS + [2] * BS + [7])) == [5, 6]
    assert cache.match(_job("d", [4] * BS + [6])) == []
    assert cache.match(_job("e", [1] * BS + [4] * BS + [3])) == [5]


def test_a_token_id_past_64_bits_is_cached_exactly():
    """Blocks are packed as 64-bit ids; one that does not fit (nothing the
    ingress admits) is kept as it is, found again and never confused."""
    cache = PrefixCache(BS)
    big = 2**64 + 5
    a = _job("a", [big] * BS + [1] * BS + [2])
    a.block_table[:] = [3, 4]
    a.num_computed_tokens = 2 * BS
    cache.index(a, a.num_computed_tokens)
    assert cache.is_indexed(3) and cache.is_indexed(4)
    assert cache.match(_job("b", [big] * BS + [1] * BS + [7])) == [3, 4]
    assert cache.match(_job("c", [5] * BS + [1] * BS + [7])) == []


def test_a_lookup_reads_a_waiting_job_about_as_far_as_it_finds():
    """A lookup packs a job's blocks only about as far as it looks (runs
    that double): a job queued behind a miss keeps one block's reading, one
    that finds n blocks at most 2n + 1."""
    cache = PrefixCache(BS)
    a = _job("a", [1] * (5 * BS) + [2])
    a.block_table[:] = [10, 11, 12, 13, 14]
    a.num_computed_tokens = 5 * BS
    cache.index(a, a.num_computed_tokens)
    miss = _job("m", [3] * (40 * BS) + [2])
    assert cache.match(miss) == [] and len(miss.block_tokens) == 1
    hit = _job("h", [1] * (5 * BS) + [4] * (30 * BS) + [2])
    assert cache.match(hit) == [10, 11, 12, 13, 14]
    assert 6 <= len(hit.block_tokens) <= 11
