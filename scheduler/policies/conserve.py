"""Online/offline co-serving (ConServe §4.2 and §4.5, Algorithm 1).

Two classes of jobs share a replica: online jobs (chat, with latency
objectives) and offline jobs (batch work, for throughput).  The policy plans
every iteration afresh, in this order:

1. **Online first.**  Running online jobs, then waiting ones, in the order
   `fcfs` uses (priority, then arrival; `WaitingLines`), up to the
   iteration's token and batch limits.  An online job never waits behind
   offline work, for compute or for memory: when the KV cache is full,
   offline jobs give up their blocks first (swapped to the host tier or
   dropped for recompute, per `swap_mode`), the most recently admitted
   first; only then does an online job evict another online one.
2. **The SLO-aware budget** (§4.5).  While online work is present
   (co-serving mode) the iteration may hold at most the tokens whose cost,
   by the replica's cost estimate, stays within the online TPOT objective
   (the batch decodes online jobs) or the TTFT objective (it only
   prefills them).  Offline tokens fill what the online ones leave of it.
3. **Offline batching mode** (§4.2).  With no online job present, offline
   jobs batch up to `conserve.offline_max_batch_size` /
   `offline_max_batch_tokens`, ignoring the budget.
4. **Preemption at iteration granularity** (Algorithm 1,
   PreemptOverBudgetOffline).  Since each plan is made anew, offline jobs
   over the budget leave the batch the moment online work arrives.  They
   keep their KV (paused) until an online job needs the memory.

Online ordering is FCFS by priority here; ordering the online class by
skip-join MLFQ instead is planned (the online class would be planned by an
`MLFQPolicy` over the online jobs, with this policy's offline filling on
top).
"""

from __future__ import annotations

from bisect import insort

from scheduler.job import Job, JobClass
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.lines import WaitingLines
from scheduler.policy import Policy

ONLINE, OFFLINE = JobClass.ONLINE, JobClass.OFFLINE


def _priority(job: Job) -> int:
    return job.priority


class ConservePolicy(Policy):
    name = "conserve"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._waiting = {ONLINE: WaitingLines(), OFFLINE: WaitingLines()}
        # By priority, admission order within one.
        self._running: dict[JobClass, list[Job]] = {ONLINE: [], OFFLINE: []}
        # Waiting jobs that hold device blocks: siblings that adopted a prompt.
        self._holding: list[Job] = []
        self._budget_cache: dict[float, int] = {}
        # This plan's jobs by id, and whether it evicted an online job.
        self._by_id: dict[str, Job] = {}
        self._evicted_online = False
        # What the latest plan did, for metrics and tests.
        self.coserving = False
        self.offline_paused = 0

    # Queues -----------------------------------------------------------

    def add(self, job: Job) -> None:
        self._waiting[job.job_class].add(job)
        if job.block_table:
            self._holding.append(job)

    def remove(self, job: Job) -> None:
        running = self._running[job.job_class]
        if job in running:
            running.remove(job)
        else:
            self._waiting[job.job_class].remove(job)
            self._forget_holding(job)

    def _forget_holding(self, job: Job) -> None:
        if self._holding and job in self._holding:
            self._holding.remove(job)

    def num_waiting(self) -> int:
        return len(self._waiting[ONLINE]) + len(self._waiting[OFFLINE])

    def num_running(self) -> int:
        return len(self._running[ONLINE]) + len(self._running[OFFLINE])

    def waiting(self, job_class: JobClass) -> list[Job]:
        return list(self._waiting[job_class])

    def running(self, job_class: JobClass) -> list[Job]:
        return list(self._running[job_class])

    # The budget (§4.5) ----------------------------------------------------

    def slo(self) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) objectives in seconds: as configured, else 10× and
        3× the cost estimate's batch-1 decode iteration."""
        cc = self.config.conserve
        one = self.cost.decode_time(1) if self.cost is not None else None
        ttft = cc.ttft_slo_s if cc.ttft_slo_s is not None else (10 * one if one else None)
        tpot = cc.tpot_slo_s if cc.tpot_slo_s is not None else (3 * one if one else None)
        return ttft, tpot

    def budget(self, slo_s: float | None) -> int:
        """Most tokens an iteration may hold and still take ≤ `slo_s`,
        by the cost estimate (an iteration of n tokens costs about what a
        prefill of n tokens does).  No estimate or objective: no bound
        beyond `max_batch_tokens`."""
        cap = self.config.max_batch_tokens
        if slo_s is None or self.cost is None:
            return cap
        hit = self._budget_cache.get(slo_s)
        if hit is not None:
            return hit
        lo, hi = 0, cap  # largest n in [0, cap] with prefill_time(n) <= slo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.prefill_time(mid) <= slo_s:
                lo = mid
            else:
                hi = mid - 1
        self._budget_cache[slo_s] = lo
        return lo

    # Planning -----------------------------------------------------------

    def schedule(self, step: int) -> Plan:
        cfg = self.config
        plan = Plan(step=step)
        served: set[str] = set()
        self._by_id.clear()
        self._evicted_online = False
        tokens = self._plan_online(plan, served, cfg.max_batch_tokens)
        online_tokens = cfg.max_batch_tokens - tokens
        self.coserving = bool(self._running[ONLINE] or self._waiting[ONLINE])
        if self.coserving:
            ttft, tpot = self.slo()
            decodes = any(c.start_pos >= self._job_prompt_len(c) for c in plan.chunks)
            room = max(0, min(tokens, self.budget(tpot if decodes else ttft) - online_tokens))
            max_seqs = cfg.max_batch_size
        else:
            room = cfg.conserve.offline_max_batch_tokens or cfg.max_batch_tokens
            max_seqs = cfg.conserve.offline_max_batch_size or cfg.max_batch_size
        self._plan_offline(plan, served, room, max_seqs)
        return plan

    def _job_prompt_len(self, chunk: ScheduledChunk) -> int:
        return self._by_id[chunk.job_id].num_prompt_tokens

    def _plan_online(self, plan: Plan, served: set[str], tokens: int) -> int:
        """Online chunks into `plan`; returns the tokens left."""
        running = self._running[ONLINE]
        i = 0
        while i < len(running) and tokens > 0:
            job = running[i]
            i += 1
            if not job.is_resident:  # a swap-in still in flight
                continue
            n = min(job.num_uncomputed_tokens, tokens)
            # Victims come after `job` (those before it are served or wait
            # on a swap-in), so the walk's index stays valid.
            if self._make_room(job, n, plan, served, evict_online=True):
                tokens -= self._add_chunk(plan, served, job, n)
        # vLLM's rule: an iteration that had to evict an online job admits
        # no new one, or the evicted job would be overtaken.
        waiting = self._waiting[ONLINE]
        while (waiting and tokens > 0 and not self._evicted_online
               and len(running) < self.config.max_batch_size):
            job = waiting.head()
            if job.num_host_blocks:
                if not self._swap_in(job, plan, served, evict_online=False):
                    break
                insort(running, waiting.pop_head(), key=_priority)
                continue  # it runs once the copy lands
            n = min(job.num_uncomputed_tokens, tokens)
            if not self._make_room(job, n, plan, served, evict_online=False):
                break
            waiting.pop_head()
            self._forget_holding(job)
            insort(running, job, key=_priority)
            tokens -= self._add_chunk(plan, served, job, n)
        return tokens

    def _plan_offline(self, plan: Plan, served: set[str], room: int, max_seqs: int) -> None:
        running = self._running[OFFLINE]
        paused = 0
        for job in list(running):
            if not job.is_resident:
                continue
            n = min(job.num_uncomputed_tokens, room)
            if n <= 0 or len(plan.chunks) >= max_seqs:
                paused += 1
                continue
            if not self._make_room(job, n, plan, served, evict_online=False):
                paused += 1
                continue
            room -= self._add_chunk(plan, served, job, n)
        self.offline_paused = paused
        waiting = self._waiting[OFFLINE]
        while (waiting and room > 0 and not plan.preempted
               and len(running) < max_seqs and len(plan.chunks) < max_seqs):
            job = waiting.head()
            if job.num_host_blocks:
                if not self._swap_in(job, plan, served, evict_online=False):
                    break
                running.append(waiting.pop_head())
                continue
            n = min(job.num_uncomputed_tokens, room)
            if not self._make_room(job, n, plan, served, evict_online=False):
                break
            waiting.pop_head()
            self._forget_holding(job)
            running.append(job)
            room -= self._add_chunk(plan, served, job, n)

    def _add_chunk(self, plan: Plan, served: set[str], job: Job, n: int) -> int:
        plan.chunks.append(self.chunk_for(job, n))
        served.add(job.job_id)
        self._by_id[job.job_id] = job
        return n

    # Memory ---------------------------------------------------------------

    def _swap_in(self, job: Job, plan: Plan, served: set[str], evict_online: bool) -> bool:
        while not self.blocks.can_allocate(job.num_host_blocks):
            if not self._evict_one(job, plan, served, evict_online):
                return False
        ops = self.swap.swap_in(job)
        if ops is None:
            return False
        plan.block_ops += ops
        return True

    def _make_room(self, job: Job, n: int, plan: Plan, served: set[str],
                   evict_online: bool) -> bool:
        """Grow `job` by `n` tokens' blocks, evicting what may go: waiting
        holders, offline jobs (an online job's blocks come before any
        offline job's), then, if `evict_online`, later online jobs."""
        while not self.blocks.grow(job, n):
            if not self._evict_one(job, plan, served, evict_online and job.job_class is ONLINE):
                return False
        return True

    def _evict_one(self, beside: Job, plan: Plan, served: set[str], evict_online: bool) -> bool:
        holder = self._waiting_victim(beside)
        if holder is not None:
            self._forget_holding(holder)
            self.evict(holder, plan.block_ops)
            plan.preempted.append(holder.job_id)
            return True
        classes = [OFFLINE] if beside.job_class is OFFLINE else [OFFLINE, ONLINE]
        for cls in classes:
            if cls is ONLINE and not evict_online:
                break
            running = self._running[cls]
            for victim in reversed(running):
                if victim.job_id in served or victim.swap_pending is not None:
                    continue
                if cls is ONLINE and victim is beside:
                    continue
                running.remove(victim)
                self.evict(victim, plan.block_ops)
                self._waiting[cls].requeue(victim)
                plan.preempted.append(victim.job_id)
                self._evicted_online |= cls is ONLINE
                return True
        return False

    def _waiting_victim(self, beside: Job) -> Job | None:
        """A waiting sibling other than `beside` whose adopted blocks no
        running job holds too (as in `fcfs`)."""
        if not self._holding:
            return None
        running = {j.job_id for cls in (ONLINE, OFFLINE) for j in self._running[cls]}
        idle = [j for j in self._holding if j is not beside
                and not any(self.blocks.holders(b) & running for b in j.block_table)]
        if not idle:
            return None
        # Offline siblings go first, then the least important online one.
        return max(idle, key=lambda j: (j.job_class is OFFLINE, j.priority, j.arrival_seq))
