"""The KV a batch of generation tasks will hold, step by step (EconoServe §3.2).

Each GT in the batch holds a *lease*: its tokens now, the output tokens its
allocation has left, and a buffer.  It grows by one token a step until its
allocation is used, may run `buffer` steps longer (a misprediction margin),
and then frees all its blocks.

Exact allocation (§3.3.1) counts every lease at its largest size at once.
KV pipelining (§3.2) counts the blocks the batch holds at each future step:
a short GT placed in the unused tail of a long one's allocation finishes,
and frees its blocks, before the long one grows into that space.  The paper
nests hosted GTs at halves, quarters, ... of the host's length; checking
the whole time profile admits those arrangements and any other that fits,
without fixing the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.blocks import blocks_for


@dataclass(frozen=True, slots=True)
class Lease:
    tokens: int  # prompt + outputs so far
    remaining: int  # output tokens left in the allocation (>= 0)
    buffer: int = 0  # steps it may run past the allocation

    @property
    def end(self) -> int:
        return self.remaining + self.buffer


def final_blocks(lease: Lease, block_size: int) -> int:
    return blocks_for(lease.tokens + lease.remaining, block_size)


def _held_at(x: Lease, t: int, block_size: int) -> int:
    """Blocks `x` holds `t` steps from now (it is alive: t <= x.end)."""
    return blocks_for(x.tokens + min(t, x.remaining), block_size)


class Profile:
    """The blocks a batch's leases hold over the coming steps, with the
    largest total (`peak`) and what it would become with one more lease
    (`peak_with`), each in time linear in the batch's size.

    Between two lease ends the total only grows, so its maximum over the
    future is reached just before some lease ends (that lease included):
    the profile keeps the total at each lease end."""

    def __init__(self, leases: Sequence[Lease], block_size: int, pipelined: bool) -> None:
        self.block_size = block_size
        self.pipelined = pipelined
        self.leases: list[Lease] = list(leases)
        # Exact allocation: every lease at its largest.
        self._total = sum(final_blocks(x, block_size) for x in self.leases)
        # Lease end -> blocks held just before it.
        self._at: dict[int, int] = self._sweep() if pipelined else {}

    def _sweep(self) -> dict[int, int]:
        """The totals at every lease end, in O(n log n + ends × block size)
        rather than a pass over the leases per end.  Ends are visited from
        the last: a lease joins the alive ones at its end, holding its final
        blocks through its buffer, and grows from its allocation's end down,
        where it holds ceil((tokens + e) / bs) = q + a + ceil((r + b) / bs)
        blocks at step e (tokens = q·bs + r, e = a·bs + b): the last term is
        0, 1 or 2 by r, so counts of the growing leases per r give the sum."""
        bs = self.block_size
        by_end = sorted(self.leases, key=lambda x: x.end, reverse=True)
        by_rem = sorted(self.leases, key=lambda x: x.remaining, reverse=True)
        i = j = 0
        final = 0  # alive leases past their allocation: their final blocks
        q_sum = count = 0  # growing leases
        per_r = [0] * bs
        at: dict[int, int] = {}
        for e in sorted({x.end for x in self.leases}, reverse=True):
            while i < len(by_end) and by_end[i].end >= e:
                final += final_blocks(by_end[i], bs)
                i += 1
            while j < len(by_rem) and by_rem[j].remaining >= e:
                x = by_rem[j]
                j += 1
                final -= final_blocks(x, bs)
                q, r = divmod(x.tokens, bs)
                q_sum += q
                count += 1
                per_r[r] += 1
            a, b = divmod(e, bs)
            part = count - per_r[0] if b == 0 else count + sum(per_r[bs + 1 - b:])
            at[e] = final + q_sum + count * a + part
        return at

    @property
    def peak(self) -> int:
        if not self.pipelined:
            return self._total
        return max(self._at.values(), default=0)

    def peak_with(self, new: Lease) -> int:
        bs = self.block_size
        if not self.pipelined:
            return self._total + final_blocks(new, bs)
        peak = 0
        for t, held in self._at.items():
            if t <= new.end:
                held += _held_at(new, t, bs)
            peak = max(peak, held)
        if new.end not in self._at:
            held = _held_at(new, new.end, bs) + sum(
                _held_at(x, new.end, bs) for x in self.leases if x.end >= new.end)
            peak = max(peak, held)
        return peak

    def add(self, new: Lease) -> None:
        bs = self.block_size
        self._total += final_blocks(new, bs)
        if self.pipelined:
            if new.end not in self._at:
                self._at[new.end] = sum(
                    _held_at(x, new.end, bs) for x in self.leases if x.end >= new.end)
            for t in self._at:
                if t <= new.end:
                    self._at[t] += _held_at(new, t, bs)
        self.leases.append(new)


def peak_blocks(leases: Sequence[Lease], block_size: int, pipelined: bool) -> int:
    """The most blocks `leases` hold together at any future step."""
    return Profile(leases, block_size, pipelined).peak
