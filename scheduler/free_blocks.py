"""The pool of free device blocks, handed out so that a job's blocks lie in
runs of consecutive ids.

Why runs: a decode step reads every running job's K/V, and a CPU reads a
span of memory far faster the longer it is (`studies/engine_cpu/README.md`,
"Reading K/V from DRAM": on one core 4.0–4.5 GB/s over 6 KB spans, a block
of 16 tokens of SmolLM2's keys, against 6.8–8.2 GB/s over 48 KB; the decode
operator on the tables of a pool with turnover about 1.1× faster with runs
than without).  Handed out
first come first served, the blocks of a hundred jobs growing one block at a
time interleave, and no job's next block follows its last one.

So a job that grows takes the block right after its last one when that is
free; a job that needs a block that does not follow one of its own takes the
oldest free block (FIFO, as before: a freed block stays unused for as long
as possible, so a stale block table shows up in tests instead of reading
lucky data; only a block right after a growing job's last one may be taken
sooner).  After each take, the `run - 1` blocks after the job's last
one are set aside for its growth: another job passes over each of them
once, and finds it again at the back of the queue, behind the rest of the
pool.  Nothing is held back: every free
block can be had by anyone, and the count of free blocks is exact.

The queue may hold ids that were taken out of order since they were queued
(a block taken as the one after its job's last); `is_free` is the truth and
such entries are skipped when they come up.
"""

from __future__ import annotations

from collections import deque


class FreeBlocks:
    def __init__(self, num_blocks: int, run: int = 8) -> None:
        if run < 1:
            raise ValueError(f"run must be at least 1, got {run}")
        self.num_blocks = num_blocks
        self.run = run
        self._queue: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray(b"\x01") * num_blocks
        # How many blocks are free (`len`); read directly on the hot path,
        # where a call to `__len__` costs more than the rest of a decode's
        # allocation.  Changed only here.
        self.count = num_blocks
        # Block -> the job whose growth it is set aside for.
        self._set_aside: dict[int, str] = {}

    def __len__(self) -> int:
        return self.count

    def is_free(self, block: int) -> bool:
        return bool(self._is_free[block])

    def take(self, owner: str, after: int | None, n: int) -> list[int]:
        """`n` free blocks for job `owner` whose table ends with block
        `after` (None: no blocks yet): the blocks right after it while they
        are free, else the oldest free one, from which the next run starts.
        The caller checks that `n` are free."""
        assert n <= self.count
        out: list[int] = []
        is_free, nb = self._is_free, self.num_blocks
        last = after
        while len(out) < n:
            nxt = last + 1 if last is not None else nb
            if nxt < nb and is_free[nxt]:
                b = nxt
                self._set_aside.pop(b, None)
            else:
                b = self._oldest(owner)
            is_free[b] = 0
            out.append(b)
            last = b
        self.count -= n
        if last is not None:
            self._set_aside_after(last, owner)
        return out

    def give_back(self, blocks: list[int]) -> None:
        """Blocks that no job holds any more, to the back of the queue."""
        is_free = self._is_free
        for b in blocks:
            assert not is_free[b], f"block {b} freed twice"
            is_free[b] = 1
        self._queue.extend(blocks)
        self.count += len(blocks)
        if len(self._queue) > 4 * self.num_blocks:
            self._compact()

    def _oldest(self, owner: str) -> int:
        queue, is_free, aside = self._queue, self._is_free, self._set_aside
        while True:
            b = queue.popleft()
            if not is_free[b]:
                continue  # taken out of order since it was queued
            holder = aside.pop(b, None)
            if holder is None or holder == owner:
                return b
            queue.append(b)  # another job's: passed over once

    def _set_aside_after(self, last: int, owner: str) -> None:
        """The free blocks after `last`, up to `run - 1`, for `owner`'s
        growth (not those set aside for another job)."""
        is_free, aside = self._is_free, self._set_aside
        for b in range(last + 1, min(last + self.run, self.num_blocks)):
            if not is_free[b] or aside.setdefault(b, owner) != owner:
                break

    def _compact(self) -> None:
        """Drop the queue's stale and repeated entries, keeping the order of
        each free block's first one."""
        seen: set[int] = set()
        kept: deque[int] = deque()
        for b in self._queue:
            if self._is_free[b] and b not in seen:
                seen.add(b)
                kept.append(b)
        self._queue = kept

    def check(self) -> set[int]:
        """The free blocks; raises AssertionError where the count or the
        queue disagrees with them."""
        free = {b for b in range(self.num_blocks) if self._is_free[b]}
        assert len(free) == self.count, f"{len(free)} free blocks counted as {self.count}"
        missing = free - set(self._queue)
        assert not missing, f"free blocks {sorted(missing)[:5]} not in the queue"
        return free
