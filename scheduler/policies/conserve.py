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
   (co-serving mode), offline chunks join the iteration only while the
   replica's cost estimate of the whole batch (its decodes, their context
   and its prefill tokens) stays within the online TPOT objective (the
   batch decodes online jobs) or the TTFT objective (it only prefills
   them); a prefill chunk is cut to the largest size that fits.  On a
   replica the estimate is refitted to every measured iteration
   (`conserve.cost_fit: live`, scheduler/cost_fit.py).
3. **Offline batching mode** (§4.2).  With no online job present, offline
   jobs batch up to `conserve.offline_max_batch_size` /
   `offline_max_batch_tokens`, ignoring the budget.
4. **Preemption** (Algorithm 1, PreemptOverBudgetOffline; §4.3).  Since
   each plan is made anew, offline jobs over the budget leave the batch the
   moment online work arrives; they keep their KV (paused) until an online
   job needs the memory.  A plan made in offline batching mode is marked
   `preemptible_at_layers`: an online arrival cuts its forward pass between
   layers (engine/preemption.py) and the next plan serves the online job,
   unless the pass would end soon enough for the online work to meet the
   TTFT objective after it (Algorithm 2, `cut_wanted`).
5. **Incremental checkpointing** (§4.4, `scheduler/checkpoint.py`).
   Under memory pressure each plan also copies newly filled blocks of
   running offline jobs to the host tier (CHECKPOINT ops, off the critical
   path); evicting a checkpointed job then frees its blocks with no copy,
   and it resumes from its checkpoint (PREFETCH) while others compute,
   recomputing only the tokens past it.  Checkpointed jobs are evicted
   before others.

Online jobs are ordered among themselves as `fcfs` orders them, or, with
`conserve.online_order: mlfq`, by FastServe's skip-join MLFQ (§4.1): an
`MLFQPolicy` is kept over the online jobs for its queues alone (skip-join
on arrival, demotion by attained service, starvation promotion; it plans
nothing), each plan walks online jobs in its order, and a running online
job it does not reach this iteration is paused with its KV, as offline
jobs are.  Memory still comes from offline jobs first, then from the
online job the MLFQ ranks last.
"""

from __future__ import annotations

from bisect import insort

from scheduler.checkpoint import plan_checkpoints
from scheduler.cost_fit import IterationShape
from scheduler.job import Job, JobClass
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.kv_profile import Lease, Profile
from scheduler.policies.lines import WaitingLines
from scheduler.policies.mlfq import MLFQPolicy
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
        # The jobs this plan computes, by id (never evicted by it), and
        # whether it evicted an online job.
        self._by_id: dict[str, Job] = {}
        self._evicted_online = False
        # What the latest plan did, for metrics and tests.
        self.coserving = False
        self.offline_paused = 0
        # The online class's skip-join MLFQ queues (`online_order: mlfq`).
        self.mlfq: MLFQPolicy | None = None
        if self.config.conserve.online_order == "mlfq":
            self.mlfq = MLFQPolicy(self.config, self.blocks, self.clock, self.swap, self.cost)

    # Queues -----------------------------------------------------------

    def add(self, job: Job) -> None:
        self._waiting[job.job_class].add(job)
        if job.block_table:
            self._holding.append(job)
        if self.mlfq is not None and job.job_class is ONLINE:
            self.mlfq.add(job)

    def remove(self, job: Job) -> None:
        if self.mlfq is not None and job.job_class is ONLINE:
            self.mlfq.remove(job)
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

    def estimate(self, shape: IterationShape) -> float:
        """Seconds of an iteration of `shape`, by the cost estimate."""
        assert self.cost is not None
        return self.cost.batch_time(shape.decodes, shape.decode_context,
                                    shape.prefill_tokens, shape.prefill_attn)

    def _fit(self, shape: IterationShape, job: Job, want: int, slo_s: float) -> int:
        """How many of `want` more tokens of `job` (one decode, or a prefill
        chunk) keep an iteration of `shape` within `slo_s`."""
        start = job.num_computed_tokens
        if want == 1 and start >= job.num_prompt_tokens:
            return want if self.estimate(shape.plus(start, 1)) <= slo_s else 0
        lo, hi = 0, want  # the largest chunk that fits: cost grows with it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.estimate(shape.plus(start, mid)) <= slo_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # Planning -----------------------------------------------------------

    def schedule(self, step: int) -> Plan:
        cfg = self.config
        plan = Plan(step=step)
        self._by_id.clear()
        self._evicted_online = False
        tokens = self._plan_online(plan, cfg.max_batch_tokens)
        self.coserving = bool(self._running[ONLINE] or self._waiting[ONLINE])
        slo: float | None = None
        if self.coserving:
            ttft, tpot = self.slo()
            slo = tpot if any(self._is_decode(c) for c in plan.chunks) else ttft
            max_seqs = cfg.max_batch_size
        else:
            tokens = cfg.conserve.offline_max_batch_tokens or cfg.max_batch_tokens
            max_seqs = cfg.conserve.offline_max_batch_size or cfg.max_batch_size
        self._plan_offline(plan, tokens, max_seqs, slo)
        # Offline batching mode: the whole pass is offline work, which an
        # online arrival may cut between layers (§4.3).
        plan.preemptible_at_layers = not self.coserving and bool(plan.chunks)
        plan.block_ops += plan_checkpoints(
            self.swap, reversed(self._running[OFFLINE]), cfg.conserve)
        return plan

    def cut_wanted(self, plan: Plan, elapsed_s: float, online_tokens: int) -> bool:
        """Algorithm 2: whether online prompts of `online_tokens` tokens in
        all, arrived `elapsed_s` into the pass of `plan`, should cut it.
        Not when the rest of the pass plus their own prefill still fits the
        TTFT objective; always without a cost estimate.  Called from the
        engine replica's request thread: it reads only `plan` and settings."""
        ttft, _ = self.slo()
        if self.cost is None or ttft is None:
            return True
        whole = IterationShape.of((c.start_pos, c.num_tokens) for c in plan.chunks)
        left = max(0.0, self.estimate(whole) - elapsed_s)
        n = min(online_tokens, self.config.max_batch_tokens)
        return left + self.estimate(IterationShape().plus(0, n)) > ttft

    def _is_decode(self, chunk: ScheduledChunk) -> bool:
        return chunk.start_pos >= self._by_id[chunk.job_id].num_prompt_tokens

    def on_step_done(self, plan: Plan, iteration_time: float) -> None:
        if self.mlfq is not None:  # it knows only online jobs
            self.mlfq.on_step_done(plan, iteration_time)

    def _plan_online(self, plan: Plan, tokens: int) -> int:
        """Online chunks into `plan`; returns the tokens left."""
        if self.mlfq is not None:
            return self._plan_online_mlfq(plan, tokens)
        running = self._running[ONLINE]
        i = 0
        while i < len(running) and tokens > 0:
            job = running[i]
            i += 1
            if not job.is_resident:  # a swap-in still in flight
                continue
            # Victims come after `job` (those before it are served or wait
            # on a swap-in), so the walk's index stays valid.
            tokens -= self._run_online(plan, job, tokens, (OFFLINE, ONLINE))
        # vLLM's rule: an iteration that had to evict an online job admits
        # no new one, or the evicted job would be overtaken.
        waiting = self._waiting[ONLINE]
        while (waiting and tokens > 0 and not self._evicted_online
               and len(running) < self.config.max_batch_size):
            job = waiting.head()
            if job.num_host_blocks:
                if not self._swap_in(job, plan, (OFFLINE,)):
                    break
                waiting.remove(job)  # evictions may have requeued others ahead
                insort(running, job, key=_priority)
                continue  # it runs once the copy lands
            n = self._run_online(plan, job, tokens, (OFFLINE,), admit=True)
            if not n:
                break
            tokens -= n
        return tokens

    def _plan_online_mlfq(self, plan: Plan, tokens: int) -> int:
        """`_plan_online` in skip-join MLFQ order (FastServe §4.1): running
        and waiting online jobs alike, highest queue first, up to the
        iteration's limits; those not reached are paused."""
        assert self.mlfq is not None
        self.mlfq._promote_starved(self.clock())
        running = self._running[ONLINE]
        waiting = self._waiting[ONLINE]
        admitted = {j.job_id for j in running}
        # Lazily: the walk stops once the iteration is full (nothing in it
        # changes the MLFQ's queues).
        for job in self.mlfq.jobs():
            if tokens <= 0 or len(plan.chunks) >= self.config.max_batch_size:
                break
            if job.job_id in plan.preempted:  # evicted by this plan: it waits a turn
                continue
            if job.job_id in admitted:
                if not job.is_resident:  # a swap-in still in flight
                    continue
                tokens -= self._run_online(plan, job, tokens, (OFFLINE, ONLINE))
                continue
            if job.num_host_blocks:
                if self._swap_in(job, plan, (OFFLINE, ONLINE)):
                    waiting.remove(job)
                    insort(running, job, key=_priority)
                    admitted.add(job.job_id)
                continue
            n = self._run_online(plan, job, tokens, (OFFLINE, ONLINE), admit=True)
            if n:
                admitted.add(job.job_id)
                tokens -= n
        return tokens

    def _run_online(self, plan: Plan, job: Job, tokens: int,
                    victims: tuple[JobClass, ...], admit: bool = False) -> int:
        """Plan online `job`'s next chunk within `tokens`, if it gets blocks
        (`_room_for`); `admit`: it comes from the waiting line.  Returns the
        chunk's tokens (0: not planned)."""
        adopted = self.blocks.reclaim_cached(job) if admit else None
        n = self._room_for(job, min(job.num_uncomputed_tokens, tokens), plan, victims)
        if not n and adopted is not None:
            # Short of blocks beside what it adopted: as if it had found
            # nothing (a chunk into what is free, the parked blocks too).
            self.blocks.undo_adoption(job, adopted)
            n = self._room_for(job, min(job.num_uncomputed_tokens, tokens), plan, victims)
        if not n:
            return 0
        if admit:
            self._waiting[ONLINE].remove(job)
            self._forget_holding(job)
            insort(self._running[ONLINE], job, key=_priority)
        return self._add_chunk(plan, job, n)

    def _plan_offline(self, plan: Plan, tokens: int, max_seqs: int,
                      slo_s: float | None) -> None:
        """Offline chunks into `plan`, within `tokens` and, in co-serving
        mode, within `slo_s` by the cost estimate of the whole iteration."""
        shape = IterationShape.of((c.start_pos, c.num_tokens) for c in plan.chunks)

        def fit(job: Job) -> int:
            n = min(job.num_uncomputed_tokens, tokens)
            if n <= 0 or len(plan.chunks) >= max_seqs:
                return 0
            if slo_s is None or self.cost is None:
                return n
            return self._fit(shape, job, n, slo_s)

        def add(job: Job, n: int) -> None:
            nonlocal tokens, shape
            shape = shape.plus(job.num_computed_tokens, n)
            self._add_chunk(plan, job, n)
            tokens -= n

        running = self._running[OFFLINE]
        paused = 0
        for job in list(running):
            if not job.is_resident:
                continue
            n = fit(job)
            if n <= 0 or not self._make_room(job, n, plan, (OFFLINE,)):
                paused += 1
                continue
            add(job, n)
        self.offline_paused = paused
        waiting = self._waiting[OFFLINE]
        # Built only when a job may be admitted: it costs O(n log n) in the
        # running offline jobs, on every plan.
        admitting = waiting and not plan.preempted and len(running) < max_seqs
        profile, cap = self._offline_profile() if admitting else (None, 0)
        while waiting and not plan.preempted and len(running) < max_seqs:
            job = waiting.head()
            if profile is not None and job.predicted_output_len is not None:
                lease = self._lease(job)
                if profile.peak_with(lease) - len(job.block_table) > cap:
                    break
                profile.add(lease)
            # A waiting offline job takes only free blocks: evicting running
            # offline work to admit more would only churn.
            if job.num_host_blocks:
                if not self._swap_in(job, plan, ()):
                    break
                running.append(waiting.pop_head())
                continue
            adopted = self.blocks.reclaim_cached(job)
            n = fit(job)
            if adopted is not None and (n <= 0 or not self._make_room(job, n, plan, ())):
                self.blocks.undo_adoption(job, adopted)  # as if it had found nothing
                adopted = None
                n = fit(job)
            if adopted is None and (n <= 0 or not self._make_room(job, n, plan, ())):
                break
            waiting.pop_head()
            self._forget_holding(job)
            running.append(job)
            add(job, n)

    def _lease(self, job: Job) -> Lease:
        """`job`'s KV ahead: it grows to its predicted length, padded, and
        then ends; one that ran past it, or has no prediction, is expected
        to grow by one more block."""
        alloc = job.allocated_output_len or job.predicted_output_len or 0
        left = min(alloc, job.max_tokens) - job.num_output_tokens
        return Lease(job.num_tokens, max(left, self.blocks.block_size))

    def _offline_profile(self) -> tuple[Profile | None, int]:
        """`offline_admission: predicted`: the running offline jobs' KV over
        the coming steps (EconoServe §3.2's profile: jobs that end early
        give their blocks to those still growing), and the blocks it may
        reach beside what the rest holds.  None: admission by free blocks."""
        if self.config.conserve.offline_admission != "predicted":
            return None, 0
        running = self._running[OFFLINE]
        held = sum(len(j.block_table) for j in running)
        profile = Profile([self._lease(j) for j in running], self.blocks.block_size, True)
        return profile, self.blocks.num_blocks - (self.blocks.num_used - held)

    def _add_chunk(self, plan: Plan, job: Job, n: int) -> int:
        plan.chunks.append(self.chunk_for(job, n))
        self._by_id[job.job_id] = job
        return n

    # Memory ---------------------------------------------------------------

    def _swap_in(self, job: Job, plan: Plan, victims: tuple[JobClass, ...]) -> bool:
        while not self.blocks.can_allocate(job.num_host_blocks):
            if not self._evict_one(job, plan, victims):
                return False
        ops = self.swap.swap_in(job)
        if ops is None:
            return False
        plan.block_ops += ops
        return True

    def _make_room(self, job: Job, n: int, plan: Plan,
                   victims: tuple[JobClass, ...]) -> bool:
        """Grow `job` by `n` tokens' blocks, evicting what may go: waiting
        holders, then running jobs of `victims`' classes in that order (an
        online job's blocks come before any offline job's)."""
        while not self.blocks.grow(job, n):
            if not self._evict_one(job, plan, victims):
                return False
        return True

    def _room_for(self, job: Job, n: int, plan: Plan,
                  victims: tuple[JobClass, ...]) -> int:
        """Blocks for `n` more tokens of online `job`, evicting as
        `_make_room` does; when even that leaves too few, a shorter prefill
        chunk in what is free (chunked prefill), so that offline work never
        takes blocks an online prompt could have used.  Returns the tokens
        granted (0: none)."""
        if self._make_room(job, n, plan, victims):
            return n
        fits = ((len(job.block_table) + self.blocks.num_free) * self.blocks.block_size
                - job.num_computed_tokens)
        m = min(n - 1, fits)
        return m if m > 0 and self.blocks.grow(job, m) else 0

    def _evict_one(self, beside: Job, plan: Plan,
                   victims: tuple[JobClass, ...]) -> bool:
        holder = self._waiting_victim(beside)
        if holder is not None:
            self._forget_holding(holder)
            self.evict(holder, plan.block_ops)
            plan.preempted.append(holder.job_id)
            return True
        for cls in victims:
            running = self._running[cls]
            idle = [v for v in reversed(running) if v is not beside
                    and v.job_id not in self._by_id and v.swap_pending is None]
            if not idle:
                continue
            if cls is ONLINE and self.mlfq is not None:
                # The online job the MLFQ would run last goes first.
                rank = self.mlfq._rank
                idle.sort(key=lambda v: rank[v.job_id], reverse=True)
            # The latest admitted goes first, a checkpointed job before any
            # other (§4.4: its preemption copies nothing).
            victim = next((v for v in idle if v.num_checkpointed_blocks), idle[0])
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
