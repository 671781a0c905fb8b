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
        self.leases: list[Lease] = []
        self._total = 0  # exact allocation: every lease at its largest
        self._at: dict[int, int] = {}  # lease end -> blocks held just before it
        for x in leases:
            self.add(x)

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
