"""Placement by cached prefix (scheduler/prefix_affinity.py,
scheduler/placement.py): a request goes where its prompt's leading blocks
were sent, unless that replica is busier by more than they save."""

from __future__ import annotations

from scheduler.placement import Placement
from scheduler.prefix_affinity import PrefixAffinity, prefix_keys, route_key

BS = 16
SYSTEM = list(range(100, 100 + 20 * BS))  # 20 blocks


def test_keys_chain_whole_prefixes_and_skip_the_last_token():
    a = prefix_keys(SYSTEM + [1, 2], BS)
    assert len(a) == 20
    # Exactly 20 blocks: the last one holds the last token, no key for it.
    assert len(prefix_keys(SYSTEM, BS)) == 19
    # The same block after a different head has another key.
    other = prefix_keys([7] * BS + SYSTEM[BS:] + [1], BS)
    assert other[1:] != a[1:20] and other[0] != a[0]
    assert prefix_keys(SYSTEM + [3], BS) == a
    assert len(prefix_keys(SYSTEM * 20, BS, max_blocks=64)) == 64


def test_match_counts_the_deepest_key_each_live_replica_got():
    aff = PrefixAffinity()
    long_ = prefix_keys(SYSTEM + [1] * 64 + [2], BS)  # 24 blocks
    short = prefix_keys(SYSTEM + [3] * 16 + [4], BS)  # 21 blocks, 20 shared
    aff.record(long_, "r1")
    aff.record(short, "r2")
    assert aff.match(long_, {"r1", "r2"}) == {"r1": 24, "r2": 20}
    assert aff.match(long_, {"r2"}) == {"r2": 20}
    assert aff.match(prefix_keys([9] * 64, BS), {"r1", "r2"}) == {}
    aff.forget("r1")
    assert aff.match(long_, {"r1", "r2"}) == {"r2": 20}


def test_the_oldest_prefixes_age_out_head_last():
    aff = PrefixAffinity(max_keys=30)
    first = prefix_keys([5] * (20 * BS) + [1], BS)
    aff.record(first, "r1")
    aff.record(prefix_keys([6] * (15 * BS) + [1], BS), "r2")
    assert len(aff) == 30
    # first's tail aged out, its head stays reachable.
    assert aff.match(first, {"r1"}) == {"r1": 15}


def _idle(p: Placement, rid: str, queued: int = 0) -> None:
    p.report(rid, num_blocks=100, free_blocks=100, queued_tokens=queued, num_jobs=0, now=0.0)


def test_a_shared_prefix_goes_where_it_was_sent_while_the_load_allows():
    p = Placement(block_size=BS)
    _idle(p, "a")
    _idle(p, "b")
    chat = SYSTEM + [1, 2, 3]
    keys = prefix_keys(chat, BS)
    first = p.place("j1", len(chat) + 50, now=0.1, prefix_keys=keys)
    # Right after, the first is busier by all of j1's work, more than the
    # prefix saves: the next goes to the other one.
    assert p.place("j2", len(chat) + 50, now=0.1, prefix_keys=keys) != first
    p.affinity = PrefixAffinity()
    p.num_prefix_placements = 0
    p.place("j1", len(chat) + 50, now=0.1, prefix_keys=keys)
    # Both report idle again: the one holding the prefix wins.
    _idle(p, "a")
    _idle(p, "b")
    assert p.place("j2", len(chat) + 50, now=0.1, prefix_keys=keys) == first
    assert p.num_prefix_placements == 1
    # Once the first is busier by more than the prefix saves, it spills.
    other = "b" if first == "a" else "a"
    _idle(p, first, queued=len(SYSTEM) + 1000)
    _idle(p, other)
    assert p.place("j3", len(chat) + 50, now=0.2, prefix_keys=keys) == other
    # Both hold it now: the next goes to the less loaded of the two.
    assert p.place("j4", len(chat) + 50, now=0.2, prefix_keys=keys) == other
    # A failed replica's prefixes go with it.
    p.forget(other)
    assert p.affinity.match(keys, {"a", "b"}) == {first: len(keys)}


def test_a_prompt_cache_key_routes_requests_that_share_nothing_known_yet():
    """Requests a client marks with one `prompt_cache_key` go where the key
    went, as if that replica held their whole prompt, while the load
    allows; without the key the less loaded replica gets them."""
    p = Placement(block_size=BS)

    def place(job: str, fill: int, key: str | None, queued_a: int = 40,
              queued_b: int = 0) -> str | None:
        """A prompt of 8 fresh blocks, after "a" and "b" report these loads."""
        _idle(p, "a", queued=queued_a)
        _idle(p, "b", queued=queued_b)
        return p.place(job, 8 * BS + 50, now=0.1, prefix_keys=prefix_keys(
            [fill] * (8 * BS) + [1], BS), route_key=None if key is None else route_key(key))

    assert place("j1", 3, "thread-1", queued_a=0) == "a"
    assert place("j2", 4, None) == "b"  # "a" a little busier
    assert place("j3", 5, "thread-1") == "a"
    assert place("j4", 6, "thread-2") == "b"  # another key is no hint
    # Busier by more than the prompt: it spills.
    assert place("j5", 7, "thread-1", queued_a=8 * BS + 500, queued_b=40) == "b"


def _prefill_report(p: Placement, rid: str, prefill_tokens: int) -> None:
    p.report(rid, num_blocks=100, free_blocks=100, queued_tokens=prefill_tokens, num_jobs=1,
             now=0.0, waiting_tokens=prefill_tokens, capacity_tokens=0.0, tokens_per_s=100.0,
             mean_output_len=50.0, ttft_slo_s=10.0,
             prefill={"prefill_tokens": prefill_tokens, "decodes": 1, "jobs": 1,
                      "max_batch_size": 8, "max_batch_tokens": 256, "base_s": 0.05,
                      "per_token_s": 0.002, "per_seq_s": 0.001, "slowdown": 1.0})


def test_admission_estimates_the_ttft_without_the_cached_prompt():
    p = Placement(block_size=BS)
    _prefill_report(p, "a", prefill_tokens=100)
    _prefill_report(p, "b", prefill_tokens=0)
    chat = SYSTEM + [1, 2, 3]
    keys = prefix_keys(chat, BS)
    p.affinity.record(keys, "a")
    # a has 100 tokens ahead but 320 of this prompt's 323 cached.
    res = p.admit("j", prompt_tokens=len(chat), max_tokens=20, n=1, now=0.1,
                  prefix_keys=keys)
    assert res.admitted and res.replica == "a"
    assert p.replicas["a"].placed_prefill == len(chat) - len(SYSTEM)
    # Without the hint b, with nothing queued, is sooner.
    q = Placement(block_size=BS)
    _prefill_report(q, "a", prefill_tokens=100)
    _prefill_report(q, "b", prefill_tokens=0)
    assert q.admit("j", prompt_tokens=len(chat), max_tokens=20, n=1, now=0.1).replica == "b"


def test_a_salt_changes_every_key():
    plain = prefix_keys(SYSTEM + [1], BS)
    salted = prefix_keys(SYSTEM + [1], BS, salt="tenant-1")
    assert len(salted) == len(plain) and not set(salted) & set(plain)
    assert prefix_keys(SYSTEM + [1], BS, salt="tenant-1") == salted
    assert prefix_keys(SYSTEM + [1], BS, salt="tenant-2") != salted
