"""Skip-join MLFQ with iteration-level preemption (FastServe §4.1, Alg. 1)
and proactive KV swapping ordered by ENST (FastServe §4.2).

Queues Q1..Qn have quanta q1 < q2 < … (q1 the minimum iteration time, each
next one `quantum_ratio` times the previous).  A new job skip-joins the
highest queue whose quantum covers its predicted prefill time; a job that
used up its quantum is demoted by its next iteration time; a job left
unscheduled for α seconds is promoted back to Q1.  Each iteration takes the
highest-priority ready jobs up to the batch and token budgets, so a job can
be preempted after any token; its KV stays on the device until memory is
needed, and then it is swapped to the host (or dropped, `swap_mode:
recompute`).

`mlfq-naive` (everyone joins Q1) and `fixed-priority` (priority from input
length, never demoted or promoted) are the paper's strawmen, for comparison.

A job's `priority` (vLLM's meaning: lower runs first) makes strict classes
above all of this: the MLFQ runs within a class, a class is served only
when every more important one has been, and evictions take from the least
important class first.  With one class this is FastServe as published.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from scheduler.blocks import BlockManager, ReleaseTally, blocks_for
from scheduler.job import Job
from scheduler.plan import BlockOp, Plan, ScheduledChunk
from scheduler.policy import Policy
from scheduler.swap import SwapMode

# Default q1 when no cost estimate is given: a small model's decode step.
_DEFAULT_Q1_S = 0.02
# A job swapped in is not swapped out again for this many steps unless
# memory for a higher-priority job leaves no other choice (no ping-pong).
_MIN_RESIDENCY_STEPS = 4
# Window and horizon of the burst reserve (FastServe §4.2).
_ARRIVAL_WINDOW_S = 10.0
_RESERVE_HORIZON_S = 1.0
_RESERVE_CAP = 0.25
# Proactive swap-ins per iteration: at most 1/8 of the device blocks.
_SWAP_IN_SHARE = 8


class MLFQPolicy(Policy):
    name = "mlfq"
    variant = "skip-join"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        mc = self.config.mlfq
        decode1 = self.cost.decode_time(1) if self.cost is not None else _DEFAULT_Q1_S
        q1 = mc.base_quantum_s if mc.base_quantum_s is not None else decode1
        self.quanta = [q1 * mc.quantum_ratio**i for i in range(self._num_queues())]
        self.alpha = self._starvation_threshold(decode1)
        self.queues: list[deque[Job]] = [deque() for _ in self.quanta]
        self.level: dict[str, int] = {}
        self.used: dict[str, float] = {}
        self.last_run: dict[str, float] = {}
        self.swapped_in_step: dict[str, int] = {}
        self.arrivals: deque[tuple[float, int]] = deque()
        # Jobs per priority class; one class skips the class ordering.
        self.class_sizes: Counter[int] = Counter()
        self.selected: list[Job] = []
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

    # Queue membership ---------------------------------------------------

    def _predicted_first_iteration(self, job: Job) -> float:
        # Uncomputed, not prompt, tokens: a sibling that adopted its
        # leader's prompt blocks has only the tail to prefill.
        n = min(job.num_uncomputed_tokens, self.config.max_batch_tokens)
        if self.cost is None:
            return self.quanta[0] * n / 64
        return self.cost.prefill_time(n)

    def _join_level(self, t: float) -> int:
        """Highest queue whose quantum covers `t` (Algorithm 1, line 8)."""
        for i, q in enumerate(self.quanta):
            if q >= t:
                return i
        return len(self.quanta) - 1

    def add(self, job: Job) -> None:
        now = self.clock()
        lvl = 0 if self.variant == "naive" else self._join_level(
            self._predicted_first_iteration(job))
        self._enqueue(job, lvl)
        self.class_sizes[job.priority] += 1
        self.last_run[job.job_id] = now
        self.arrivals.append((now, blocks_for(
            min(job.num_uncomputed_tokens, self.config.max_batch_tokens), self.blocks.block_size)))

    def remove(self, job: Job) -> None:
        lvl = self.level.pop(job.job_id, None)
        if lvl is not None:
            self.queues[lvl].remove(job)
            self.class_sizes[job.priority] -= 1
            if not self.class_sizes[job.priority]:
                del self.class_sizes[job.priority]
        self.used.pop(job.job_id, None)
        self.last_run.pop(job.job_id, None)
        self.swapped_in_step.pop(job.job_id, None)
        if job in self.selected:
            self.selected.remove(job)

    def _enqueue(self, job: Job, lvl: int) -> None:
        self.level[job.job_id] = lvl
        self.used[job.job_id] = 0.0
        self.queues[lvl].append(job)

    def _move(self, job: Job, lvl: int) -> None:
        self.queues[self.level[job.job_id]].remove(job)
        self._enqueue(job, lvl)

    def num_waiting(self) -> int:
        return len(self.level) - len(self.selected)

    def num_running(self) -> int:
        return len(self.selected)

    def queue_lengths(self) -> list[int]:
        return [len(q) for q in self.queues]

    # Feedback -------------------------------------------------------------

    def on_step_done(self, plan: Plan, iteration_time: float) -> None:
        if self.variant == "fixed":
            return
        now = self.clock()
        for c in plan.chunks:
            jid = c.job_id
            lvl = self.level.get(jid)
            if lvl is None:  # finished this step
                continue
            self.last_run[jid] = now
            self.used[jid] += iteration_time
            if self.used[jid] >= self.quanta[lvl] and lvl < len(self.quanta) - 1:
                # Demote by the next iteration's time (Algorithm 1, line 17):
                # at least one level, further if that iteration alone would
                # overrun the next quantum.
                job = next(j for j in self.queues[lvl] if j.job_id == jid)
                nxt = self._next_iteration_time(job, len(plan.chunks))
                new = max(lvl + 1, self._join_level(nxt))
                self._move(job, min(new, len(self.quanta) - 1))
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
        if self.variant == "fixed":
            return
        for lvl in range(1, len(self.queues)):
            for job in list(self.queues[lvl]):
                if now - self.last_run[job.job_id] >= self.alpha:
                    self._move(job, 0)
                    self.last_run[job.job_id] = now  # starveTime ← 0
                    self.num_promotions += 1

    # ENST (FastServe §4.2) --------------------------------------------------

    def enst(self, now: float) -> dict[str, float]:
        """Estimated next scheduled time of every job, relative to now.

        ENST(i) = min(T_promote(i), T_execute(i)), T_execute(i) =
        (1/B) Σ_{j ahead of i} Σ_{k from j's level to i's} q_k, where the
        jobs ahead are those of i's class in higher queues and every job of
        a more important class; one of those that is already at i's level
        or lower still runs ahead for its current quantum.
        """
        prefix = [0.0]
        for q in self.quanta:
            prefix.append(prefix[-1] + q)
        n = len(self.queues)
        counts: dict[int, list[int]] = {p: [0] * n for p in self.class_sizes}
        if len(counts) == 1:
            counts[next(iter(counts))] = [len(q) for q in self.queues]
        else:
            for lvl, q in enumerate(self.queues):
                for job in q:
                    counts[job.priority][lvl] += 1
        b = self.config.max_batch_size
        t_exec: dict[int, list[float]] = {}
        above = [0] * n  # jobs of the more important classes, per level
        for p in sorted(counts):
            own = counts[p]
            t_exec[p] = []
            outranked = any(above)
            for lvl in range(n):
                ahead = sum(own[k] * (prefix[lvl] - prefix[k]) for k in range(lvl))
                if outranked:
                    ahead += sum(above[k] * (prefix[max(lvl, k + 1)] - prefix[k])
                                 for k in range(n))
                t_exec[p].append(ahead / b)
            above = [a + c for a, c in zip(above, own)]
        out: dict[str, float] = {}
        for lvl, q in enumerate(self.queues):
            for pos, job in enumerate(q):
                t_promote = max(0.0, self.alpha - (now - self.last_run[job.job_id]))
                if self.variant == "fixed" or lvl == 0:
                    t_promote = math.inf
                # Position inside the level breaks ties: later in FIFO, later.
                out[job.job_id] = min(t_promote, t_exec[job.priority][lvl]) + pos * 1e-9
        return out

    # Planning -------------------------------------------------------------

    def _order(self) -> list[Job]:
        """The priority walk: by (priority, level, position in level)."""
        order = [j for q in self.queues for j in q]
        if len(self.class_sizes) > 1:
            order.sort(key=_priority)  # stable: levels stay in order within a class
        return order

    def reserve_target(self, now: float) -> int:
        """Free blocks kept for arrivals: those expected over the horizon."""
        if self.config.reserve_blocks is not None:
            return self.config.reserve_blocks
        while self.arrivals and now - self.arrivals[0][0] > _ARRIVAL_WINDOW_S:
            self.arrivals.popleft()
        if not self.arrivals:
            return 0
        window = max(now - self.arrivals[0][0], 1e-3, _RESERVE_HORIZON_S)
        blocks = sum(b for _, b in self.arrivals) * _RESERVE_HORIZON_S / window
        return min(math.ceil(blocks), int(self.blocks.num_blocks * _RESERVE_CAP))

    def schedule(self, step: int) -> Plan:
        self._step = step
        now = self.clock()
        self._promote_starved(now)
        plan = Plan(step=step)
        order = self._order()
        enst = self.enst(now)
        pool = _VictimPool(order, enst, self._step, self.swapped_in_step, self.blocks)

        selected: list[Job] = []
        chunks: list[ScheduledChunk] = []
        budget = self.config.max_batch_tokens
        # Batch slots: jobs whose KV is coming back (in flight or started
        # now) hold one each, so swap-ins never go beyond what the next
        # batches can run; a promoted job that would not be reached stays on
        # the host instead of evicting someone for nothing (no thrashing).
        slots = self.config.max_batch_size
        for job in order:
            pool.visit(job)
            if slots <= 0 or budget <= 0:
                break
            if job.swap_pending is not None:
                slots -= 1
                continue
            if job.num_host_blocks:
                # Not ready (Algorithm 1, line 24).  Reactive mode fetches it
                # now that it must run; proactive mode leaves that to the
                # ENST-ordered prefetch below, which bounds swap traffic.
                if (self.swap_mode is SwapMode.REACTIVE
                        and job.job_id not in pool.swapped_out
                        and self._swap_in(job, plan.block_ops, pool)):
                    slots -= 1
                continue
            n = min(job.num_uncomputed_tokens, budget)
            if not self._make_room(job, n, plan, pool):
                continue
            selected.append(job)
            pool.taken.add(job.job_id)
            chunks.append(self.chunk_for(job, n))
            budget -= n
            slots -= 1

        if self.swap_mode is SwapMode.PROACTIVE:
            self._proactive(plan, order, pool, now)
        plan.chunks = chunks
        self.selected = selected
        return plan

    def _evict_for(self, need: int, ops: list[BlockOp], pool: "_VictimPool",
                   preempted: list[str] | None) -> bool:
        """Free device blocks until `need` are free, from lower-priority idle
        jobs, largest ENST first (FastServe §4.2); all or nothing.  Victims
        are listed in `preempted` when they give way to a job that runs."""
        if self.blocks.num_free >= need:
            return True
        victims = pool.victims(need - self.blocks.num_free)
        if victims is None:
            return False
        for v in victims:
            self._swap_out(v, ops, pool)
            if preempted is not None:
                preempted.append(v.job_id)
        return self.blocks.num_free >= need

    def _swap_out(self, job: Job, ops: list[BlockOp], pool: "_VictimPool") -> None:
        self.evict(job, ops)
        pool.evicted(job)

    def _make_room(self, job: Job, n: int, plan: Plan, pool: "_VictimPool") -> bool:
        if self.blocks.grow(job, n):
            return True
        need = self.blocks.blocks_needed(job, n)
        return (self._evict_for(need, plan.block_ops, pool, plan.preempted)
                and self.blocks.grow(job, n))

    def _swap_in(self, job: Job, ops: list[BlockOp], pool: "_VictimPool") -> bool:
        if not self._evict_for(job.num_host_blocks, ops, pool, preempted=None):
            return False
        new_ops = self.swap.swap_in(job)
        if new_ops is None:
            return False
        ops += new_ops
        self.swapped_in_step[job.job_id] = self._step
        return True

    def _proactive(self, plan: Plan, order: list[Job], pool: "_VictimPool", now: float) -> None:
        """ENST-ordered residency (FastServe §4.2, Figure 9): keep the burst
        reserve free by swapping out the largest-ENST idle jobs, and bring
        the smallest-ENST swapped jobs back ahead of their turn, trading
        places with idle residents whose ENST is larger.  Swap-ins per
        iteration are capped so that the copies overlap the computation
        instead of saturating the link."""
        reserve = self.reserve_target(now)
        idle = pool.settled_idle()  # largest (priority, ENST) first
        while idle and self.blocks.num_free < reserve and self.swap.can_swap_out(idle[0]):
            self._swap_out_freeing(idle.pop(0), plan.block_ops, pool)
        budget = max(1, self.blocks.num_blocks // _SWAP_IN_SHARE)
        host = [j for j in order
                if j.num_host_blocks and j.swap_pending is None
                and j.job_id not in pool.swapped_out]
        host.sort(key=pool.key)
        for h in host:
            n = h.num_host_blocks
            if n > budget and budget < self.blocks.num_blocks // _SWAP_IN_SHARE:
                break  # (the first job always goes, however large)
            while (self.blocks.num_free - n < reserve and idle
                   and pool.key(idle[0]) > pool.key(h)
                   and self.swap.can_swap_out(idle[0])):
                self._swap_out_freeing(idle.pop(0), plan.block_ops, pool)
            if self.blocks.num_free - n < reserve:
                break
            ops = self.swap.swap_in(h)
            if ops is None:
                break
            plan.block_ops += ops
            self.swapped_in_step[h.job_id] = self._step
            budget -= n

    def _swap_out_freeing(self, job: Job, ops: list[BlockOp], pool: "_VictimPool") -> None:
        """Swap an idle job out for the room it gives back; one whose blocks
        are all held by siblings too would give back none, so it stays."""
        if self.blocks.num_exclusive(job):
            self._swap_out(job, ops, pool)


def _priority(job: Job) -> int:
    return job.priority


def _pick(group: list[Job], need: int) -> list[Job] | None:
    """The first jobs of `group` whose blocks add up to `need`, when no
    block is shared (each job frees its whole table); None if all do not."""
    picked: list[Job] = []
    freed = 0
    for j in group:
        if freed >= need:
            break
        picked.append(j)
        freed += len(j.block_table)
    return picked if freed >= need else None


class _VictimPool:
    """Device-holding jobs that one plan may evict, least important class
    first, largest ENST first within a class.

    Built once per plan (not per eviction) so planning stays linear in the
    number of jobs.  A job is a candidate once the priority walk has not yet
    reached it (lower priority than every job being served) and it is
    neither taken into the batch nor already evicted.
    """

    def __init__(self, order: list[Job], enst: dict[str, float], step: int,
                 swapped_in_step: dict[str, int], blocks: BlockManager) -> None:
        self.enst = enst
        self.blocks = blocks
        self.visited: set[str] = set()
        self.taken: set[str] = set()
        self.swapped_out: set[str] = set()
        holders = [j for j in order if j.block_table and j.swap_pending is None]
        holders.sort(key=self.key, reverse=True)
        self._holders = holders
        self._settled = {j.job_id for j in holders
                         if step - swapped_in_step.get(j.job_id, -10**9)
                         >= _MIN_RESIDENCY_STEPS}

    def key(self, job: Job) -> tuple[int, float]:
        """When `job` is expected to run: by class, then ENST."""
        return (job.priority, self.enst[job.job_id])

    def visit(self, job: Job) -> None:
        self.visited.add(job.job_id)

    def evicted(self, job: Job) -> None:
        self.taken.add(job.job_id)
        if job.num_host_blocks:
            self.swapped_out.add(job.job_id)

    def _live(self) -> list[Job]:
        return [j for j in self._holders if j.job_id not in self.taken and j.block_table]

    def victims(self, need: int) -> list[Job] | None:
        """Enough lower-priority idle jobs to free `need` blocks: settled
        ones first (no ping-pong), freshly swapped-in ones only if that is
        the only way; None if even all of them do not suffice."""
        cands = [j for j in self._live() if j.job_id not in self.visited]
        settled = [j for j in cands if j.job_id in self._settled]
        pick = self._pick_sharing if self.blocks.has_shared else _pick
        for group in (settled, cands):
            picked = pick(group, need)
            if picked is not None:
                return picked
        return None

    def _pick_sharing(self, group: list[Job], need: int) -> list[Job] | None:
        """`_pick` when some blocks are shared: a victim frees the blocks it
        holds alone, and shared ones once all their holders are picked.  A
        job that would free nothing by itself is considered last, and kept
        only if evicting it with the others picked frees some block."""
        picked: list[Job] = []
        deferred: list[Job] = []
        tally = ReleaseTally(self.blocks)
        for j in group:
            if tally.freed >= need:
                break
            if tally.take(j):
                picked.append(j)
            else:
                deferred.append(j)
        if tally.freed >= need:
            return picked
        for j in deferred:
            if tally.freed >= need:
                break
            picked.append(j)
            tally.add(j)
        if tally.freed >= need:
            return [j for j in picked if tally.frees_any(j)]
        return None

    def settled_idle(self) -> list[Job]:
        """Evictable jobs not swapped in recently, largest (priority, ENST)
        first."""
        return [j for j in self._live() if j.job_id in self._settled]


class NaiveMLFQPolicy(MLFQPolicy):
    """Strawman: every job joins Q1 (FastServe §4.1)."""

    name = "mlfq-naive"
    variant = "naive"


class FixedPriorityPolicy(MLFQPolicy):
    """Strawman: priority from input length only, never demoted or promoted."""

    name = "fixed-priority"
    variant = "fixed"
