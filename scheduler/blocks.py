"""KV block accounting: which device blocks are free and which jobs hold each.

Pure bookkeeping (FastServe §4.2 and vLLM's paged KV): the engine holds the
tensors; this holds the numbers.  Every allocation and free goes through
here, so a leak or a double free shows up as a broken invariant rather than
as silent KV corruption.

A block may be held by several jobs at once: siblings of one request
(OpenAI `n` > 1) read the full blocks of their common prompt from the same
device blocks (vLLM's prefix sharing, reference-counted as in nano-vllm's
block manager), and so may jobs whose tokens begin the same way, through
the prefix cache (`scheduler/prefix_cache.py`).  A block goes back to the
pool when its last holder lets go; with the prefix cache, a block whose KV
it indexed is parked instead, and counts as free until it is reused.
Shared blocks are read-only by construction: they cover only whole blocks
of prompt positions that every holder has already computed, and a job only
ever writes positions at or past its own computed tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from scheduler.free_blocks import FreeBlocks
from scheduler.job import BlockLocation, Job
from scheduler.prefix_cache import PrefixCache
from scheduler.watchers import Watchers

# An enum member's lookup costs ~0.12 µs on Python 3.11: once per allocation.
_DEVICE = BlockLocation.DEVICE
# `_owner`'s mark of a block with several holders (their ids in `_shared`).
_SHARED = object()


class BlockAccountingError(RuntimeError):
    pass


class Adoption(NamedTuple):
    """What `BlockManager.reclaim_cached` adopted, to undo it."""
    num_blocks: int
    cached_before: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 prefix_caching: bool = False, block_run: int = 8) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix = PrefixCache(block_size) if prefix_caching else None
        # A job's blocks in runs of consecutive ids where the pool allows
        # (scheduler/free_blocks.py: a CPU reads longer spans faster).
        self._free = FreeBlocks(num_blocks, block_run)
        # Block id -> the one job id whose block table lists it, `_SHARED`
        # where several do (their ids in `_shared`), None where none does:
        # a swap moves every block of a job, each one store here rather than
        # a holder set made in a pool-sized dict (studies/plan_time/README.md).
        self._owner: list[object] = [None] * num_blocks
        self._shared: dict[int, set[str]] = {}
        self._num_held = 0
        # Job id -> how many of its blocks other jobs hold too; absent for
        # the common job that shares nothing, so that "what would evicting
        # this job free" stays O(1) (`num_exclusive`).
        self._num_shared: dict[str, int] = {}
        # Jobs holding at least one device block, so that a policy finds
        # its eviction candidates without scanning every queued job.
        self.holding: dict[str, Job] = {}
        self._holding_watchers = Watchers()

    def watch_holding(self) -> set[str]:
        """The ids of jobs that join or leave `holding` from now on (and
        of its members now), for a follower to empty as it catches up
        (`scheduler/watchers.py`)."""
        return self._holding_watchers.follow(self.holding)

    def _now_holding(self, job: Job) -> None:
        if job.job_id not in self.holding:
            self.holding[job.job_id] = job
            self._holding_watchers.changed(job.job_id)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and parked ones."""
        if self.prefix is None:
            return self._free.count
        return self._free.count + self.prefix.num_parked

    @property
    def num_used(self) -> int:
        return self._num_held

    @property
    def utilization(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, job: Job, num_new_tokens: int) -> int:
        """Extra device blocks `job` needs to hold `num_new_tokens` more."""
        target = blocks_for(job.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, target - len(job.block_table))

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def grow(self, job: Job, num_new_tokens: int) -> bool:
        """Extend `job`'s block table to hold `num_new_tokens` more tokens.

        All or nothing: returns False and changes nothing when the free pool
        is short.
        """
        bs = self.block_size
        n = -(-(job.num_computed_tokens + num_new_tokens) // bs) - len(job.block_table)
        if n <= 0:
            return True  # a decode inside its last block: the common case
        if self.prefix is not None:
            # Its blocks filled so far (a decode's last one is full now),
            # for later jobs to find.
            self.prefix.index(job, job.num_computed_tokens)
        if n > self._free.count and n > self.num_free:
            return False
        self._take(job, n)
        return True

    def _take(self, job: Job, n: int) -> None:
        # A decode's next block, every 16 tokens of every running job: the
        # free list's count read once, no call for an empty free list.
        if not n:
            return
        jid, table = job.job_id, job.block_table
        if jid not in self.holding:
            self._now_holding(job)
        free = self._free
        have = free.count
        if n <= have:
            new = free.take(jid, table[-1] if table else None, n)
        else:  # the rest from the prefix cache, least recently used first
            assert self.prefix is not None
            new = free.take(jid, table[-1] if table else None, have) if have else []
            new += self.prefix.evict_many(n - have)
        owner = self._owner
        for b in new:
            owner[b] = jid
        self._num_held += n
        table += new
        job.table_copy = None
        job.block_locations += [_DEVICE] * n

    def share(self, job: Job, source: Job, num_blocks: int) -> None:
        """Let `job` (no blocks yet) hold the first `num_blocks` of
        `source`'s blocks too.  The caller guarantees those blocks are full
        and computed, and that both jobs have the same tokens there."""
        if job.block_table:
            raise BlockAccountingError(f"{job.job_id} already holds blocks")
        if num_blocks > len(source.block_table):
            raise BlockAccountingError(
                f"{source.job_id} holds {len(source.block_table)} blocks, "
                f"cannot share {num_blocks}")
        owner, src = self._owner, source.job_id
        for b in source.block_table[:num_blocks]:
            holder = owner[b]
            if holder != src and (holder is not _SHARED or src not in self._shared[b]):
                raise BlockAccountingError(f"block {b} is not held by {src}")
            self._hold_too(b, holder, job.job_id)
            job.block_table.append(b)
            job.block_locations.append(_DEVICE)
        job.table_copy = None
        if num_blocks:
            self._num_shared[job.job_id] = num_blocks
            self._now_holding(job)

    def claim_cached(self, job: Job) -> int:
        """Let `job` (no blocks yet, just arrived) hold the cached blocks
        that begin its tokens, and count their tokens computed; returns how
        many blocks."""
        if (self.prefix is None or job.block_table or job.num_computed_tokens
                or not job.adopts_cached_kv):
            return 0
        found = self.prefix.match(job)
        if not found:
            job.prefix_missed_at = self.prefix.version
            return 0
        self._adopt(job, found)
        return len(found)

    def reclaim_cached(self, job: Job) -> Adoption | None:
        """`claim_cached` again as a job with no KV anywhere is about to
        start: blocks computed since it arrived (by a job ahead of it with
        the same system prompt, or its own, parked when it was preempted for
        recomputation) are adopted instead of computed (vLLM looks its cache
        up at scheduling too).  The policy sizes the job's chunk after this
        call, and gives the blocks back (`undo_adoption`) if it does not
        start after all.  None: nothing adopted."""
        prefix = self.prefix
        if (prefix is None or job.block_table or job.num_computed_tokens
                or job.num_host_blocks or job.swap_pending is not None
                or not job.adopts_cached_kv or job.prefix_missed_at == prefix.version):
            return None
        found = prefix.match(job, count=False)
        if not found:
            job.prefix_missed_at = prefix.version
            return None
        adoption = Adoption(len(found), job.num_cached_tokens)
        prefix.count_kept(job, len(found))
        self._adopt(job, found)
        return adoption

    def undo_adoption(self, job: Job, adoption: Adoption) -> None:
        """Give back what `reclaim_cached` adopted: `job` is as before."""
        assert self.prefix is not None
        self.free(job)
        job.num_computed_tokens = 0
        job.num_cached_tokens = adoption.cached_before
        self.prefix.count_kept(job, adoption.num_blocks, -1)

    def keep_for_swap_in(self, job: Job, n: int) -> int | None:
        """A swap-in of `job`'s `n` blocks (no device block, its KV on the
        host) first takes the leading blocks whose KV is still on the
        device, indexed by the prefix cache: its own, parked when it was
        swapped out and not reused since, or another job's with the same
        tokens.  Returns how many; the rest is copied back into fresh
        blocks.  None, taking nothing, when those fresh blocks cannot be
        had: a swap-in that waits for room leaves the cache as it was."""
        prefix = self.prefix
        if prefix is None or job.block_table:
            return 0 if self.can_allocate(n) else None
        # Only blocks it has computed whole: it writes the rest of a partly
        # filled one, which must not be shared.
        match = prefix.peek(job, min(n, job.num_computed_tokens // self.block_size))
        # A parked block (one no job holds) it takes back is one fewer free
        # for the rest.
        owner = self._owner
        parked = sum(1 for b in match.blocks if owner[b] is None)
        if not self.can_allocate(n - len(match.blocks) + parked):
            return None
        found = prefix.claim(job, match)
        if found:
            self._adopt(job, found, computed=False)
        return len(found)

    def take(self, job: Job, n: int) -> None:
        """`n` more fresh blocks at the end of `job`'s table (the rest of a
        swap-in after `keep_for_swap_in`)."""
        assert n <= self.num_free
        self._take(job, n)

    def _adopt(self, job: Job, found: list[int], computed: bool = True) -> None:
        jid, owner = job.job_id, self._owner
        shared = 0
        for b in found:
            holder = owner[b]
            if holder is None:  # parked: now this job's alone
                owner[b] = jid
                self._num_held += 1
                continue
            self._hold_too(b, holder, jid)
            shared += 1
        if shared:
            self._num_shared[jid] = shared
        job.block_table += found
        job.table_copy = None
        job.block_locations += [_DEVICE] * len(found)
        self._now_holding(job)
        if not computed:  # a swap-in: its computed tokens are counted already
            return
        job.num_computed_tokens = len(found) * self.block_size
        # Its prompt's, before it first ran (a resumed or preempted job's
        # own KV coming back is not a cache hit its client is told of).
        if not job.output_token_ids and job.first_scheduled_time is None:
            job.num_cached_tokens = job.num_computed_tokens

    def _hold_too(self, b: int, holder: object, jid: str) -> None:
        """`jid` holds block `b` too, which `holder` (`_owner[b]`) holds."""
        if holder is _SHARED:
            self._shared[b].add(jid)
        else:  # its holder's exclusive block becomes shared
            self._num_shared[holder] = self._num_shared.get(holder, 0) + 1  # type: ignore[index]
            self._owner[b] = _SHARED
            self._shared[b] = {holder, jid}  # type: ignore[arg-type]

    def free(self, job: Job) -> int:
        """Drop all of `job`'s references; returns how many blocks went back
        to the pool (those no other job holds)."""
        jid = job.job_id
        if self.prefix is not None:
            self.prefix.index(job, job.num_computed_tokens)
            self.prefix.forget(job)
        if jid not in self._num_shared:
            freed = self._free_exclusive(job)
        else:
            freed = self._free_shared(job)
        if self.holding.pop(jid, None) is not None:
            self._holding_watchers.changed(jid)
        job.block_table.clear()
        job.table_copy = None
        job.block_locations.clear()
        return freed

    def _free_exclusive(self, job: Job) -> int:
        """`free` of a job that shares no block: each of its blocks has it
        as sole holder, checked in bulk."""
        jid, table, owner = job.job_id, job.block_table, self._owner
        held = [owner[b] for b in table]
        if held.count(jid) != len(held):  # nothing changed yet
            bad = next(i for i, h in enumerate(held) if h != jid)
            raise BlockAccountingError(
                f"block {table[bad]} freed by {jid} but held by {sorted(self.holders(table[bad]))}")
        for b in table:
            owner[b] = None
        self._num_held -= len(table)
        self._release(table)
        return len(table)

    def _release(self, blocks: list[int]) -> None:
        """Blocks that lost their last holder: to the pool, or parked in the
        prefix cache if it indexed their KV (`PrefixCache.park`)."""
        if self.prefix is None:
            self._free.give_back(blocks)
            return
        self._free.give_back(self.prefix.park(blocks))

    def _free_shared(self, job: Job) -> int:
        jid, owner = job.job_id, self._owner
        released: list[int] = []
        for b in job.block_table:
            holder = owner[b]
            if holder == jid:
                owner[b] = None
                released.append(b)
                continue
            holders = self._shared.get(b) if holder is _SHARED else None
            if holders is None or jid not in holders:
                raise BlockAccountingError(
                    f"block {b} freed by {jid} but held by {sorted(self.holders(b))}")
            holders.discard(jid)
            if len(holders) == 1:  # its last other holder now has it alone
                (last,) = holders
                owner[b] = last
                del self._shared[b]
                left = self._num_shared[last] - 1
                if left:
                    self._num_shared[last] = left
                else:
                    del self._num_shared[last]
        self._num_held -= len(released)
        self._num_shared.pop(jid, None)
        self._release(released)
        return len(released)

    # Queries ----------------------------------------------------------

    @property
    def has_shared(self) -> bool:
        """Whether any block has more than one holder."""
        return bool(self._num_shared)

    def num_exclusive(self, job: Job) -> int:
        """Blocks only `job` holds: what evicting it alone gives back."""
        return len(job.block_table) - self._num_shared.get(job.job_id, 0)

    def num_holders(self, block: int) -> int:
        holder = self._owner[block]
        if holder is None:
            return 0
        return len(self._shared[block]) if holder is _SHARED else 1

    def holders(self, block: int) -> frozenset[str]:
        holder = self._owner[block]
        if holder is _SHARED:
            return frozenset(self._shared[block])
        return frozenset(() if holder is None else (holder,))  # type: ignore[arg-type]

    def owned_by(self, job_id: str) -> list[int]:
        return [b for b, h in self._holder_sets().items() if job_id in h]

    def _holder_sets(self) -> dict[int, set[str]]:
        """Every held block -> the ids of its holders (`check`, `owned_by`)."""
        out: dict[int, set[str]] = {}
        for b, holder in enumerate(self._owner):
            if holder is _SHARED:
                out[b] = set(self._shared[b])
            elif holder is not None:
                out[b] = {holder}  # type: ignore[arg-type]
        return out

    def check(self, jobs: Iterable[Job] | None = None) -> None:
        """Invariants: every block is free or held, never both, none leaks;
        the per-job shared counts match the holder sets.  Given the live
        `jobs`, also: the holders of every block are exactly the jobs whose
        block tables list it."""
        try:
            free = self._free.check()
        except AssertionError as e:
            raise BlockAccountingError(f"free pool: {e}") from None
        holder_sets = self._holder_sets()
        if len(holder_sets) != self._num_held:
            raise BlockAccountingError(
                f"{len(holder_sets)} blocks held, {self._num_held} counted")
        if self._shared.keys() != {b for b, h in enumerate(self._owner) if h is _SHARED}:
            raise BlockAccountingError("shared blocks and their holder sets disagree")
        if free & holder_sets.keys():
            raise BlockAccountingError("a block is both free and held")
        prefix = self.prefix
        parked = set(prefix.parked()) if prefix is not None else set()
        if parked & (free | holder_sets.keys()):
            raise BlockAccountingError("a parked block is also free or held")
        if prefix is not None and any(
                not prefix.is_indexed(b) for b in parked) or any(
                prefix is not None and prefix.is_indexed(b) for b in free):
            raise BlockAccountingError("parked blocks and indexed blocks disagree")
        if len(free) + len(parked) + len(holder_sets) != self.num_blocks:
            raise BlockAccountingError("blocks leaked")
        shared: Counter[str] = Counter()
        for b, holders in holder_sets.items():
            if b in self._shared and len(holders) < 2:
                raise BlockAccountingError(f"block {b} is marked shared with one holder")
            if len(holders) > 1:
                shared.update(holders)
        if dict(shared) != self._num_shared:
            raise BlockAccountingError(
                f"shared counts {self._num_shared} disagree with holders {dict(shared)}")
        held_by = {jid for holders in holder_sets.values() for jid in holders}
        if held_by != self.holding.keys():
            raise BlockAccountingError(
                f"jobs holding blocks {sorted(held_by)} disagree with the index "
                f"{sorted(self.holding)}")
        if jobs is None:
            return
        listed: dict[int, set[str]] = {}
        for job in jobs:
            if len(set(job.block_table)) != len(job.block_table):
                raise BlockAccountingError(f"{job.job_id} lists a block twice")
            for b in job.block_table:
                listed.setdefault(b, set()).add(job.job_id)
        if listed != holder_sets:
            raise BlockAccountingError("block tables disagree with the holders")


class ReleaseTally:
    """How many blocks a growing set of jobs would return to the pool if
    they all let go: each one's exclusive blocks, plus every shared block
    whose holders are all in the set.  Victim selection adds candidates one
    by one until enough would be freed (FastServe §4.2), several times per
    plan, so a set without shared blocks costs no more than a sum of
    block-table lengths."""

    __slots__ = ("_blocks", "_dropped", "freed")

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        # Shared block -> holders in the set; created on the first one.
        self._dropped: dict[int, int] | None = None
        self.freed = 0

    def take(self, job: Job) -> int:
        """Add `job` if that adds to `freed`; returns what it added."""
        if not self._blocks._num_shared.get(job.job_id):  # the common case
            n = len(job.block_table)
            self.freed += n
            return n
        dropped = self._dropped or {}
        gain = self._blocks.num_exclusive(job) + sum(
            1 for b in job.block_table
            if dropped.get(b, 0) + 1 == self._blocks.num_holders(b) > 1)
        if gain:
            self.add(job)
        return gain

    def frees_any(self, job: Job) -> bool:
        """Whether some block of `job` (in the set) would go back to the
        pool: one of its own, or a shared one all of whose holders are in."""
        if self._blocks.num_exclusive(job):
            return True
        dropped = self._dropped or {}
        return any(dropped.get(b, 0) == self._blocks.num_holders(b) for b in job.block_table)

    def add(self, job: Job) -> None:
        """Add `job` whatever it frees now: the rest of its co-holders may
        follow."""
        exclusive = self._blocks.num_exclusive(job)
        self.freed += exclusive
        if exclusive == len(job.block_table):
            return
        if self._dropped is None:
            self._dropped = {}
        for b in job.block_table:
            holders = self._blocks.num_holders(b)
            if holders > 1:
                n = self._dropped[b] = self._dropped.get(b, 0) + 1
                if n == holders:
                    self.freed += 1
