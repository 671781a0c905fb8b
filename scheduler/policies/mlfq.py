"""Skip-join MLFQ with iteration-level preemption (FastServe §4.1, Alg. 1)
and proactive KV swapping ordered by ENST (FastServe §4.2).

Queues Q1..Qn have quanta q1 < q2 < … (q1 the minimum iteration time, each
next one `quantum_ratio` times the previous).  A new job skip-joins the
highest queue whose quantum covers its predicted prefill time; a job is
charged the time of every iteration it runs in (a piece of a prompt split
across iterations: that piece's own prefill time), and one that used up its
quantum is demoted by its next iteration time; a job left
unscheduled for α seconds is promoted back to Q1.  Each iteration takes the
highest-priority ready jobs up to the batch and token budgets, so a job can
be preempted after any token; its KV stays on the device until memory is
needed, and then it is swapped to the host (or dropped, `swap_mode:
recompute`).

The paper's strawmen are in `mlfq_strawmen.py`; where KV lives (eviction,
swap-ins, proactive swapping, and the rule that a job with no KV does not
start by dropping a started job's KV) in `mlfq_kv.py`.

A job's `priority` (vLLM's meaning: lower runs first) makes strict classes
above all of this: the MLFQ runs within a class, a class is served only
when every more important one has been, and evictions take from the least
important class first.  With one class this is FastServe as published.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterator
from functools import partial

from scheduler.blocks import blocks_for
from scheduler.job import Job, JobState
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.burst_reserve import BurstReserve
from scheduler.policies.enst import RankingOnce, Shortfall
from scheduler.policies.mlfq_admission import NewcomerLevel, newcomer_levels
from scheduler.policies.mlfq_kv import MLFQResidency
from scheduler.policies.ranked import RankedSet
from scheduler.policies.victims import VictimPool
from scheduler.policies.mlfq_walk import MLFQWalking
from scheduler.policies.walk import queue_order
from scheduler.policy import Policy
from scheduler.swap import SwapMode

# An enum member's lookup costs ~0.12 µs on Python 3.11: once per chunk.
_RUNNING = JobState.RUNNING

# Default q1 when no cost estimate is given: a small model's decode step.
_DEFAULT_Q1_S = 0.02


class MLFQPolicy(Policy, MLFQResidency, MLFQWalking):
    """Planning costs what one iteration touches, not what is queued: the
    queues are insertion-ordered dicts per (class, level), walked lazily
    until the batch is full; starvation is found from the front of a
    last-run order; ENST is computed for the jobs that need it (those
    holding device or host KV) from per-level counts; and eviction
    candidates come from the block manager's index of holders."""

    name = "mlfq"
    variant = "skip-join"
    # Skip walk jobs that cannot get their blocks (see `schedule`); off
    # only in the from-scratch reference the tests compare against.
    skip_hopeless = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        mc = self.config.mlfq
        decode1 = self.cost.decode_time(1) if self.cost is not None else _DEFAULT_Q1_S
        q1 = mc.base_quantum_s if mc.base_quantum_s is not None else decode1
        self.quanta = [q1 * mc.quantum_ratio**i for i in range(self._num_queues())]
        self.alpha = self._starvation_threshold(decode1)
        # Priority class -> per level, job id -> job in FIFO order.
        self._levels: dict[int, list[dict[str, Job]]] = {}
        self.level: dict[str, int] = {}
        # Job id -> (priority, level, order of entry into the level): the
        # priority walk's order, and ENST's wherever starvation is not near.
        self._rank: dict[str, tuple[int, int, int]] = {}
        self._next_seq = 0
        self.used: dict[str, float] = {}
        # Job id -> when it last ran, least recent first.
        self.last_run: dict[str, float] = {}
        self.swapped_in_step: dict[str, int] = {}
        self.burst = BurstReserve()
        self._shortfall = Shortfall(self.quanta) if mc.enst == "predicted" else None
        # Jobs per priority class; one class skips the class ordering.
        self.class_sizes: Counter[int] = Counter()
        self.selected: list[Job] = []
        # This policy's jobs holding device blocks / a host copy, in ENST order
        # across plans (synced each plan with the jobs that the block and
        # swap managers report as having joined or left since the last;
        # taken at the first plan: co-serving's MLFQ only orders its jobs).
        self._resident, self._host = RankedSet(), RankedSet()
        self._resident_changed: set[str] | None = None
        self._host_changed: set[str] | None = None
        self.num_demotions = 0
        self.num_promotions = 0
        self._step = 0

    def _num_queues(self) -> int:
        """Configured, or the smallest n with q_n ≥ max_model_len · q1.

        FastServe leaves n open.  With six doubling queues every job lands
        in the last, FIFO, queue after ~60 iterations, and under overload
        that queue holds nearly everyone: a 100-token answer waits behind
        every older long one (simulated OPT-13B, ShareGPT, 10 req/s: mean
        normalized latency 0.34 s/token with 6 queues, 0.18 with 12).
        """
        mc = self.config.mlfq
        if mc.num_queues is not None:
            return mc.num_queues
        n = math.ceil(math.log(self.config.max_model_len) / math.log(mc.quantum_ratio)) + 1
        return max(1, min(n, 32))

    def _join_work(self, job: Job) -> float:
        """The work a new job's queue is chosen by (`mlfq.skip_join`).  Its
        uncomputed, not prompt, tokens: a sibling that adopted its leader's
        prompt blocks has only the tail to prefill."""
        first = self._prefill_work(min(job.num_uncomputed_tokens, self.config.max_batch_tokens))
        if self.cost is None:
            return first
        pred = job.predicted_output_len
        if self.config.mlfq.skip_join == "predicted" and pred is not None:
            left = max(0, pred - job.num_output_tokens)
            return first + left * self.cost.decode_time(1)
        return first

    def _prefill_work(self, num_tokens: int) -> float:
        """A prefill of `num_tokens` by the cost estimate (without one,
        64 tokens per q1)."""
        if self.cost is None:
            return self.quanta[0] * num_tokens / 64
        return self.cost.prefill_time(num_tokens)

    def _join_level(self, t: float) -> int:
        """Highest queue whose quantum covers `t` (Algorithm 1, line 8)."""
        for i, q in enumerate(self.quanta):
            if q >= t:
                return i
        return len(self.quanta) - 1

    def add(self, job: Job) -> None:
        now = self.clock()
        lvl = 0 if self.variant == "naive" else self._join_level(
            self._join_work(job))
        if job.priority not in self._levels:
            self._levels[job.priority] = [{} for _ in self.quanta]
        self._enqueue(job, lvl)
        self.class_sizes[job.priority] += 1
        if self._resident_changed is not None and self._host_changed is not None:
            # It may hold KV already (a sibling released by its leader).
            self._resident_changed.add(job.job_id)
            self._host_changed.add(job.job_id)
        self._ran(job.job_id, now)
        first = blocks_for(min(job.num_uncomputed_tokens, self.config.max_batch_tokens),
                           self.blocks.block_size)
        self.burst.arrived(now, first)

    def on_prediction(self, job: Job) -> None:
        # Before its first run, a job moves to the queue its prediction picks.
        if (self.config.mlfq.skip_join == "predicted" and self.variant == "skip-join"
                and job.first_scheduled_time is None and job.job_id in self.level):
            self._move(job, self._join_level(self._join_work(job)))
        elif job.job_id in self.level:
            self._predicted_left(job)

    def _predicted_left(self, job: Job) -> None:
        """`mlfq.enst: predicted`: the job's predicted remaining service
        (prefill left, then outputs at the last batch's iteration time), as
        of its entry into its level: it only falls while the job stays."""
        pred = job.predicted_output_len
        if self._shortfall is None or pred is None or self.cost is None:
            return
        left = self.cost.decode_time(max(1, len(self.selected))) * max(
            0, pred - job.num_output_tokens)
        if job.num_uncomputed_tokens > 1:
            left += self.cost.prefill_time(job.num_uncomputed_tokens)
        self._shortfall.set(job.job_id, job.priority, self.level[job.job_id], left)

    def remove(self, job: Job) -> None:
        jid = job.job_id
        lvl = self.level.pop(jid, None)
        if lvl is not None:
            del self._levels[job.priority][lvl][jid]
            self.class_sizes[job.priority] -= 1
            if not self.class_sizes[job.priority]:
                del self.class_sizes[job.priority]
                del self._levels[job.priority]
        self._rank.pop(jid, None)
        self._resident.discard(jid)
        self._host.discard(jid)
        self._walk_removed(jid)
        if self._shortfall is not None:
            self._shortfall.discard(jid)
        self.used.pop(jid, None)
        self.last_run.pop(jid, None)
        self.swapped_in_step.pop(jid, None)
        if job in self.selected:
            self.selected.remove(job)

    def _enqueue(self, job: Job, lvl: int) -> None:
        self.level[job.job_id] = lvl
        self.used[job.job_id] = 0.0
        self._rank[job.job_id] = (job.priority, lvl, self._next_seq)
        self._next_seq += 1
        self._reranked(job.job_id)
        self._levels[job.priority][lvl][job.job_id] = job
        self._walk_reranked(job)
        self._predicted_left(job)

    def _move(self, job: Job, lvl: int) -> None:
        del self._levels[job.priority][self.level[job.job_id]][job.job_id]
        self._enqueue(job, lvl)

    def _ran(self, job_id: str, now: float) -> None:
        """`job_id` ran (or arrived, or was promoted) at `now`: it goes to
        the back of the last-run order, which stays sorted by time."""
        self.last_run.pop(job_id, None)
        self.last_run[job_id] = now
        self._reranked(job_id)

    def _reranked(self, job_id: str) -> None:
        # A job with a checkpoint is in both sets.
        resident, host = job_id in self._resident, job_id in self._host
        if resident or host:
            rank, t = self._rank[job_id], self.last_run[job_id]
            if resident:
                self._resident.update(job_id, rank, t)
            if host:
                self._host.update(job_id, rank, t)

    def jobs(self) -> Iterator[Job]:
        """Every job in priority-walk order: (priority, level, FIFO)."""
        return queue_order(self._levels)

    def num_waiting(self) -> int:
        return len(self.level) - len(self.selected)

    def num_running(self) -> int:
        return len(self.selected)

    def newcomer_levels(self, batch: Collection[str],
                        mean_output_len: float) -> list[NewcomerLevel] | None:
        if self.variant != "skip-join":
            return None
        return newcomer_levels(self, batch, mean_output_len)

    def queue_lengths(self) -> list[int]:
        return [sum(len(levels[i]) for levels in self._levels.values())
                for i in range(len(self.quanta))]

    # Feedback -------------------------------------------------------------

    def on_step_done(self, plan: Plan, iteration_time: float) -> None:
        if self.variant == "fixed":
            return
        now = self.clock()
        level, used, quanta, last_run = self.level, self.used, self.quanta, self.last_run
        bottom = len(quanta) - 1
        ran: list[str] = []
        demote: list[tuple[str, int]] = []
        for c in plan.chunks:
            jid = c.job_id
            lvl = level.get(jid)
            if lvl is None:  # finished this step
                continue
            # `_ran` for the whole batch: the last-run order here, the
            # ENST sets' in one pass each below.
            last_run.pop(jid, None)
            last_run[jid] = now
            ran.append(jid)
            # A chunk that leaves part of the prompt for later is charged
            # its own prefill estimate, not the iteration it shared:
            # skip-join chose the job's queue so that its prefill fits the
            # quantum (FastServe §4.1, Algorithm 1 line 8), and charging each
            # piece of a prompt split across iterations the batch's whole
            # time demoted it before its first token, behind the queue's
            # later arrivals (a burst of 100 ShareGPT prompts in 2,048-token
            # iterations, simulated: P99 TTFT 14.2 → 12.9 s).  An iteration
            # that samples the job's token is charged whole, as in the paper.
            spent = iteration_time if c.sample else self._prefill_work(c.num_tokens)
            u = used[jid] = used[jid] + spent
            if u >= quanta[lvl] and lvl < bottom:
                demote.append((jid, lvl))
        self._resident.ran(ran, now)
        self._host.ran(ran, now)
        for jid, lvl in demote:
            # Demote by the next iteration's time (Algorithm 1, line 17): at
            # least one level, further if that iteration alone would overrun
            # the next quantum.
            job = self._job(jid)
            nxt = self._next_iteration_time(job, len(plan.chunks))
            new = max(lvl + 1, self._join_level(nxt))
            self._move(job, min(new, bottom))
            self.num_demotions += 1

    def _next_iteration_time(self, job: Job, batch_size: int) -> float:
        if self.cost is None:
            return 0.0
        left = job.num_uncomputed_tokens
        if left > 1:  # still prefilling: its next chunk
            return self.cost.prefill_time(min(left, self.config.max_batch_tokens))
        return self.cost.decode_time(max(1, batch_size))

    def _starvation_threshold(self, decode1: float) -> float:
        """α (FastServe §4.1 tunes it from the SLO, §6.1's 10x-iteration
        normalized latency): configured, or the whole normalized-latency
        budget of a max_model_len job.  A job idle that long has missed the
        SLO whatever its length, and would only miss it by more.

        A short α costs the mean and the tail alike: under overload every
        job idle for α returns to Q1 in arrival order, and MLFQ turns into
        round robin over the backlog (α = 2.5 s, simulated OPT-13B on
        ShareGPT at 8 req/s: mean normalized latency 0.168 s/token, P95
        0.49, against 0.125 and 0.35 without promotion).
        """
        mc = self.config.mlfq
        if mc.starvation_s is not None:
            return mc.starvation_s
        nl_slo = mc.slo_normalized_s if mc.slo_normalized_s is not None else 10 * decode1
        return nl_slo * self.config.max_model_len

    def _promote_starved(self, now: float) -> None:
        """Jobs idle for α go back to Q1 (Algorithm 1, line 20), found from
        the front of the last-run order: only the starved are touched.  A
        starved job already in Q1 stays there with its clock restarted,
        which changes nothing it is ranked by (Q1 is never promoted)."""
        if self.variant == "fixed":
            return
        starved: list[str] = []
        for jid, t in self.last_run.items():
            if now - t < self.alpha:
                break
            starved.append(jid)
        if not starved:
            return
        # Promote in queue order, so that Q1 receives them as a scan of
        # the queues from Q2 down would have.
        starved.sort(key=lambda jid: self._rank[jid][1:])
        for jid in starved:
            job = self._job(jid)
            if self.level[jid] > 0:
                self._move(job, 0)
                self.num_promotions += 1
            self._ran(jid, now)  # starveTime ← 0

    def _job(self, job_id: str) -> Job:
        lvl = self.level[job_id]
        for levels in self._levels.values():
            job = levels[lvl].get(job_id)
            if job is not None:
                return job
        raise KeyError(job_id)

    # Planning -------------------------------------------------------------

    def reserve_target(self, now: float) -> int:
        """Free blocks kept for arrivals: those expected over the horizon."""
        if self.config.reserve_blocks is not None:
            return self.config.reserve_blocks
        return self.burst.target(now, self.blocks.num_blocks)

    def schedule(self, step: int) -> Plan:
        self._step = step
        now = self.clock()
        self._promote_starved(now)
        plan = Plan(step=step)
        # ENST is read only where a plan evicts or swaps (most plans of a
        # steady batch do neither): made at its first use, from the same
        # queue lengths, since nothing moves a job between levels in a plan.
        ranking = RankingOnce(partial(self._ranking, now))
        if self._resident_changed is None or self._host_changed is None:
            self._resident_changed = self.blocks.watch_holding()
            self._host_changed = self.swap.watch_on_host()
        self._resident.sync(self.blocks.holding, self._rank, self.last_run, self._resident_changed)
        self._host.sync(self.swap.on_host, self._rank, self.last_run, self._host_changed)
        pool = VictimPool(self._by_enst(ranking), self._step, self.swapped_in_step, self.blocks)
        walk = self.walk()

        selected: list[Job] = []
        chunks: list[ScheduledChunk] = []
        budget = self.config.max_batch_tokens
        # Batch slots: jobs whose KV is coming back (in flight or started
        # now) hold one each, so swap-ins never go beyond what the next
        # batches can run; a promoted job that would not be reached stays on
        # the host instead of evicting someone for nothing (no thrashing).
        slots = self.config.max_batch_size
        # Fewest new blocks that a job failed to get: the free blocks plus
        # what the walk may still evict only shrink, so any later job that
        # needs as many fails too.  Once no block can be had, only jobs that
        # already hold KV can run, and the walk narrows to them.
        fail = math.inf
        # With `cold_start_recompute` off, jobs without KV start in walk
        # order until one cannot get its blocks without dropping another
        # job's KV; the rest of the walk then takes only jobs that hold KV
        # (a smaller job without KV further back does not jump ahead of it,
        # and the walk need not pass over the rest of a long queue).
        keep_kv = not self.config.mlfq.cold_start_recompute
        bs = self.blocks.block_size
        visited = pool.visited
        taken_add = pool.taken.add
        for job in walk:
            if slots <= 0 or budget <= 0:
                break
            cold = False
            table = job.block_table
            if not table and not job.num_host_blocks and job.swap_pending is None:
                n = self._start_adopted(job, budget, plan, pool, fail, keep_kv)
                if n:
                    selected.append(job)
                    pool.taken.add(job.job_id)
                    chunks.append(self.chunk_for(job, n))
                    budget -= n
                    slots -= 1
                    continue
            if not table:
                if not job.num_host_blocks and job.swap_pending is None:
                    # No KV anywhere (most of a long queue): the cheap test
                    # of whether it can get its blocks comes first.
                    n = min(job.num_tokens - job.num_computed_tokens, budget)
                    want = -(-(job.num_computed_tokens + n) // bs)
                    if keep_kv:
                        if want >= fail or want > self._cold_cap(job.priority):
                            self._narrow(walk, job, with_host=True)  # refused
                            continue
                        cold = True
                    elif want >= fail:
                        continue
            else:  # only holders can be victims (`VictimPool.visit`)
                visited.add(job.job_id)
            if job.swap_pending is not None:
                slots -= 1
                continue
            if job.num_host_blocks:
                # Not ready (Algorithm 1, line 24).  Reactive mode fetches it
                # now that it must run; proactive mode leaves that to the
                # ENST-ordered prefetch below, which bounds swap traffic.
                if (self.swap_mode is SwapMode.REACTIVE
                        and job.job_id not in pool.swapped_out
                        and job.num_host_blocks < fail):
                    if self._swap_in(job, plan.block_ops, pool):
                        slots -= 1
                    elif self.skip_hopeless:
                        fail = min(fail, job.num_host_blocks)
                continue
            computed = job.num_computed_tokens
            outputs = job.output_token_ids
            p = len(job.prompt_token_ids)
            known = p + len(outputs)
            n = known - computed
            if n > budget:
                n = budget
            end = computed + n
            need = -(-end // bs) - len(table)
            if need >= fail:
                continue
            if need > 0:
                if not self._make_room(job, n, plan, pool, cold):
                    if cold:
                        self._narrow(walk, job, with_host=True)
                    elif self.skip_hopeless:
                        fail = need
                        if fail <= 1:
                            self._narrow(walk, job, with_host=False)
                    continue
                table = job.block_table
            selected.append(job)
            taken_add(job.job_id)
            # `chunk_for`, inlined: once per job of the batch, and the
            # walk has already read what it checks.
            if job.state is not _RUNNING:
                job.transition(_RUNNING)
            if job.first_scheduled_time is None:
                job.first_scheduled_time = now
            copy = job.table_copy
            if copy is None or len(copy) != len(table):
                copy = job.table_copy = table.copy()
            chunks.append(ScheduledChunk(
                job.job_id,
                outputs[computed - p:end - p] if computed >= p else job.token_slice(computed, end),
                computed, copy, end == known, len(outputs)))
            budget -= n
            slots -= 1

        if self.swap_mode is SwapMode.PROACTIVE:
            self._proactive(plan, pool, ranking, now)
        plan.chunks = chunks
        self.selected = selected
        return plan
