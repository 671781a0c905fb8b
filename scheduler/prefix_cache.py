"""Automatic prefix caching: KV blocks outlive the jobs that computed them.

Chat traffic repeats itself: every request of an assistant starts with the
same system prompt, and each turn of a conversation re-sends the turns
before it.  Here a full device block whose KV a job has computed is indexed
by its content; when its last holder lets go it is parked, not freed, and a
later job whose tokens begin the same way adopts it instead of computing it
again (vLLM's automatic prefix caching, hash-chained full blocks; SGLang's
RadixAttention keeps the same KV in a radix tree).  Parked blocks still count
as free: an allocation that finds no truly free block evicts the parked one
let go longest ago, so the cache never costs a running job its memory.

A block's key is the serial number its predecessor was indexed under and
the hash of its tokens, so two blocks match only if the whole prefix before
them matches too; the tokens are kept beside the entry and compared on every
hit, so a match is exact (two contents whose hashes collide are never
confused: the second is not indexed).  Keys hold the hash, not the tokens,
because evicting a block deletes its key: hashing sixteen token ids again,
each its own object somewhere in memory, cost more than the rest of an
allocation.  A block's tokens are read once for its job's life, packed as
64-bit ids into bytes (`Job.block_tokens`), which keep their own hash and
which the garbage collector never walks: a job swapped out, whose parked
blocks were evicted before it came back, is indexed again in its fresh
blocks without reading its tokens anew.  Serials are never reused, which
keeps a match exact even after the predecessor's block has been evicted and
reused for other tokens: its successors are then unreachable and age out.
A job's blocks are evicted tail first (parked in reverse), so a shared head
outlives the tails that hang off it.

A job with vLLM's `cache_salt` (a tenant's) starts from a root of its
salt's, so it shares blocks only with jobs of the same salt: no tenant can
tell from its latency what another's prompts were.

Only whole blocks of computed positions whose tokens are all known are
indexed, and a job adopts at most the blocks strictly before its last known
token, so that it computes that token and samples from its own logits; like
a sibling's shared prompt (`scheduler/sharing.py`), an adopted block is
never written: every holder has computed those positions already.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from typing import NamedTuple

from scheduler.job import Job

# The serial of "no predecessor": the first block of every sequence.
_ROOT = 0

_Key = tuple[object, int]  # (predecessor's serial or root, hash of the tokens)


def _root(job: Job) -> object:
    """The predecessor of a job's first block: a salted job's blocks form a
    tree of their own (vLLM's `cache_salt`)."""
    return _ROOT if job.cache_salt is None else ("salt", job.cache_salt)


class Match(NamedTuple):
    """A lookup's result (`PrefixCache.peek`): the blocks and their
    contents' serials."""

    blocks: list[int]
    path: list[int]


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # A block's token ids as bytes: compared and hashed (the hash kept
        # by the object) without touching sixteen int objects, and never
        # walked by the garbage collector.
        self._pack = struct.Struct(f"<{block_size}q").pack
        self._index: dict[_Key, int] = {}  # key -> device block
        # block -> (key, serial, tokens)
        self._entry: dict[int, tuple[_Key, int, bytes | tuple[int, ...]]] = {}
        self._serials = itertools.count(_ROOT + 1)
        # Indexed blocks no job holds, least recently let go first.
        self._parked: OrderedDict[int, None] = OrderedDict()
        # Job id -> serials of its leading blocks' contents, as far as
        # they are indexed (by its own block or an identical one).
        self._paths: dict[str, list[int]] = {}
        # Tokens of the lookups whose result a job kept (every arrival's,
        # and each later one that found blocks), and those found cached.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Blocks indexed so far: a lookup that found nothing at one version
        # finds nothing until it grows (evictions only take entries away).
        self.version = 0

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def parked(self) -> list[int]:
        return list(self._parked)

    def is_indexed(self, block: int) -> bool:
        return block in self._entry

    # Indexing ---------------------------------------------------------

    def index(self, job: Job, upto: int) -> None:
        """Index `job`'s full blocks lying before position `upto` (computed,
        tokens known) that are not indexed yet."""
        bs = self.block_size
        path = self._paths.get(job.job_id)
        if path is None:
            path = self._paths[job.job_id] = []
        i = len(path)
        if (i + 1) * bs > upto:
            return  # the common call: no block filled since the last one
        # Once per filled block, on the scheduler's hot path (each prefill
        # indexes its prompt, each swap-in its blocks again): a block's
        # tokens packed once for the job's life (`Job.block_tokens`), their
        # hash kept by the bytes.
        table, memo = job.block_table, job.block_tokens
        stop = min(upto // bs, len(table))
        stop = min(stop, self._read(job, stop))  # not past a token in flight
        index, entry, serials = self._index, self._entry, self._serials
        parent = path[-1] if path else _root(job)
        added = 0
        while i < stop:
            tokens = memo[i]
            key = (parent, hash(tokens))
            mine = table[i]
            block = index.setdefault(key, mine)
            found = entry.get(block)
            if found is None:  # a new entry: `mine` under this key
                serial = next(serials)
                entry[block] = (key, serial, tokens)
                added += 1
            elif found[0] != key:
                del index[key]  # `mine` is indexed under other tokens: never expected
                break
            elif found[2] != tokens:
                break  # another content with the same hash holds the key
            else:
                serial = found[1]
            path.append(serial)
            parent = serial
            i += 1
        self.version += added

    def _read(self, job: Job, stop: int) -> int:
        """Extend `job`'s packed blocks (`Job.block_tokens`) to `stop` blocks,
        or to the first block holding a token still in flight
        (scheduler/ahead.py); returns how many blocks it holds."""
        bs, pack = self.block_size, self._pack
        memo, prompt = job.block_tokens, job.prompt_token_ids
        i = len(memo)
        in_prompt = len(prompt) // bs  # blocks sliced from the prompt alone
        append = memo.append
        while i < stop:
            lo = i * bs
            if i < in_prompt:
                ids = prompt[lo:lo + bs]
            else:
                ids = job.token_slice(lo, lo + bs)
                if min(ids) < 0:
                    break
            try:
                append(pack(*ids))
            except struct.error:  # an id past 64 bits (the ingress admits none): kept as it is
                append(tuple(ids))
            i += 1
        return i

    def forget(self, job: Job) -> None:
        """`job` lets go of its blocks: its path goes with them."""
        self._paths.pop(job.job_id, None)

    # Parking and eviction ----------------------------------------------

    def park(self, blocks: list[int]) -> list[int]:
        """`blocks` lost their last holder: those indexed are kept, tail
        first (the head of a sequence, which other sequences may share, is
        evicted last); returns the others, tail first, for the caller to
        free."""
        entry, parked = self._entry, self._parked
        unindexed: list[int] = []
        for block in reversed(blocks):
            if block in entry:
                parked[block] = None
            else:
                unindexed.append(block)
        return unindexed

    def evict_many(self, n: int) -> list[int]:
        """Un-index the `n` parked blocks let go longest ago and hand them
        out (an allocation that finds the free list dry takes all its
        blocks here: one call, not one per block)."""
        popitem, entry, index = self._parked.popitem, self._entry, self._index
        out: list[int] = []
        for _ in range(n):
            block, _ = popitem(last=False)
            del index[entry.pop(block)[0]]
            out.append(block)
        return out

    # Lookup -------------------------------------------------------------

    def match(self, job: Job, count: bool = True, at_most: int | None = None) -> list[int]:
        """The indexed blocks holding `job`'s leading tokens, at most those
        strictly before its last known token (and `at_most`); they leave
        the parked set (the caller makes `job` hold them) and become its
        path.  `count`: the lookup counts in the hit statistics (else the
        caller counts it if it keeps the result, `count_kept`)."""
        if count:
            self.num_queried_tokens += job.num_tokens
        found = self.claim(job, self.peek(job, at_most))
        if count:
            self.num_hit_tokens += len(found) * self.block_size
        return found

    def peek(self, job: Job, at_most: int | None = None) -> Match:
        """What `match` would find, changing nothing: for a caller that
        takes the blocks only if the rest of what it needs can be had
        (`claim`)."""
        bs = self.block_size
        limit = (job.num_tokens - 1) // bs
        if at_most is not None:
            limit = min(limit, at_most)
        found: list[int] = []
        path: list[int] = []
        if limit <= 0 or not self._index:
            return Match(found, path)
        parent: object = _root(job)
        memo = job.block_tokens
        for i in range(limit):
            # Read about as far as it looks, in runs that double: a job that
            # finds nothing reads one block, one that finds n at most 2n.
            if i == len(memo) and self._read(job, min(limit, 2 * i + 1)) == i:
                break  # a token in flight: never cached
            tokens = memo[i]
            block = self._index.get((parent, hash(tokens)))
            if block is None:
                break
            _, parent, held = self._entry[block]
            if held != tokens:
                break  # the same hash, other tokens
            found.append(block)
            path.append(parent)
        return Match(found, path)

    def claim(self, job: Job, match: Match) -> list[int]:
        """`match`'s blocks (from `peek`, nothing changed since) leave the
        parked set and become `job`'s path."""
        for block in match.blocks:
            self._parked.pop(block, None)
        if match.path:
            self._paths[job.job_id] = match.path
        return match.blocks

    def count_kept(self, job: Job, num_blocks: int, sign: int = 1) -> None:
        """Count (or, `sign` -1, uncount) a lookup that `match` did not."""
        self.num_queried_tokens += sign * job.num_tokens
        self.num_hit_tokens += sign * num_blocks * self.block_size
