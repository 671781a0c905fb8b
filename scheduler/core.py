"""`SchedulerCore`: the job registry and lifecycle around one `Policy`.

One instance lives in each engine replica's driver (and in the simulator).
It turns the policy's plans into bookkeeping: computed tokens, sampled
tokens, finishing and freeing.  Deterministic given its clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.blocks import BlockManager
from scheduler.checkpoint import survival_checkpoints
from scheduler.config import SchedulerConfig
from scheduler.job import Job, JobState, padded_length
from scheduler.plan import BlockOpKind, Plan, StepResult, TokenLogprob
from scheduler.policies import policy_class
from scheduler.cost import CostEstimator
from scheduler.policy import Clock
from scheduler.sharing import PromptSharing
from scheduler.speculation import add_drafts, observe
from scheduler.swap import SwapManager


_FETCHES = (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH)


@dataclass(slots=True)
class JobEvent:
    """What a client's stream learns after one iteration."""

    job_id: str
    token_id: int | None
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # The engine left the text to be decoded later (`JobOutput.text_later`);
    # whoever delivers the event calls it, in order, and fills `text`.
    text_later: Callable[[], str] | None = None
    # The stop string or stop token id that ended it (`JobOutput.stop_reason`).
    stop_reason: str | int | None = None
    # Accepted drafts, before `token_id` (`JobOutput.accepted`).
    accepted: list[int] | None = None


@dataclass(slots=True)
class CoreStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    # Cumulative prompt tokens that siblings (OpenAI `n` > 1) took from
    # their leader's KV instead of computing them.
    num_shared_prompt_tokens: int = 0
    # Cumulative tokens of admitted jobs, and those whose KV they found in
    # the prefix cache (`prefix_caching`).
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Parked blocks: cached KV that no job holds, counted as free.
    num_cached_blocks: int = 0


class SchedulerCore:
    def __init__(self, config: SchedulerConfig, clock: Clock,
                 cost: CostEstimator | None = None) -> None:
        self.config = config
        self.clock = clock
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   prefix_caching=config.prefix_caching,
                                   block_run=config.block_run)
        self.swap = SwapManager(self.blocks, config.host_kv_blocks)
        self.policy = policy_class(config.policy)(config, self.blocks, clock, self.swap, cost)
        self.sharing = PromptSharing(self.blocks)
        self.jobs: dict[str, Job] = {}
        self._arrivals = itertools.count()
        # Jobs in the latest plan's batch: everyone else is queued
        # (admission control counts their work, scheduler/admission.py).
        self.batch: frozenset[str] = frozenset()
        self._step = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # Lifecycle ----------------------------------------------------------

    def add(self, job: Job, share_prompt_with: str | None = None,
            host_blocks: int = 0, use_prefix_cache: bool = True) -> None:
        """Admit `job`.  With `share_prompt_with`, `job` is a sibling of that
        already-added job (same prompt, another completion of one request):
        it reuses the prompt's KV blocks instead of prefilling them
        (`scheduler/sharing.py`).  With `host_blocks`, the host tier already
        holds the KV of the job's first `host_blocks` blocks (checkpointed
        by a replica that died, `survival.checkpoint`): it starts as a job
        discarded to its checkpoint does, prefetching them and computing
        only the tokens past them.  Otherwise, with `prefix_caching`, it
        adopts the cached blocks that begin its tokens
        (`scheduler/prefix_cache.py`), and looks again when it starts
        from nothing, unless `use_prefix_cache` is False (it needs the
        logits of every prompt position)."""
        if job.job_id in self.jobs:
            raise ValueError(f"duplicate job id {job.job_id}")
        if job.num_prompt_tokens == 0:
            raise ValueError("a job needs at least one prompt token")
        if job.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {job.num_prompt_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        leader = None
        if share_prompt_with is not None:
            leader = self.jobs.get(share_prompt_with)
            if leader is None:
                raise ValueError(f"cannot share the prompt of unknown job {share_prompt_with}")
            if leader.prompt_token_ids != job.prompt_token_ids:
                raise ValueError(
                    f"{job.job_id} and {share_prompt_with} have different prompts")
            if job.num_computed_tokens or job.block_table:
                raise ValueError(f"{job.job_id} already has KV")
        if host_blocks:
            if leader is not None:
                raise ValueError(f"{job.job_id} cannot both share a prompt and resume KV")
            # Its last token stays to be computed: it samples the next one.
            host_blocks = min(host_blocks, (job.num_tokens - 1) // self.config.block_size)
        job.arrival_seq = next(self._arrivals)
        self.jobs[job.job_id] = job
        if leader is not None and self.sharing.attach(job, leader):
            return  # held until its leader has computed the shared blocks
        job.adopts_cached_kv = use_prefix_cache
        if host_blocks > 0:
            self.swap.adopt(job, host_blocks)
        else:
            self.blocks.claim_cached(job)
        self.policy.add(job)

    def abort(self, job_id: str, keep_host: bool = False) -> bool:
        """Abort a job wherever it is; frees its blocks.  False if unknown.
        `keep_host`: its host copy stays in the tier (`SwapManager.release_host`)."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        if not self.sharing.drop(job):
            self.blocks.free(job)
            self.swap.release_host(job, keep=keep_host)
            self.policy.remove(job)
            self._release_siblings(self.sharing.on_gone(job))
        job.transition(JobState.ABORTED)
        job.finish_reason = "abort"
        job.finish_time = self.clock()
        self.num_aborted += 1
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.jobs)

    # Iteration ----------------------------------------------------------

    def schedule(self) -> Plan:
        self._step += 1
        plan = self.policy.schedule(self._step)
        cfg = self.config
        if cfg.speculative.num_tokens:
            add_drafts(plan, self.jobs, cfg.speculative, cfg.block_size, cfg.max_model_len,
                       cfg.max_batch_tokens)
        self.batch = frozenset(c.job_id for c in plan.chunks)
        self._release_siblings(self.sharing.release_evicted())
        if plan.block_ops:
            now, last = self.clock(), None
            for op in plan.block_ops:
                # Once per job (its ops are together); its first may be past block 0.
                if op.kind in _FETCHES and op.job_id != last:
                    last = op.job_id
                    self.jobs[op.job_id].swap_in_issued_at = now
        survival = self.config.survival
        if survival.checkpoint and self.swap.host_capacity:
            jobs = self.jobs
            plan.block_ops += survival_checkpoints(
                self.swap, (jobs[c.job_id] for c in plan.chunks), survival)
        # Drops of finished / aborted jobs' host copies go first.
        if self.swap.pending_ops:
            plan.block_ops[:0] = self.swap.take_pending()
        self.num_preemptions += len(plan.preempted)
        return plan

    def complete(self, plan: Plan, result: StepResult) -> list[JobEvent]:
        """Apply the engine's results of `plan`; returns per-job events."""
        now = self.clock()
        self.apply_swaps(result)
        if result.interrupted:
            # Nothing was computed: each job plans the same tokens again.
            return []
        outputs = {o.job_id: o for o in result.outputs}
        events: list[JobEvent] = []
        jobs, spent = self.jobs, result.iteration_time
        # Only leaders of held siblings (OpenAI `n` > 1) need the call.
        sharing = self.sharing if self.sharing.has_groups else None
        max_model_len = self.config.max_model_len
        prefix = self.blocks.prefix
        # Once per chunk per iteration: the job's properties inlined.
        for chunk in plan.chunks:
            job = jobs.get(chunk.job_id)
            if job is None:  # aborted while the iteration ran
                continue
            out = outputs.get(chunk.job_id)
            accepted = out.accepted if out is not None else ()
            # A draft's KV counts only if it was accepted (speculation.py).
            known = len(chunk.token_ids) - chunk.draft  # `num_known_tokens`
            job.num_computed_tokens += known + len(accepted)
            if chunk.draft and out is not None and out.token_id is not None:
                observe(job, chunk.draft, len(accepted))
            if prefix is not None and known > 1:
                # A prefilled prompt is found by jobs arriving from now on
                # (blocks a decode fills are indexed at its next `grow`).
                prefix.index(job, job.num_computed_tokens)
            job.attained_service += spent
            if sharing is not None:
                self._release_siblings(sharing.on_computed(job))
            if not chunk.sample or out is None or out.token_id is None:
                continue
            produced = job.output_token_ids
            if accepted:
                produced += accepted
                job.num_accepted += len(accepted)
                if job.predicted_drafts:
                    job.num_prediction_accepted += len(accepted)
            produced.append(out.token_id)
            if out.predicted_output_len is not None:
                self._engine_prediction(job, out.predicted_output_len)
            if job.first_token_time is None:
                job.first_token_time = now
            reason = out.finish_reason
            if reason is None and (
                len(produced) >= job.max_tokens
                or len(job.prompt_token_ids) + len(produced) >= max_model_len
            ):
                reason = "length"
            if reason is not None:
                self._finish(job, reason, now)
            events.append(JobEvent(job.job_id, out.token_id, out.text, reason is not None,
                                   reason, out.logprobs, out.prompt_logprobs,
                                   out.text_later, out.stop_reason, accepted or None))
        self.policy.on_step_done(plan, result.iteration_time)
        return events

    def _engine_prediction(self, job: Job, n: int) -> None:
        """The engine's length head estimated `job`'s answer at its first
        token (engine/length_head.py): it replaces the predictor's, with the
        same padding, before the policy sees the job as generating."""
        job.length_from_engine = True
        self.set_prediction(job, n, padded_length(n, self.config.length_padding_ratio))

    def set_prediction(self, job: Job, predicted: int, allocation: int | None) -> None:
        """`job`'s response-length prediction (and its padded allocation)
        landed now, after the job was added: the policy hears of it."""
        job.predicted_output_len = predicted
        job.allocated_output_len = allocation
        job.prediction_time = self.clock()
        self.policy.on_prediction(job)

    def apply_swaps(self, result: StepResult) -> None:
        """The swap-ins that landed or failed, and the copy and iteration
        rates the engine measured."""
        now = self.clock()
        for job_id in result.swaps_in_done:
            landed = self.jobs.get(job_id)
            if landed is not None and landed.swap_pending is not None:
                if landed.swap_in_issued_at is not None:
                    landed.swap_wait_time += now - landed.swap_in_issued_at
                self.swap.swap_in_done(landed)
        for job_id in result.swaps_in_failed:
            lost = self.jobs.get(job_id)
            if lost is not None and lost.swap_pending is not None:
                self.swap.swap_in_failed(lost)
        if result.copy_rate is not None:
            self.swap.copy_rate = result.copy_rate
        if result.iteration_time > 0.0:
            self.swap.iteration_time = result.iteration_time

    def _release_siblings(self, siblings: list[Job]) -> None:
        for s in siblings:
            self.policy.add(s)

    def _finish(self, job: Job, reason: str, now: float) -> None:
        job.finish_reason = reason  # before the policy sees it go
        self.blocks.free(job)
        self.swap.release_host(job)
        self.policy.remove(job)
        self._release_siblings(self.sharing.on_gone(job))
        job.transition(JobState.FINISHED)
        job.finish_time = now
        del self.jobs[job.job_id]
        self.num_finished += 1

    def stats(self) -> CoreStats:
        return CoreStats(
            num_waiting=self.policy.num_waiting() + self.sharing.num_held,
            num_running=self.policy.num_running(),
            num_free_blocks=self.blocks.num_free,
            num_blocks=self.blocks.num_blocks,
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_shared_prompt_tokens=self.sharing.num_shared_tokens,
            **self._prefix_stats(),
        )

    def _prefix_stats(self) -> dict[str, int]:
        prefix = self.blocks.prefix
        if prefix is None:
            return {}
        return {"num_prefix_queried_tokens": prefix.num_queried_tokens,
                "num_prefix_hit_tokens": prefix.num_hit_tokens,
                "num_cached_blocks": prefix.num_parked}
