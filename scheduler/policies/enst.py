"""ENST, the estimated next scheduled time (FastServe §4.2), as one plan
ranks jobs by it: swap victims largest first, prefetches smallest first.

ENST(i) = min(T_promote(i), T_execute(i)).  T_execute depends on a job's
class and level only (how much service the jobs ahead of it will take), and
grows with the level within a class; T_promote on when the job last ran.
So while no job is close enough to its starvation promotion for T_promote
to be the smaller, ENST orders jobs exactly as the priority walk does
(class, level, entry into the level), which the policy keeps per job: a
plan then ranks the few hundred jobs holding KV by a stored tuple instead
of computing every job's ENST.

T_execute as published charges every job ahead with all the quanta between
its level and this one, as if no job finished before the last queue.  With
predicted lengths (`mlfq.enst: predicted`) a job ahead is charged at most
its predicted remaining service (`Shortfall`): the walk's order within a
class is unchanged (T_execute still grows with the level), but its values
fall, and with them where T_promote takes over.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.job import Job

# (priority class, ENST, level, entry order): equal ENSTs (jobs that last
# ran in the same iteration reach T_promote together) in the walk's order.
EnstKey = tuple[int, float, int, int]
Rank = tuple[int, int, int]


def prefix_sums(quanta: list[float]) -> list[float]:
    out = [0.0]
    for q in quanta:
        out.append(out[-1] + q)
    return out


@dataclass(slots=True)
class ClassShortfall:
    """One class's jobs with a predicted remaining service r_j, as what
    they take off the published charge.  A job at level l is charged, by a
    job at level L, P_max(L, l+1) - P_l (P: the quanta's prefix sums); the
    shortfall is that minus r_j where positive.  From the first level c_j
    where it is positive, it is P_L - (P_l + r_j): counted by c_j in `cnt`
    and `base`.  A job at level L or below (charged only by jobs of less
    important classes) falls short by `cur` = max(0, q_l - r_j)."""

    cnt: list[int]
    base: list[float]
    cur: list[float]


class Shortfall:
    """`ClassShortfall` per class, kept as jobs join, move and leave, so a
    plan reads it in O(classes × levels)."""

    def __init__(self, quanta: list[float]) -> None:
        self.quanta = quanta
        self.prefix = prefix_sums(quanta)
        self.classes: dict[int, ClassShortfall] = {}
        self._jobs: dict[str, tuple[int, int, int, float, float]] = {}

    def set(self, job_id: str, priority: int, level: int, remaining_s: float) -> None:
        self.discard(job_id)
        n = len(self.quanta)
        pl = self.prefix[level]
        c = max(level + 1, bisect_right(self.prefix, pl + remaining_s))
        cur = max(0.0, self.quanta[level] - remaining_s)
        row = self.classes.get(priority)
        if row is None:
            row = self.classes[priority] = ClassShortfall([0] * n, [0.0] * n, [0.0] * n)
        entry = (priority, level, c, pl + remaining_s, cur)
        self._apply(row, entry, 1)
        self._jobs[job_id] = entry

    def discard(self, job_id: str) -> None:
        entry = self._jobs.pop(job_id, None)
        if entry is not None:
            self._apply(self.classes[entry[0]], entry, -1)

    def _apply(self, row: ClassShortfall, entry: tuple[int, int, int, float, float],
               sign: int) -> None:
        _, level, c, base, cur = entry
        if c < len(row.cnt):
            row.cnt[c] += sign
            row.base[c] += sign * base
        row.cur[level] += sign * cur

    def rows(self, priority: int) -> tuple[list[float], list[float]]:
        """Per level L: what the class's jobs above L (`own`) and the
        class's jobs anywhere (`outranking`, for a less important class)
        take off T_execute's sum."""
        n = len(self.quanta)
        row = self.classes.get(priority)
        if row is None:
            return [0.0] * n, [0.0] * n
        own: list[float] = []
        k = b = 0.0
        for lvl in range(n):
            k += row.cnt[lvl]
            b += row.base[lvl]
            own.append(max(0.0, self.prefix[lvl] * k - b))
        outranking = own[:]
        tail = 0.0
        for lvl in range(n - 1, -1, -1):
            tail += row.cur[lvl]
            outranking[lvl] += tail
        return own, outranking


def execute_times(class_level_counts: dict[int, list[int]], quanta: list[float],
                  batch: int, shortfall: Shortfall | None = None) -> dict[int, list[float]]:
    """T_execute per (class, level): (1/B) Σ_{j ahead} Σ_{k from j's level
    to this one} q_k, where the jobs ahead are those of the class in higher
    queues and every job of a more important class; one of those already at
    this level or lower still runs ahead for its current quantum.  With a
    `shortfall`, a job ahead is charged at most its predicted remaining
    service.  O(classes × levels) with running sums over the quanta's
    prefix sums."""
    n = len(quanta)
    prefix = prefix_sums(quanta)
    if shortfall is None and len(class_level_counts) == 1:
        # One class, every job charged all its quanta (the common case,
        # once per plan): the loop below with nothing ahead of the class.
        (p, own), = class_level_counts.items()
        row: list[float] = []
        s0 = s1 = 0.0
        for lvl in range(n):
            ahead = prefix[lvl] * s0 - s1
            row.append(ahead / batch if ahead > 0.0 else 0.0)
            s0 += own[lvl]
            s1 += own[lvl] * prefix[lvl]
        return {p: row}
    out: dict[int, list[float]] = {}
    above = [0] * n  # jobs of the more important classes, per level
    less = [0.0] * n  # what their predictions take off, per level
    for p in sorted(class_level_counts):
        own = class_level_counts[p]
        outranked = any(above)
        tail = [0.0] * (n + 1)  # Σ_{k ≥ lvl} above[k] · q_k
        if outranked:
            for k in range(n - 1, -1, -1):
                tail[k] = tail[k + 1] + above[k] * quanta[k]
        own_less, outranking_less = (shortfall.rows(p) if shortfall is not None
                                     else ([0.0] * n, [0.0] * n))
        row = []
        s0 = s1 = a0 = a1 = 0.0
        for lvl in range(n):
            ahead = prefix[lvl] * s0 - s1 - own_less[lvl]
            if outranked:
                ahead += prefix[lvl] * a0 - a1 + tail[lvl] - less[lvl]
            row.append(max(0.0, ahead) / batch)
            s0 += own[lvl]
            s1 += own[lvl] * prefix[lvl]
            a0 += above[lvl]
            a1 += above[lvl] * prefix[lvl]
        out[p] = row
        above = [a + c for a, c in zip(above, own)]
        less = [a + c for a, c in zip(less, outranking_less)]
    return out


class EnstRanking:
    """One plan's view: T_execute frozen from the queue lengths at its start.

    `promotes` is False for the variants that never promote (T_promote is
    then infinite for every job)."""

    def __init__(self, exec_times: dict[int, list[float]], rank: dict[str, Rank],
                 last_run: dict[str, float], alpha: float, now: float, promotes: bool) -> None:
        self._exec = exec_times
        self._rank = rank
        self._last_run = last_run
        self._alpha = alpha
        self._now = now
        # Whether any job may have T_promote < T_execute: the least
        # recently run job (first in `last_run`) is the closest to
        # promotion, and no T_execute exceeds the largest.
        oldest = next(iter(last_run.values()), now)
        t_max = max((max(row) for row in exec_times.values()), default=0.0)
        self.walk_order = not promotes or alpha - (now - oldest) >= t_max
        self.single_class = len(exec_times) <= 1
        self._only_class = next(iter(exec_times), 0)
        self._promotes = promotes

    def value(self, job: Job) -> float:
        return self.key(job)[1]

    def key(self, job: Job) -> EnstKey:
        jid = job.job_id
        p, lvl, seq = self._rank[jid]
        t = self._exec[p][lvl]
        if self._promotes and lvl:  # Q1 is never promoted
            tp = self._alpha - (self._now - self._last_run[jid])
            if tp < t:
                t = tp if tp > 0.0 else 0.0
        return (p, t, lvl, seq)

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def now(self) -> float:
        return self._now

    @property
    def only_class(self) -> int:
        return self._only_class

    def exec_row(self) -> list[float]:
        """T_execute per level of the only class (`single_class` rankings)."""
        return self._exec[self._only_class]


class RankingOnce:
    """A plan's `EnstRanking`, made by `make` when first asked for: a
    steady decode plan evicts and swaps nothing and needs none.  (A
    `functools.cache` of it cost more to create than the ranking itself.)"""

    __slots__ = ("_make", "_ranking")

    def __init__(self, make: Callable[[], EnstRanking]) -> None:
        self._make = make
        self._ranking: EnstRanking | None = None

    def __call__(self) -> EnstRanking:
        if self._ranking is None:
            self._ranking = self._make()
        return self._ranking

