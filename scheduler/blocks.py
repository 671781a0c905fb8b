"""KV block accounting: which device blocks are free and which job owns each.

Pure bookkeeping (FastServe §4.2 and vLLM's paged KV): the engine holds the
tensors; this holds the numbers.  Every allocation and free goes through
here, so a leak or a double free shows up as a broken invariant rather than
as silent KV corruption.
"""

from __future__ import annotations

from collections import deque

from scheduler.job import BlockLocation, Job


class BlockAccountingError(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse keeps recently freed blocks cold, which makes a stale
        # block table show up in tests instead of reading lucky data.
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def utilization(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, job: Job, num_new_tokens: int) -> int:
        """Extra device blocks `job` needs to hold `num_new_tokens` more."""
        target = blocks_for(job.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, target - len(job.block_table))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def grow(self, job: Job, num_new_tokens: int) -> bool:
        """Extend `job`'s block table to hold `num_new_tokens` more tokens.

        All or nothing: returns False and changes nothing when the free pool
        is short.
        """
        n = self.blocks_needed(job, num_new_tokens)
        if n > len(self._free):
            return False
        for _ in range(n):
            b = self._free.popleft()
            self._owner[b] = job.job_id
            job.block_table.append(b)
            job.block_locations.append(BlockLocation.DEVICE)
        return True

    def allocate_for(self, job: Job, n: int) -> None:
        """Give a job with an empty block table `n` fresh blocks (swap-in)."""
        assert not job.block_table and n <= len(self._free)
        for _ in range(n):
            b = self._free.popleft()
            self._owner[b] = job.job_id
            job.block_table.append(b)
            job.block_locations.append(BlockLocation.DEVICE)

    def free(self, job: Job) -> int:
        """Return all of `job`'s device blocks to the pool."""
        for b in job.block_table:
            if self._owner.get(b) != job.job_id:
                raise BlockAccountingError(
                    f"block {b} freed by {job.job_id} but owned by {self._owner.get(b)}"
                )
            del self._owner[b]
            self._free.append(b)
        n = len(job.block_table)
        job.block_table.clear()
        job.block_locations.clear()
        return n

    def owned_by(self, job_id: str) -> list[int]:
        return [b for b, o in self._owner.items() if o == job_id]

    def check(self) -> None:
        """Invariant: every block is either free or owned, never both."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockAccountingError("a block is in the free list twice")
        if free & self._owner.keys():
            raise BlockAccountingError("a block is both free and owned")
        if len(free) + len(self._owner) != self.num_blocks:
            raise BlockAccountingError("blocks leaked")
