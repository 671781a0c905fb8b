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
from collections.abc import Callable, Iterator, Mapping

from scheduler.job import Job
from scheduler.policies.enst import EnstKey, EnstRanking, Rank

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
             last_run: Mapping[str, float]) -> None:
        """Make the members those of `members` that have a rank (the
        policy's jobs), by set differences: O(changes) Python work."""
        ours = self._jobs.keys()
        for jid in ours - members.keys():
            self.discard(jid)
        for jid in members.keys() - ours:
            r = rank.get(jid)
            if r is not None:
                self._insert(members[jid], r, last_run[jid])

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
        # A member appears in both orders; the first appearance carries its
        # ENST (the smaller of its two times).
        seen: set[str] = set()
        for key, jid in _merge(self._by_rank, self._by_run, ranking, reverse=False):
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
        # Largest first, a member's ENST is the later of its two appearances
        # (Q1 members, never promoted, appear once).
        seen: set[str] = set()
        for key, jid in _merge(self._by_rank, self._by_run, ranking, reverse=True):
            if key[2] and jid not in seen:
                seen.add(jid)
                continue
            job = jobs[jid]
            if keep(job):
                yield job


def _merge(by_rank: list[_RankEntry], by_run: list[_RunEntry], ranking: EnstRanking,
           reverse: bool) -> Iterator[tuple[EnstKey, str]]:
    """Both orders as one stream of (key, id), by key.  Each stream is
    sorted by its own key: T_execute's by rank, T_promote's by last run
    (Q1 members have no T_promote and appear in the first only)."""
    a_iter = reversed(by_rank) if reverse else iter(by_rank)
    b_iter = reversed(by_run) if reverse else iter(by_run)
    a = ((ranking.exec_key(r), jid) for r, jid in a_iter)
    b = ((ranking.promote_key(t, lvl, seq), jid) for t, lvl, seq, jid in b_iter if lvl)
    ha, hb = next(a, None), next(b, None)
    while ha is not None or hb is not None:
        if hb is None or (ha is not None and ((ha[0] > hb[0]) if reverse else (ha[0] <= hb[0]))):
            yield ha  # type: ignore[misc]
            ha = next(a, None)
        else:
            yield hb
            hb = next(b, None)
