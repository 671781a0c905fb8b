"""Jobs holding KV, kept in ENST order across plans (FastServe §4.2).

Each plan of the MLFQ evicts the idle device-resident jobs with the largest
ENST and prefetches the host-resident ones with the smallest.  Sorting those
jobs anew every plan costs what memory holds (hundreds of jobs) however few
a plan touches.  ENST(i) = min(T_promote(i), T_execute(i)), and each of the
two orders jobs by a stored property that changes only when the job runs or
changes level: T_execute by the walk rank (class, level, entry order; it
grows with the level within a class), T_promote by the time the job last
ran.  A `RankedSet` keeps its members sorted both ways (bisect on plain
lists: O(log n) to find, a memmove to insert), and a plan merges the two
lazily, taking only as many jobs as it uses.
"""

from __future__ import annotations

import bisect
from itertools import islice
from operator import itemgetter
from collections.abc import Callable, Iterator, Mapping

from scheduler.job import Job
from scheduler.policies.enst import EnstRanking, Rank

# (last run, level, entry order, id): T_promote's order, ties as the walk's.
_RunEntry = tuple[float, int, int, str]
_RankEntry = tuple[Rank, str]


class RankedSet:
    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._entries: dict[str, tuple[_RankEntry, _RunEntry]] = {}
        self._by_rank: list[_RankEntry] = []
        self._by_run: list[_RunEntry] = []

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def sync(self, members: Mapping[str, Job], rank: Mapping[str, Rank],
             last_run: Mapping[str, float], changed: set[str] | None = None) -> None:
        """Make the members those of `members` that have a rank (the
        policy's jobs).  With `changed` (the ids that may have joined or
        left `members` since the last sync, which it empties), the work is
        those changes; without, set differences over both."""
        ours = self._jobs
        if changed is None:
            changed = (ours.keys() - members.keys()) | (members.keys() - ours.keys())
        for jid in changed:
            job = members.get(jid)
            if job is None:
                self.discard(jid)
            elif jid not in ours:
                r = rank.get(jid)
                if r is not None:
                    self._insert(job, r, last_run[jid])
        changed.clear()

    def _insert(self, job: Job, rank: Rank, last_run: float) -> None:
        jid = job.job_id
        re: _RankEntry = (rank, jid)
        ru: _RunEntry = (last_run, rank[1], rank[2], jid)
        self._jobs[jid] = job
        self._entries[jid] = (re, ru)
        bisect.insort(self._by_rank, re)
        bisect.insort(self._by_run, ru)

    def discard(self, job_id: str) -> None:
        entries = self._entries.pop(job_id, None)
        if entries is None:
            return
        del self._jobs[job_id]
        re, ru = entries
        del self._by_rank[bisect.bisect_left(self._by_rank, re)]
        del self._by_run[bisect.bisect_left(self._by_run, ru)]

    def update(self, job_id: str, rank: Rank, last_run: float) -> None:
        """A member changed level or ran.  Only the order whose key changed
        moves; a job that just ran goes to the end of the last-run order,
        which is an append since no member ran later."""
        entries = self._entries.get(job_id)
        if entries is None:
            return
        old_re, old_ru = entries
        re: _RankEntry = (rank, job_id)
        ru: _RunEntry = (last_run, rank[1], rank[2], job_id)
        if re != old_re:
            del self._by_rank[bisect.bisect_left(self._by_rank, old_re)]
            bisect.insort(self._by_rank, re)
        if ru != old_ru:
            by_run = self._by_run
            del by_run[bisect.bisect_left(by_run, old_ru)]
            if not by_run or ru >= by_run[-1]:
                by_run.append(ru)
            else:
                bisect.insort(by_run, ru)
        self._entries[job_id] = (re, ru)

    def ran(self, job_ids: list[str], now: float) -> None:
        """The members among `job_ids` ran at `now`, no earlier than any
        member last ran: their last-run entries move to the end of that
        order, as `update` would move them one by one (ranks unchanged).
        One pass over the order instead of a call, search and memmove per
        job: an iteration's whole batch runs at once."""
        entries = self._entries
        moved: dict[str, _RunEntry] = {}
        for jid in job_ids:
            e = entries.get(jid)
            if e is not None:
                re, ru = e
                new: _RunEntry = (now, ru[1], ru[2], jid)
                moved[jid] = new
                entries[jid] = (re, new)
        if not moved:
            return
        kept = [ru for ru in self._by_run if ru[3] not in moved]
        fresh = sorted(moved.values())
        if kept and fresh[0] < kept[-1]:
            # A member joined at `now` ranks after some of these.
            for ru in fresh:
                bisect.insort(kept, ru)
        else:
            kept += fresh
        self._by_run = kept

    def members(self) -> list[Job]:
        return list(self._jobs.values())

    def ranked_after(self, rank: Rank) -> list[Job]:
        """Members ranked after `rank`, in rank order."""
        by_rank, jobs = self._by_rank, self._jobs
        i = bisect.bisect_right(by_rank, (rank, "\U0010ffff"))
        return list(map(jobs.__getitem__, map(itemgetter(1), by_rank[i:])))

    # Orders ---------------------------------------------------------------

    def ascending(self, ranking: EnstRanking, keep: Callable[[Job], bool]) -> Iterator[Job]:
        """Members that `keep` accepts, smallest ENST key first, lazily."""
        jobs = self._jobs
        if ranking.walk_order:
            for _, jid in self._by_rank:
                job = jobs[jid]
                if keep(job):
                    yield job
            return
        if not ranking.single_class:
            yield from (j for j in sorted(jobs.values(), key=ranking.key) if keep(j))
            return
        # The first of a member's two appearances carries its ENST.
        seen: set[str] = set()
        streams = _Streams(self._by_rank, self._by_run, ranking)
        for jid in _merge(streams.execute(), streams.promote(), reverse=False):
            if jid in seen:
                continue
            seen.add(jid)
            job = jobs[jid]
            if keep(job):
                yield job

    def descending(self, ranking: EnstRanking, keep: Callable[[Job], bool]) -> Iterator[Job]:
        """Members that `keep` accepts, largest ENST key first, lazily."""
        jobs = self._jobs
        if ranking.walk_order:
            for _, jid in reversed(self._by_rank):
                job = jobs[jid]
                if keep(job):
                    yield job
            return
        if not ranking.single_class:
            yield from (j for j in sorted(jobs.values(), key=ranking.key, reverse=True)
                        if keep(j))
            return
        # Largest first, the first appearance is the larger time: each
        # member is taken only from the stream whose time is its ENST.
        streams = _Streams(self._by_rank, self._by_run, ranking, self._entries)
        for jid in _merge(streams.execute(reverse=True, enst_only=True),
                          streams.promote(reverse=True, enst_only=True), reverse=True):
            job = jobs[jid]
            if keep(job):
                yield job


_Key = tuple[float, int, int]


class _Streams:
    """A set's members as two streams of (key, id), one class only: by
    T_execute (its rank order) and by T_promote (its last-run order; Q1
    members have none).  A key compares as (time, level, entry order),
    `EnstRanking.key` without the class, built inline, since a plan may
    pass over most members here.

    Each member's ENST is the smaller of its two times, ties to T_execute
    as `EnstRanking.key` breaks them.  With `enst_only`, a stream holds
    only the members whose ENST it carries, so that the merge holds each
    member once.  The T_execute stream stops below `top`, the lowest level
    from which every T_execute exceeds α: T_promote never does, so no
    member there has its ENST in that stream (under overload most members
    sit there)."""

    def __init__(self, by_rank: list[_RankEntry], by_run: list[_RunEntry],
                 ranking: EnstRanking,
                 entries: Mapping[str, tuple[_RankEntry, _RunEntry]] | None = None) -> None:
        self._by_rank, self._by_run, self._entries = by_rank, by_run, entries
        self.row = row = ranking.exec_row()
        self.alpha, self.now = ranking.alpha, ranking.now
        top = len(row)
        while top > 1 and row[top - 1] > self.alpha:
            top -= 1
        self.top = top
        self._cut = bisect.bisect_left(
            by_rank, ((ranking.only_class, top, -1),))  # type: ignore[arg-type]

    def execute(self, reverse: bool = False, enst_only: bool = False
                ) -> Iterator[tuple[_Key, str]]:
        by_rank, row, alpha, now = self._by_rank, self.row, self.alpha, self.now
        entries = self._entries
        if reverse:
            it = islice(reversed(by_rank), len(by_rank) - self._cut, None)
        else:
            it = islice(by_rank, self._cut)
        for (_, lvl, seq), jid in it:
            t = row[lvl]
            if enst_only and lvl:
                assert entries is not None
                tp = alpha - (now - entries[jid][1][0])
                if (tp if tp > 0.0 else 0.0) < t:
                    continue  # its ENST is T_promote
            yield (t, lvl, seq), jid

    def promote(self, reverse: bool = False, enst_only: bool = False
                ) -> Iterator[tuple[_Key, str]]:
        row, alpha, now, top = self.row, self.alpha, self.now, self.top
        if reverse and enst_only:
            yield from self._promote_descending()
            return
        for t, lvl, seq, jid in reversed(self._by_run) if reverse else self._by_run:
            if lvl:
                tp = alpha - (now - t)
                tp = tp if tp > 0.0 else 0.0
                if not enst_only or lvl >= top or tp < row[lvl]:
                    yield (tp, lvl, seq), jid

    def _promote_descending(self) -> Iterator[tuple[_Key, str]]:
        """`promote(reverse=True, enst_only=True)`.  Members that ran at the
        same time share a T_promote and lie in level order, and T_execute
        rises with the level, so once one of them has its ENST in the
        T_execute stream (Q1, or T_promote ≥ its level's T_execute), so have
        all those below it: the rest of that time is passed over at once.
        The members of the last batches, which the largest-first order
        reaches first and which rarely carry their ENST here, then cost a
        bisection a batch instead of a step a member."""
        by_run, row, alpha, now, top = self._by_run, self.row, self.alpha, self.now, self.top
        i = len(by_run) - 1
        while i >= 0:
            t, lvl, seq, jid = by_run[i]
            tp = alpha - (now - t)
            tp = tp if tp > 0.0 else 0.0
            if lvl and (lvl >= top or tp < row[lvl]):
                yield (tp, lvl, seq), jid
                i -= 1
            else:
                i = bisect.bisect_left(by_run, (t,), 0, i) - 1


def _merge(a: Iterator[tuple[_Key, str]], b: Iterator[tuple[_Key, str]],
           reverse: bool) -> Iterator[str]:
    """Ids of two key-sorted streams, by key (ties: `a` first ascending,
    `b` first descending)."""
    ha, hb = next(a, None), next(b, None)
    while ha is not None or hb is not None:
        if hb is None or (ha is not None and ((ha[0] > hb[0]) if reverse else (ha[0] <= hb[0]))):
            yield ha[1]  # type: ignore[index]
            ha = next(a, None)
        else:
            yield hb[1]
            hb = next(b, None)
