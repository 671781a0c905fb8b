"""The cluster-level offline pool: offline requests wait here, not on a
replica, and go to the replicas with spare capacity.

ConServe's scheduler "continuously fetches and schedules offline requests"
from a pool (§4.1; Algorithm 1's global Q_off).  With several engine
replicas, placing each offline request on a replica the moment it arrives
would leave it queued behind online work on a busy replica while another
replica idles.  So, under `policy: conserve`, the Scheduler deployment holds
offline requests here and hands one to a replica only when that replica has
room for it:

- **Room.**  A replica may hold a queue of offline jobs outside its
  running batch, on top of the batch slots it has free now: enough to
  refill its offline batch as jobs finish between two load reports, and no
  more, so that work does not sit on a replica that cannot run it.  The
  queue is `replica_queue_jobs`, or `queue_per_start` (2) times the offline
  jobs the replica started (sampled a first token) between its last two
  reports, if more:
  a fast replica filling a large SLO budget takes in dozens a report, and
  a queue that only matched its last intake would never let it grow
  (studies/conserve_sim/README.md, "Several replicas").  Free
  slots count only on a replica with no online job and no offline job
  waiting (offline batching mode, §4.2), and no more of them than its free
  KV blocks hold answers of the replica's mean length; on a replica serving
  online work, offline jobs run only within the SLO-aware budget (§4.5), so
  it gets just its queue's worth, to fill that budget.
- **Preference.**  Among replicas with room, the one whose queued work
  (its online jobs' remaining tokens, its waiting offline jobs', and what it
  was handed since) would take the least time at its measured tokens/s,
  then the one with the most free KV blocks.
- **Order.**  Lower `priority` first (vLLM's meaning), arrival order within
  one priority.  The head of the pool waits until some replica has room;
  nothing behind it overtakes it, and a replica with room takes a request
  of any size, so nothing starves.
- **Giving back.**  Room is judged when a request is handed out; a
  replica may then take online work and leave the offline requests it was
  handed waiting behind it while another replica runs out of offline work.
  So, with `move_queued`, when the pool is empty and some replica has free
  batch slots, a replica serving online work that holds offline jobs
  outside its batch is asked (in the answer to its load report) to give
  back as many of them as the others' free slots take (`to_give_back`):
  those that have not started (no KV computed, nothing streamed), and
  those that started whose KV is in the host tier, which every replica
  reads, but for at most about one iteration's prefill (`movable_offline`).  Their streams end
  with `JobMoved`; the ingress sends each request to the pool again, a
  started one with the tokens its client has (deployments/resume.py), from
  where it goes where there is room, and resumes there from the host tier.
  A replica is asked at most every `GIVE_BACK_EVERY_S`, so that its next
  reports show what it gave before it is asked again.

Replicas report their load about twice a second (`OfflineLoad`, computed
by `offline_load` on the replica), with a count of the offline requests
they have accepted so far.  A hand-out counts on top of its replica's
reported figures until that count shows it arrived (the replica's figures
include a request from the moment its `generate` call accepts it), so a
report sent while a hand-out is still on its way does not open room for it
twice, however slow the way.  A hand-out that never arrives (its client
went away between the two calls) stops counting after `lost_after_s`.
Replicas that stop reporting are dropped, as `scheduler/placement.py`
drops them.

No Ray, no clock of its own: every call takes `now`, so the pool is
deterministic and tested on a fake clock.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.admission import queued_work
from scheduler.config import OfflinePoolConfig, SchedulerConfig
from scheduler.job import Job, JobClass


# Seconds between two requests to one replica to give back offline work.
GIVE_BACK_EVERY_S = 2.0


@dataclass(frozen=True, slots=True)
class OfflineLoad:
    """What an engine replica reports for the pool (`offline_load`)."""

    # Expected tokens still to compute for its online jobs, running or not.
    online_tokens: int = 0
    # Offline jobs outside its running batch (waiting, paused or preempted,
    # or accepted and not yet taken from its inbox), and their expected
    # tokens still to compute.
    queued_jobs: int = 0
    queued_tokens: int = 0
    # Offline jobs in its running batch.
    running_jobs: int = 0
    # Offline jobs it could start at its next iteration.
    free_slots: int = 0
    # Offline requests (`generate` calls) it has accepted since it started.
    accepted: int = 0
    # Offline jobs that sampled their first token since it started.
    started: int = 0

    def to_wire(self) -> dict[str, int]:
        return asdict(self)


def offline_load(jobs: Iterable[Job], batch: Collection[str], mean_output_len: float,
                 batch_limit: int, free_blocks: int, block_size: int,
                 inbox_jobs: int = 0, inbox_tokens: int = 0,
                 accepted: int = 0, started: int = 0) -> OfflineLoad:
    """A replica's figures for the pool, from its jobs and its latest plan's
    `batch`.  `batch_limit`: its offline batch size (offline batching mode);
    `inbox_jobs` / `inbox_tokens`: offline jobs accepted and not yet in
    `jobs`; `accepted`: its count of offline requests accepted."""
    online: list[Job] = []
    waiting: list[Job] = []
    running = 0
    for job in jobs:
        if job.job_class is JobClass.ONLINE:
            online.append(job)
        elif job.job_id in batch:
            running += 1
        else:
            waiting.append(job)
    queued_jobs = len(waiting) + inbox_jobs
    slots = 0
    if not online and queued_jobs == 0:
        # A new job's KV grows to its prompt plus its answer; the mean
        # answer is what is known of that here.
        per_job = max(1, math.ceil(mean_output_len / block_size))
        slots = max(0, min(batch_limit - running, free_blocks // per_job))
    return OfflineLoad(
        online_tokens=queued_work(online, (), mean_output_len),
        queued_jobs=queued_jobs,
        queued_tokens=queued_work(waiting, batch, mean_output_len) + inbox_tokens,
        running_jobs=running,
        free_slots=slots,
        accepted=accepted,
        started=started,
    )


def movable_offline(groups: Mapping[str, list[str]], jobs: Mapping[str, Job],
                    batch: Collection[str], count: int,
                    recompute_blocks: int | None = None) -> list[str]:
    """Up to `count` of the requests `groups` (request id -> its choices'
    job ids, in arrival order) that a replica can give back whole: offline,
    outside its batch, and nothing computed (no KV, not even a prefix
    adopted from the cache, no checkpoint) and nothing sampled.  With
    `recompute_blocks`, also those that started, with no copy in flight
    and their KV either in the host tier or nowhere (preempted back to a
    checkpoint, ConServe §4.4, swapped out, or to be recomputed) or on the
    device with at most `recompute_blocks` blocks past their host copy:
    resuming elsewhere fetches what resuming here would and recomputes at
    most those blocks, about one iteration's prefill, provided the tier is
    one every replica reads.  Newest first: the oldest are the nearest to a
    slot where they are."""
    out: list[str] = []
    for rid in reversed(list(groups)):
        if len(out) >= count:
            break
        ids = groups[rid]
        if ids and all((j := jobs.get(i)) is not None and j.job_class is JobClass.OFFLINE
                       and i not in batch and _movable(j, recompute_blocks) for i in ids):
            out.append(rid)
    return out


def recompute_bound(config: SchedulerConfig) -> int:
    """Device blocks a started request may leave to recompute when it moves
    (`movable_offline`): about one iteration's prefill."""
    return max(1, config.max_batch_tokens // config.block_size)


def _movable(job: Job, recompute_blocks: int | None) -> bool:
    if recompute_blocks is not None and job.swap_pending is None:
        return not job.block_table or (
            job.num_host_blocks == 0
            and len(job.block_table) - job.num_checkpointed_blocks <= recompute_blocks)
    return (job.num_computed_tokens == 0 and not job.output_token_ids
            and not job.num_checkpointed_blocks)


@dataclass(slots=True)
class _Waiting:
    request_id: str
    jobs: int  # its `n` choices
    tokens: int  # prompt + n * max_tokens: the most it can cost
    priority: int
    since: float


@dataclass(slots=True)
class _HandOut:
    request_id: str
    replica_id: str
    jobs: int
    tokens: int
    at: float
    # Reflected in the replica's own figures (its count of accepted requests
    # passed it), or given up as lost.
    settled: bool = False


@dataclass(slots=True)
class _Replica:
    replica_id: str
    load: OfflineLoad
    free_blocks: int
    num_blocks: int
    tokens_per_s: float | None
    reported_at: float
    # Offline jobs it started between its last two reports.
    recent_starts: int = 0


class OfflinePool:
    def __init__(self, config: OfflinePoolConfig, stale_after_s: float = 10.0,
                 lost_after_s: float = 10.0) -> None:
        self.config = config
        self.stale_after_s = stale_after_s
        self.lost_after_s = lost_after_s
        # Priority -> its waiting requests in arrival order (insertion-
        # ordered dicts: a cancellation is O(1)); `_levels` sorted.
        self._queues: dict[int, dict[str, _Waiting]] = {}
        self._levels: list[int] = []
        self._where: dict[str, int] = {}
        self.replicas: dict[str, _Replica] = {}
        # Handed out and not yet released, by request id.
        self.handed: dict[str, _HandOut] = {}
        self.num_handed_out = 0
        # Replica -> when it was last asked to give back offline work.
        self._asked: dict[str, float] = {}
        self.num_give_backs_asked = 0
        # Per replica: arrivals its count will show of hand-outs already
        # released (`release`), which settle no other hand-out.
        self._owed: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    # Requests ------------------------------------------------------------

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int, n: int,
            priority: int, now: float) -> None:
        if request_id in self._where or request_id in self.handed:
            raise ValueError(f"request {request_id!r} is already in the offline pool")
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = {}
            insort(self._levels, priority)
        queue[request_id] = _Waiting(request_id, n, prompt_tokens + n * max_tokens,
                                     priority, now)
        self._where[request_id] = priority

    def cancel(self, request_id: str) -> str | None:
        """Forget a request whose client went away before it was sent to a
        replica: still waiting, or handed out but never to arrive.  Returns
        "waiting", "handed_out", or None if unknown."""
        priority = self._where.pop(request_id, None)
        if priority is not None:
            queue = self._queues[priority]
            del queue[request_id]
            if not queue:
                del self._queues[priority]
                self._levels.remove(priority)
            return "waiting"
        return "handed_out" if self.handed.pop(request_id, None) is not None else None

    def release(self, request_id: str) -> None:
        """Forget a request that was sent to its replica and ended there."""
        h = self.handed.pop(request_id, None)
        if h is not None and not h.settled:
            # It arrived (it ended) though no report has counted it yet: the
            # arrival the replica's count will show is not another's.
            self._owed[h.replica_id] = self._owed.get(h.replica_id, 0) + 1

    def drain(self) -> list[str]:
        """Empty the pool (shutdown); the requests that were waiting, in order."""
        out = [rid for p in self._levels for rid in self._queues[p]]
        self._queues.clear()
        self._levels.clear()
        self._where.clear()
        return out

    # Replicas ------------------------------------------------------------

    def report(self, replica_id: str, load: OfflineLoad, free_blocks: int, num_blocks: int,
               tokens_per_s: float | None, now: float) -> None:
        prev = self.replicas.get(replica_id)
        starts = max(0, load.started - prev.load.started) if prev is not None else 0
        self.replicas[replica_id] = _Replica(replica_id, load, free_blocks, num_blocks,
                                             tokens_per_s, now, starts)
        # Arrivals since its last report settle as many hand-outs, oldest
        # first (which one arrived does not matter: they are counted, not
        # named).  A replica new to the pool (or back after going stale)
        # had nothing handed to it that its figures lack.
        arrived = load.accepted - prev.load.accepted if prev is not None else None
        if arrived is None:
            self._owed.pop(replica_id, None)
        elif arrived > 0:
            owed = self._owed.pop(replica_id, 0)
            if owed > arrived:
                self._owed[replica_id] = owed - arrived
            arrived = max(0, arrived - owed)
        for h in self.handed.values():  # in hand-out order
            if h.replica_id != replica_id or h.settled:
                continue
            if arrived is None or h.at < now - self.lost_after_s:
                h.settled = True
            elif arrived > 0:
                h.settled = True
                arrived -= 1

    def forget(self, replica_id: str) -> None:
        """A replica let go: nothing more is handed to it."""
        self.replicas.pop(replica_id, None)
        self._owed.pop(replica_id, None)

    def _live(self, now: float) -> list[_Replica]:
        """The replicas that reported lately; the others are forgotten."""
        self.replicas = {rid: r for rid, r in self.replicas.items()
                         if now - r.reported_at <= self.stale_after_s}
        self._owed = {rid: n for rid, n in self._owed.items() if rid in self.replicas}
        return list(self.replicas.values())

    def _pending(self) -> dict[str, tuple[int, int]]:
        """Per replica, the jobs and tokens handed to it that its figures do
        not show yet."""
        out: dict[str, tuple[int, int]] = {}
        for h in self.handed.values():
            if not h.settled:
                jobs, tokens = out.get(h.replica_id, (0, 0))
                out[h.replica_id] = (jobs + h.jobs, tokens + h.tokens)
        return out

    def room(self, replica_id: str) -> int:
        """Offline jobs the replica may still be handed (≤ 0: none)."""
        r = self.replicas.get(replica_id)
        if r is None:
            return 0
        return self._room(r, self._pending().get(replica_id, (0, 0))[0])

    def _room(self, r: _Replica, pending_jobs: int) -> int:
        queue = max(self.config.replica_queue_jobs,
                    int(self.config.queue_per_start * r.recent_starts))
        return queue + r.load.free_slots - r.load.queued_jobs - pending_jobs

    # Decisions -------------------------------------------------------------

    def assign(self, now: float) -> list[tuple[str, str]]:
        """Hand out what fits: (request id, replica id) pairs, in pool order."""
        out: list[tuple[str, str]] = []
        if not self._where:
            return out
        live = self._live(now)
        pending = self._pending()
        known = [r.tokens_per_s for r in live if r.tokens_per_s]
        # A replica that has not measured its speed is taken as average.
        default_tps = sum(known) / len(known) if known else 1.0
        while self._levels:
            best = None
            best_key: tuple[float, int, str] | None = None
            for r in live:
                jobs, tokens = pending.get(r.replica_id, (0, 0))
                if self._room(r, jobs) <= 0:
                    continue
                work = r.load.online_tokens + r.load.queued_tokens + tokens
                key = (work / (r.tokens_per_s or default_tps), -r.free_blocks, r.replica_id)
                if best_key is None or key < best_key:
                    best, best_key = r, key
            if best is None:
                break
            head = next(iter(self._queues[self._levels[0]].values()))
            self.cancel(head.request_id)
            self.handed[head.request_id] = _HandOut(head.request_id, best.replica_id,
                                                    head.jobs, head.tokens, now)
            jobs, tokens = pending.get(best.replica_id, (0, 0))
            pending[best.replica_id] = (jobs + head.jobs, tokens + head.tokens)
            self.num_handed_out += 1
            out.append((head.request_id, best.replica_id))
        return out

    def to_give_back(self, replica_id: str, now: float) -> int:
        """How many offline jobs the replica that just reported
        should give back to the pool: those it holds outside its batch
        while serving online work, up to the free batch slots of the other
        replicas, when nothing waits in the pool for those slots."""
        r = self.replicas.get(replica_id)
        if (not self.config.move_queued or self._where or r is None
                or r.load.online_tokens <= 0 or r.load.queued_jobs <= 0
                or now - self._asked.get(replica_id, -math.inf) < GIVE_BACK_EVERY_S):
            return 0
        pending = self._pending()
        free = sum(max(0, o.load.free_slots - pending.get(o.replica_id, (0, 0))[0])
                   for o in self._live(now) if o.replica_id != replica_id)
        wanted = min(r.load.queued_jobs, free)
        if wanted > 0:
            self._asked[replica_id] = now
            self.num_give_backs_asked += 1
        return wanted

    def stats(self, now: float) -> dict[str, Any]:
        live = self._live(now)
        pending = self._pending()
        held: dict[str, int] = {}
        for h in self.handed.values():
            held[h.replica_id] = held.get(h.replica_id, 0) + h.jobs
        waiting = [w for p in self._levels for w in self._queues[p].values()]
        return {
            "waiting": len(waiting),
            "waiting_jobs": sum(w.jobs for w in waiting),
            "oldest_wait_s": max((now - w.since for w in waiting), default=0.0),
            "handed_out": self.num_handed_out,
            "give_backs_asked": self.num_give_backs_asked,
            "replica_queue_jobs": self.config.replica_queue_jobs,
            "replicas": {
                r.replica_id: {
                    **r.load.to_wire(),
                    "pending_jobs": pending.get(r.replica_id, (0, 0))[0],
                    "room": self._room(r, pending.get(r.replica_id, (0, 0))[0]),
                    # Offline jobs handed to it and not yet ended.
                    "assigned_jobs": held.get(r.replica_id, 0),
                }
                for r in live
            },
        }
