"""EconoServe (arXiv 2411.06364 §3, Algorithm 1): predictor-driven scheduling.

A job is a *prompt task* (PT) until its prompt is computed, then a
*generation task* (GT).  Each has its own waiting queue (§3.3.1):

- **GTs fill the KV cache.**  A GT in the batch is allocated its predicted
  response length plus the predictor's padding (`Job.allocated_output_len`,
  §2.3), in whole blocks.  GTs join the batch when the allocations fit:
  exactly (every allocation counted at its largest), or with **KV
  pipelining** (§3.2, `kv_profile.py`): a GT may take the unused tail of a
  longer GT's allocation when it is predicted to finish, with a buffer,
  before the longer one grows into it.
- **Time-synced groups** (§3.3.2): GTs of equal remaining allocation (in
  blocks) sit together in the queue and are admitted together, and
  admission runs when the batch loses a member (a group completes), not
  every iteration.  A group that does not fit whole is split.
- **PTs fill the compute**: after the GTs' decodes, PTs are added up to the
  target forward size (the iteration token budget, `max_batch_tokens`),
  using the KV the batch's allocations leave, which includes the **reserve**
  (`econoserve.pt_reserve`) that GTs may not be admitted into.
- **Ordering** (§3.4): both queues by deadline range, then occupied KV
  (more first, to release it sooner), then prompt length (PTs) or
  remaining allocation in blocks (GTs: their time-synced group), longer
  first.  When the head does not fit, a bisection finds the longest task
  of the same range that does (a PT that fits the remaining token budget
  whole; a shorter GT group).
- **Under-prediction** (§3.3.2): a GT that reaches its allocation
  unfinished is given `overrun_growth` of its generated length more (or
  what jobs that ran as far past their prediction went on to generate,
  `overrun_extension: refined`, `scheduler/remaining_length.py`), in
  place if the reserve has room for it, else by a preemption: it leaves
  the batch and waits regrouped by its new remaining length, its KV swapped
  to the host tier (`pause_kv: swap`, where the swap mode and the tier
  allow), or dropped as the paper's **offload-free preemption** does
  (`drop`: recomputed when it returns), or kept on the device (`keep`: its
  occupied KV putting it near the front of the GT queue).

When a GT within its allocation cannot grow (a hosted GT overran, or PTs
used the free blocks), jobs outside the batch are evicted first (swapped to
the host tier or dropped for recomputation, `Policy.evict`), the least
urgent and least computed first.  When none can be evicted, the batch gives
way (`_grow`): its last admitted GT is evicted, or, where that is the
growing GT itself or has a swap-in pending, the growing GT pauses.

A job whose prediction has not arrived is allocated
`econoserve.default_output_len`, or the mean output length of the jobs this
replica has finished.  Live, the prediction is asked for beside the job, so
a short prompt can be computed and its GT admitted before it lands: the GT
keeps the allocation it was admitted on (a larger one landing would
overcommit the KV the batch was admitted into and starve every new prompt
of headroom), and when it runs past it the overrun extends it to the
landed prediction.  A waiting job is regrouped when its prediction lands.
A job's deadline is its request's (`jct_slo_s`), else its arrival here +
`jct_slo_scale` × (prefill time + predicted length × a loaded iteration's
time) from the cost estimate (§4).
"""

from __future__ import annotations

import math

from scheduler.blocks import blocks_for
from scheduler.job import Job, JobState
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.econoserve_pts import PromptFilling
from scheduler.policies.kv_profile import Lease, Profile
from scheduler.policies.task_queue import Key, TaskQueue, deadline_range
from scheduler.policy import Policy
from scheduler.remaining_length import RemainingLength

# Keys that depend on the clock (deadline ranges) are refreshed this often.
RESORT_S = 0.1
# Output length assumed before any job has finished (no prediction, no default).
FALLBACK_OUTPUT_LEN = 256


class EconoservePolicy(PromptFilling, Policy):
    name = "econoserve"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.ec = self.config.econoserve
        self.bs = self.config.block_size
        self.pts = TaskQueue()
        self.gts = TaskQueue()
        # GTs in the batch, in admission order.
        self.batch: dict[str, Job] = {}
        # Allocations extended after an overrun (output tokens in all).
        self._extended: dict[str, int] = {}
        # When each job reached this policy, on its clock (a job's
        # `arrival_time` may be on another: the client's wall clock).
        self._added_at: dict[str, float] = {}
        self._profile: Profile | None = None  # the batch's, None when stale
        # PTs part-way through their prompt: the rest of it is theirs.
        self._prefilling: dict[str, Job] = {}
        self._replenish = True
        # The last admission stopped with slots and KV to spare, so a new
        # GT is admitted at once rather than at the next group completion.
        self._room = True
        self._sorted_at = -math.inf
        self._finished = [0, 0]  # jobs finished here, their output tokens
        self.lengths = (RemainingLength(self.ec.refine_quantile)
                        if self.ec.overrun_extension == "refined" else None)
        self.reserve = math.ceil(self.config.num_blocks * self.ec.pt_reserve)
        # Counters (metrics and studies).
        self.num_admissions = 0  # replenishments that admitted a GT
        self.num_groups_admitted = 0
        self.num_gts_admitted = 0
        self.num_overruns = 0
        self.num_extended = 0  # overruns served from the reserve in place
        self.num_paused = 0  # preemptions past an allocation (`pause_kv`)
        self.num_evicted = 0

    def counters(self) -> dict[str, int]:
        names = ("admissions", "groups_admitted", "gts_admitted", "overruns", "extended",
                 "paused", "evicted")
        return {f"econoserve_{n}": getattr(self, f"num_{n}") for n in names}

    # Allocation ------------------------------------------------------------

    def allocation(self, job: Job) -> int:
        """Output tokens `job` may generate before it overruns (§3.3.1)."""
        ext = self._extended.get(job.job_id)
        if ext is not None:
            return ext
        a = job.allocated_output_len or job.predicted_output_len
        if a is None:
            a = self.ec.default_output_len or self._mean_output_len()
        room = self.config.max_model_len - job.num_prompt_tokens
        return max(1, min(a, job.max_tokens, room))

    def _mean_output_len(self) -> int:
        n, total = self._finished
        return round(total / n) if n else FALLBACK_OUTPUT_LEN

    def remaining(self, job: Job) -> int:
        return max(0, self.allocation(job) - job.num_output_tokens)

    def group(self, job: Job) -> int:
        """A GT's time-synced group: its remaining allocation in blocks."""
        return blocks_for(max(1, self.remaining(job)), self.bs)

    def lease(self, job: Job) -> Lease:
        buf = math.ceil(self.ec.pipeline_buffer * self.allocation(job)) if self.ec.pipelining else 0
        return Lease(job.num_tokens, self.remaining(job), buf)

    def profile(self) -> Profile:
        """The batch's KV over the coming steps.  Kept between plans while
        the batch does not change: its peak only falls as its GTs advance,
        so a kept one errs on the safe side for the PTs' headroom."""
        if self._profile is None:
            self._profile = Profile([self.lease(j) for j in self.batch.values()],
                                    self.bs, self.ec.pipelining)
        return self._profile

    # Ordering (§3.4) -----------------------------------------------------

    def deadline(self, job: Job) -> float | None:
        if job.deadline is not None:
            return job.deadline
        if self.ec.jct_slo_scale is None or self.cost is None:
            return None
        rl = job.predicted_output_len or self.allocation(job)
        work = (self.cost.prefill_time(job.num_prompt_tokens)
                + rl * self.cost.decode_time(self.config.max_batch_size))
        return self._added_at.get(job.job_id, job.arrival_time) + self.ec.jct_slo_scale * work

    def _range(self, job: Job, now: float) -> int:
        return deadline_range(self.deadline(job), now, self.ec.deadline_ranges_s)

    def _occupied(self, job: Job) -> int:
        return -(job.num_computed_tokens // self.ec.kv_range_tokens)

    def pt_key(self, job: Job, now: float) -> Key:
        if not self.ec.ordering:
            return (job.arrival_seq,)
        return (self._range(job, now), self._occupied(job), -job.num_uncomputed_tokens,
                job.arrival_seq)

    def gt_key(self, job: Job, now: float) -> Key:
        if not self.ec.ordering:
            return (job.arrival_seq,)
        return (self._range(job, now), self._occupied(job), -self.group(job), job.arrival_seq)

    @staticmethod
    def is_gt(job: Job) -> bool:
        return job.num_output_tokens > 0 and job.num_uncomputed_tokens <= 1

    def _queue(self, job: Job) -> None:
        now = self.clock()
        if self.is_gt(job):
            self.gts.add(job, self.gt_key(job, now))
            if self._room:
                self._replenish = True
        else:
            self.pts.add(job, self.pt_key(job, now))

    # Policy interface --------------------------------------------------------

    def add(self, job: Job) -> None:
        self._added_at.setdefault(job.job_id, self.clock())
        self._queue(job)

    def remove(self, job: Job) -> None:
        if self.batch.pop(job.job_id, None) is not None:
            self._profile = None
            self._replenish = True
        elif not self.pts.remove(job):
            self.gts.remove(job)
        self._extended.pop(job.job_id, None)
        self._added_at.pop(job.job_id, None)
        self._prefilling.pop(job.job_id, None)
        if job.num_output_tokens:
            self._finished[0] += 1
            self._finished[1] += job.num_output_tokens
        if self.lengths is not None and job.finish_reason == "stop" and job.predicted_output_len:
            self.lengths.observe(job.predicted_output_len, job.num_output_tokens)

    def on_prediction(self, job: Job) -> None:
        """`job`'s prediction landed after it arrived (live, the predictor
        answers beside the prompt's computation, not before it).  Waiting,
        its allocation and queue key change with it; in the batch, neither
        (`_admit`)."""
        if job.job_id in self.batch:
            return  # its allocation stays the one it was admitted with
        for q, key in ((self.gts, self.gt_key), (self.pts, self.pt_key)):
            if q.remove(job):
                q.add(job, key(job, self.clock()))
                return

    def num_waiting(self) -> int:
        return len(self.pts) + len(self.gts)

    def num_running(self) -> int:
        return len(self.batch)

    def on_step_done(self, plan: Plan, iteration_time: float) -> None:
        # Algorithm 1, line 7: PTs whose prompt is computed become GTs.
        for c in plan.chunks:
            job = self.pts.get(c.job_id)
            if job is not None and self.is_gt(job):
                self.pts.remove(job)
                self._prefilling.pop(job.job_id, None)
                self._queue(job)

    def schedule(self, step: int) -> Plan:
        plan = Plan(step=step)
        now = self.clock()
        if self.ec.ordering and now - self._sorted_at >= RESORT_S:
            self.pts.resort(lambda j: self.pt_key(j, now))
            self.gts.resort(lambda j: self.gt_key(j, now))
            self._sorted_at = now
        chunks: list[ScheduledChunk] = []
        budget = self.config.max_batch_tokens
        served: set[str] = set()
        # A second round admits GTs in place of those that paused or gave
        # way in the first, so that their slots do not idle an iteration.
        for _ in range(2):
            if self._replenish or not self.ec.time_synced or (self.gts and not self.batch):
                self._admit_gts(plan, now)
            for job in list(self.batch.values()):
                if budget <= 0:
                    break
                if job.job_id in served or job.job_id not in self.batch:
                    continue
                served.add(job.job_id)
                if not job.is_resident:  # its swap-in is in flight
                    continue
                if self.remaining(job) == 0 and not self._overrun(job, plan):
                    continue
                if not self._grow(job, 1, plan, now):
                    continue
                chunks.append(self.chunk_for(job, 1))
                budget -= 1
            if not self._replenish:
                break
        self._fill_pts(plan, chunks, budget, now)
        plan.chunks = chunks
        return plan

    # GTs (Algorithm 1, lines 1-3) -------------------------------------------

    def _outside(self) -> int:
        """Blocks held by jobs outside the batch."""
        return self.blocks.num_used - self._held_by_batch()

    def _held_by_batch(self) -> int:
        return sum(len(j.block_table) for j in self.batch.values())

    def _admit_gts(self, plan: Plan, now: float) -> None:
        self._replenish = False
        slots = self.config.max_batch_size - len(self.batch)
        if not self.gts or slots <= 0:
            self._room = slots > 0
            return
        # Rebuilt from the batch as it stands: a profile kept from an earlier
        # plan counts its leases' steps from then, not from now.
        self._profile = None
        prof = self.profile()
        outside = self._outside()
        cap = self.blocks.num_blocks - self.reserve
        admitted: list[Job] = []
        fits_all = True
        i, checks = 0, 0
        while i < len(self.gts) and slots > 0 and checks < 4 * self.config.max_batch_size:
            job = self.gts.at(i)
            if job.swap_pending is not None:  # a swap-out still in flight
                i += 1
                continue
            held = len(job.block_table)
            lease = self.lease(job)
            checks += 1
            if prof.peak_with(lease) + outside - held > cap:
                fits_all = False
                i = self._next_group(i)
                continue
            if job.num_host_blocks:
                ops = self.swap.swap_in(job)
                if ops is None:
                    fits_all = False
                    i += 1
                    continue
                plan.block_ops += ops
            self.gts.remove(job)
            self._admit(job)
            prof.add(lease)
            outside -= held
            slots -= 1
            admitted.append(job)
        if i < len(self.gts) and slots > 0:
            fits_all = False  # the scan stopped at its bound
        if not admitted and not self.batch and self.gts:
            admitted = self._admit_head_anyway(plan, now)
        self._room = fits_all and slots > 0
        if admitted:
            self.num_admissions += 1
            self.num_gts_admitted += len(admitted)
            self.num_groups_admitted += len({self.group(j) for j in admitted})

    def _next_group(self, i: int) -> int:
        """After a GT at `i` did not fit: the first GT of a shorter group in
        the same ranges (bisection, §3.4), or of the next ranges."""
        if not self.ec.ordering:
            return i + 1
        key = self.gts.key(self.gts.at(i))
        return max(i + 1, self.gts.first_from(key[:2] + (key[2] + 1,)))

    def _admit_head_anyway(self, plan: Plan, now: float) -> list[Job]:
        """Nothing runs and the first GT does not fit: jobs outside the batch
        hold the KV (prompts of waiting GTs, paused GTs).  Evict them until
        it fits, then admit it whatever its allocation, so work goes on."""
        head = self.gts.at(0)
        if head.swap_pending is not None:
            return []
        cap = self.blocks.num_blocks - self.reserve
        need = Profile([self.lease(head)], self.bs, self.ec.pipelining).peak
        while need + self._outside() - len(head.block_table) > cap:
            victim = self._victim(now, exclude=head)
            if victim is None:
                break
            self._evict(victim, plan)
        if head.num_host_blocks:
            ops = self.swap.swap_in(head)
            if ops is None:
                return []
            plan.block_ops += ops
        self.gts.remove(head)
        self._admit(head)
        self._profile = None
        return [head]

    def _admit(self, job: Job) -> None:
        """Into the batch.  A GT whose prediction has not landed keeps the
        allocation it is admitted with: one that grew when the prediction
        landed would overcommit the KV the batch was admitted into.  If it
        runs past it, the overrun path extends it toward the prediction."""
        if job.allocated_output_len is None and job.predicted_output_len is None:
            self._extended.setdefault(job.job_id, self.allocation(job))
        self.batch[job.job_id] = job

    def _overrun(self, job: Job, plan: Plan) -> bool:
        """`job` used its allocation unfinished (§3.3.2).  Extend it; True if
        it stays in the batch (the reserve has room), False if it paused."""
        self.num_overruns += 1
        gen = job.num_output_tokens
        extra = max(self.bs, math.ceil(gen * self.ec.overrun_growth))
        landed = job.allocated_output_len or job.predicted_output_len
        if landed and landed > gen:  # admitted before its prediction landed
            extra = max(self.bs, landed - gen)
        if self.lengths is not None and job.predicted_output_len:
            extra = max(self.bs, self.lengths.remaining(job.predicted_output_len, gen) or extra)
        extra = min(extra, job.max_tokens - gen, self.config.max_model_len - job.num_tokens)
        self._extended[job.job_id] = gen + max(1, extra)
        self._profile = None
        if self.profile().peak + self._outside() <= self.blocks.num_blocks:
            self.num_extended += 1
            return True
        # Preempted: out of the batch, its KV as `pause_kv` says, regrouped
        # by its new remaining length.
        del self.batch[job.job_id]
        self._profile = None
        self._pause(job, plan)
        self.num_paused += 1
        return False

    def _pause(self, job: Job, plan: Plan) -> None:
        if self.ec.pause_kv == "keep":
            job.num_preemptions += 1
            if job.state is JobState.RUNNING:
                job.transition(JobState.PREEMPTED)
        elif self.ec.pause_kv == "swap":
            self.evict(job, plan.block_ops)
        else:  # offload-free: dropped, never copied to the host
            self.preempt_recompute(job)
        plan.preempted.append(job.job_id)
        self._replenish = True
        self._queue(job)

    def _grow(self, job: Job, n: int, plan: Plan, now: float) -> bool:
        """Blocks for `n` more tokens of `job`, evicting jobs outside the
        batch if that is what it takes.  False if `job` cannot run now."""
        while not self.blocks.grow(job, n):
            victim = self._victim(now, exclude=job)
            if victim is None:
                if job.job_id in self.batch:
                    # Only the batch holds KV: the last admitted GT gives way.
                    last = next(reversed(self.batch.values()))
                    if last is not job and last.swap_pending is None:
                        self._evict(last, plan)
                        continue
                    del self.batch[job.job_id]
                    self._profile = None
                    self._pause(job, plan)
                return False
            self._evict(victim, plan)
        return True

    def _victim(self, now: float, exclude: Job) -> Job | None:
        """The job outside the batch to evict first: in the latest deadline
        range, holding the least computed KV (Observation 5)."""
        best: Job | None = None
        best_key: tuple[int, int, int] | None = None
        for j in self.blocks.holding.values():
            if (j is exclude or j.job_id in self.batch or j.swap_pending is not None
                    or (j not in self.gts and j not in self.pts)):
                continue
            k = (self._range(j, now), -j.num_computed_tokens, j.arrival_seq)
            if best_key is None or k > best_key:
                best, best_key = j, k
        return best

    def _evict(self, job: Job, plan: Plan) -> None:
        if self.batch.pop(job.job_id, None) is not None:
            self._profile = None
            self._replenish = True
        elif not self.pts.remove(job):
            self.gts.remove(job)
        self.evict(job, plan.block_ops)
        self._prefilling.pop(job.job_id, None)
        plan.preempted.append(job.job_id)
        self.num_evicted += 1
        self._queue(job)
