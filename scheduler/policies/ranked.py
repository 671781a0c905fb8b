"""Jobs holding KV, kept in ENST order across plans (FastServe §4.2).

Each plan of the MLFQ evicts the idle device-resident jobs with the largest
ENST and prefetches the host-resident ones with the smallest.  Sorting those
jobs anew every plan costs what memory holds (hundreds of jobs) however few
a plan touches.  ENST(i) = min(T_promote(i), T_execute(i)), and each of the
two orders jobs by a stored property that changes only when the job runs or
changes level: T_execute by the walk rank (class, level, entry order; it
grows with the level within a class), T_promote by the time the job last
ran.  A `RankedSet` keeps its members sorted both ways, the second within
each level (bisect on plain lists: O(log n) to find, a memmove to insert),
and a plan merges them lazily, taking only as many jobs as it uses.
"""

from __future__ import annotations

import bisect
import heapq
from itertools import islice
from operator import itemgetter
from collections.abc import Callable, Iterable, Iterator, Mapping

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
        # The last-run order, one list per level: the largest-first ENST
        # order finds each level's members whose T_promote is their ENST by
        # one bisection (`_Streams.promote_descending`); the smallest-first
        # order merges the levels.
        self._runs_at: dict[int, list[_RunEntry]] = {}

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
        bisect.insort(self._runs_at.setdefault(ru[1], []), ru)

    def discard(self, job_id: str) -> None:
        entries = self._entries.pop(job_id, None)
        if entries is None:
            return
        del self._jobs[job_id]
        re, ru = entries
        del self._by_rank[bisect.bisect_left(self._by_rank, re)]
        at = self._runs_at[ru[1]]
        del at[bisect.bisect_left(at, ru)]

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
            old_at = self._runs_at[old_ru[1]]
            del old_at[bisect.bisect_left(old_at, old_ru)]
            at = self._runs_at.setdefault(ru[1], [])
            if not at or ru >= at[-1]:
                at.append(ru)
            else:
                bisect.insort(at, ru)
        self._entries[job_id] = (re, ru)

    def ran(self, job_ids: list[str], now: float) -> None:
        """The members among `job_ids` ran at `now`, no earlier than any
        member last ran: their last-run entries move to the end of that
        order of their level, as `update` would move them one by one (ranks
        unchanged).  Each level's order is rebuilt once (`_moved_last`): an
        iteration's whole batch runs at once, and on a long order the Python
        work is the batch's, not the level's."""
        entries = self._entries
        at_level: dict[int, tuple[list[_RunEntry], list[_RunEntry]]] = {}
        for jid in job_ids:
            e = entries.get(jid)
            if e is not None:
                re, ru = e
                new: _RunEntry = (now, ru[1], ru[2], jid)
                entries[jid] = (re, new)
                mine = at_level.get(ru[1])
                if mine is None:
                    at_level[ru[1]] = ([ru], [new])
                else:
                    mine[0].append(ru)
                    mine[1].append(new)
        runs_at = self._runs_at
        for lvl, (old, fresh) in at_level.items():
            fresh.sort()
            runs_at[lvl] = _moved_last(runs_at[lvl], old, fresh)

    def members(self) -> list[Job]:
        return list(self._jobs.values())

    def ranked_after(self, rank: Rank) -> Iterator[Job]:
        """Members ranked after `rank`, in rank order, as they are read (a
        narrowed walk reads only as many as its batch takes, of what may be
        every job holding KV; the order is copied, not the jobs)."""
        by_rank, jobs = self._by_rank, self._jobs
        i = bisect.bisect_right(by_rank, (rank, "\U0010ffff"))
        return map(jobs.__getitem__, map(itemgetter(1), by_rank[i:]))

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
        streams = _Streams(self._by_rank, self._runs_at, ranking)
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
        streams = _Streams(self._by_rank, self._runs_at, ranking, self._entries)
        for jid in _merge(streams.execute(reverse=True, enst_only=True),
                          streams.promote_descending(), reverse=True):
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
    as `EnstRanking.key` breaks them.  The largest-first streams
    (`execute(enst_only=True)`, `promote_descending`) hold only the members
    whose ENST they carry, so that their merge holds each member once.  The
    T_execute stream stops below `top`, the lowest level from which every
    T_execute exceeds α: T_promote never does, so no member there has its
    ENST in that stream (under overload most members sit there)."""

    def __init__(self, by_rank: list[_RankEntry], runs_at: Mapping[int, list[_RunEntry]],
                 ranking: EnstRanking,
                 entries: Mapping[str, tuple[_RankEntry, _RunEntry]] | None = None) -> None:
        self._by_rank, self._runs_at, self._entries = by_rank, runs_at, entries
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

    def promote(self) -> Iterator[tuple[_Key, str]]:
        """Every member but Q1's (never promoted) by T_promote, smallest
        first: the levels' last-run orders merged."""
        levels = [at for lvl, at in self._runs_at.items() if lvl and at]
        return self._promote_keys(levels[0] if len(levels) == 1 else heapq.merge(*levels))

    def promote_descending(self) -> Iterator[tuple[_Key, str]]:
        """The members whose ENST is their T_promote (below their level's
        T_execute; all of them from `top` up; none in Q1), largest first.
        Within a level T_promote rises with the last run, so they are a
        leading run of the level's last-run order, found by one bisection;
        the levels are then merged.  The members that ran last, which a
        largest-first pass over every member would read first and which
        mostly have their ENST in the T_execute stream, are never read."""
        row, alpha, now, top = self.row, self.alpha, self.now, self.top

        def carries_execute(entry: _RunEntry, t_exec: float) -> bool:
            tp = alpha - (now - entry[0])
            return (tp if tp > 0.0 else 0.0) >= t_exec

        streams = []
        for lvl, at in self._runs_at.items():
            if not lvl or not at:
                continue
            n = len(at) if lvl >= top else bisect.bisect_left(
                at, True, key=lambda e, r=row[lvl]: carries_execute(e, r))
            if n:
                streams.append(self._promote_keys(islice(reversed(at), len(at) - n, None)))
        if len(streams) == 1:
            return streams[0]
        return heapq.merge(*streams, reverse=True)

    def _promote_keys(self, entries: Iterable[_RunEntry]) -> Iterator[tuple[_Key, str]]:
        alpha, now = self.alpha, self.now
        for t, lvl, seq, jid in entries:
            tp = alpha - (now - t)
            yield ((tp if tp > 0.0 else 0.0), lvl, seq), jid


def _moved_last(order: list[_RunEntry], old: list[_RunEntry],
                fresh: list[_RunEntry]) -> list[_RunEntry]:
    """`order` with the entries `old` (members of it) replaced by `fresh`
    (their new entries, sorted), which ran last."""
    if len(order) > 16 * len(old):
        # A long order (a GPU-sized pool's): the old entries found by
        # bisection, the rest copied in slices, not read one by one.
        kept: list[_RunEntry] = []
        start = 0
        for i in sorted(bisect.bisect_left(order, ru) for ru in old):
            kept += order[start:i]
            start = i + 1
        kept += order[start:]
    else:
        gone = {ru[3] for ru in old}
        kept = [ru for ru in order if ru[3] not in gone]
    if kept and fresh[0] < kept[-1]:
        # A member joined at `now` ranks after some of these.
        for ru in fresh:
            bisect.insort(kept, ru)
    else:
        kept += fresh
    return kept


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
