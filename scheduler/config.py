"""Configuration of the per-replica scheduling core.

`SchedulingSettings` states each scheduling field and its bounds once: the
application's config (`api.config.AppConfig`) derives from it, so the YAML
a user writes and the simulator's configs are checked by the same rules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class MLFQConfig(BaseModel):
    """Skip-join MLFQ knobs (FastServe §4.1, Algorithm 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: enough queues that only a job which has already run about
    # max_model_len iterations reaches the last (FIFO) one (see
    # `MLFQPolicy`); too few queues put every job past its first few
    # dozen tokens into one FIFO and bring head-of-line blocking back.
    num_queues: int | None = Field(None, ge=1, le=32)
    # q1; None: the minimum iteration time of the cost model (the paper's rule).
    base_quantum_s: float | None = Field(None, gt=0)
    # q_{i+1} = ratio * q_i; the paper doubles.
    quantum_ratio: float = Field(2.0, gt=1.0)
    # α: a job not scheduled for this long is promoted to Q1.  None:
    # slo_normalized_s * max_model_len (`MLFQPolicy._starvation_threshold`).
    starvation_s: float | None = Field(None, gt=0)
    # Mean normalized-latency objective (s/token).  None: 10x the cost
    # model's decode iteration at batch 1, FastServe's rule (§6.1).
    slo_normalized_s: float | None = Field(None, gt=0)
    # What a new job's queue is chosen by (skip-join, Algorithm 1 line 8):
    # its first iteration (`prefill`, the paper's rule), or its predicted
    # whole work, prefill plus predicted length x a batch-1 decode
    # (`predicted`, EconoServe's predictor sharpening FastServe; a job whose
    # prediction has not landed joins by its prefill).
    skip_join: Literal["prefill", "predicted"] = "prefill"
    # ENST's T_execute (FastServe §4.2), which orders swap-outs and
    # prefetches: every job ahead charged with all the quanta up to this
    # level (`quanta`, the paper's rule), or at most its predicted remaining
    # service (`predicted`; `scheduler/policies/enst.py`).
    enst: Literal["quanta", "predicted"] = "quanta"
    # Whether a job with no KV anywhere (never started, or dropped) may
    # start by evicting started jobs to recomputation.  FastServe §4.2
    # counts on the host tier holding every started job; when device and
    # host are both full, each such start throws away another job's work,
    # which then does the same in turn (its strawman 2), and a burst larger
    # than the KV tier finishes nothing.  False: such a job starts only in
    # free blocks or by evicting jobs whose KV goes to the host (or back to
    # a checkpoint), and otherwise waits its turn.
    cold_start_recompute: bool = False


class ConserveConfig(BaseModel):
    """Co-serving knobs (ConServe §4.2, §4.5; `policy: conserve`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The online objectives the offline budget protects.  None: 10x (TTFT)
    # and 3x (TPOT) the cost estimate's batch-1 decode iteration.
    ttft_slo_s: float | None = Field(None, gt=0)
    tpot_slo_s: float | None = Field(None, gt=0)
    # The iteration estimate the budget is checked against: `live` fits the
    # replica's measured iterations by their decodes, decode context and
    # prefill tokens (scheduler/cost_fit.py), starting from the start-up
    # fit; `startup` keeps the start-up fit, which misses long contexts and
    # a host slower than at start.  `cost_memory`: iterations after which a
    # measurement's weight has fallen to 1/e.
    cost_fit: Literal["live", "startup"] = "live"
    cost_memory: float = Field(200.0, ge=1.0)
    # Offline batching mode (no online work present): batch limits that
    # replace max_batch_size / max_batch_tokens.  None: those limits.
    offline_max_batch_size: int | None = Field(None, ge=1, le=4096)
    offline_max_batch_tokens: int | None = Field(None, ge=1)
    # Which waiting offline jobs are admitted: while blocks are free
    # (`free`), or while the running offline jobs' KV at their predicted
    # lengths (with the predictor's padding) and the newcomer's fit beside
    # what online work holds (`predicted`): offline jobs then do not outgrow
    # the cache and evict one another.  A job with no prediction is
    # admitted on free blocks.
    offline_admission: Literal["free", "predicted"] = "free"
    # How online jobs are ordered among themselves: `fcfs` (priority, then
    # arrival; a running job keeps its place) or `mlfq` (FastServe's
    # skip-join MLFQ with the `mlfq` section's settings: preemption between
    # online jobs after any token, so a long one never blocks short ones).
    online_order: Literal["fcfs", "mlfq"] = "fcfs"
    # Incremental checkpointing of running offline jobs' KV to the host
    # tier (§4.4), so that preempting one frees its blocks with no copy.
    # Needs a host tier (`host_kv_tokens`).  It starts once this fraction
    # of the device blocks is in use, and covers more of the offline jobs
    # as use grows (§4.5, adaptive checkpointing).
    checkpoint: bool = True
    checkpoint_threshold: float = Field(0.5, ge=0.0, le=1.0)
    # Blocks copied per iteration at most (the I/O budget); the rest wait.
    checkpoint_max_blocks: int = Field(32, ge=1)


class EconoserveConfig(BaseModel):
    """Predictor-driven scheduling knobs (EconoServe §3; `policy: econoserve`).

    A generation task (GT) is allocated its predicted response length plus
    padding; the padding is the predictor's (`predictor.padding_ratio`), so
    it travels with each job as `Job.allocated_output_len`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Share of device blocks that only prompt tasks (PTs) and GTs that ran
    # past their allocation may use (§3.3.1; 3 % for ShareGPT, §2.3).
    pt_reserve: float = Field(0.03, ge=0.0, lt=1.0)
    # KV pipelining (§3.2): GTs may use the unused tail of longer GTs'
    # allocations.  False: exact allocation, each GT's whole allocation
    # counted from the start.
    pipelining: bool = True
    # The buffer b of §3.2, as a share of a GT's allocation: a GT is
    # assumed to hold its blocks this much longer than its allocation when
    # another GT is admitted into its space (15 % for ShareGPT, §4).
    pipeline_buffer: float = Field(0.15, ge=0.0, le=4.0)
    # Time-synced batching (§3.3.2): GTs are admitted in groups of equal
    # remaining allocation, when the batch loses a member.  False: one GT
    # at a time, every iteration.
    time_synced: bool = True
    # Ordering (§3.4): by deadline range, then occupied KV, then length.
    # False: arrival order in both queues.
    ordering: bool = True
    # Upper bounds (s of slack before the deadline) of the deadline ranges.
    deadline_ranges_s: tuple[float, ...] = (0.2, 0.5, 2.0)
    # Width (tokens) of the occupied-KV ranges.
    kv_range_tokens: int = Field(128, ge=1)
    # A job's deadline when its request sets none (`jct_slo_s`): arrival +
    # scale * (prefill time + predicted RL * a loaded iteration's time),
    # from the cost estimate (§4, SLO scale 2).  None: no deadline.
    jct_slo_scale: float | None = Field(2.0, gt=0)
    # The allocation of a GT whose prediction has not arrived: None, the
    # mean output length of the jobs this replica finished (256 before any).
    default_output_len: int | None = Field(None, ge=1)
    # A GT that reaches its allocation unfinished gets this share of its
    # generated length more (at least a block): in place when the reserve
    # has room, else after a preemption (`pause_kv`; §3.3.2).
    overrun_growth: float = Field(0.5, gt=0.0, le=4.0)
    # Or (`refined`) the quantile `refine_quantile` of what jobs that ran
    # this far past their prediction went on to generate, learnt from the
    # jobs this replica finished (`scheduler/remaining_length.py`); the
    # growth rule until enough have finished.
    overrun_extension: Literal["growth", "refined"] = "growth"
    refine_quantile: float = Field(0.5, gt=0.0, lt=1.0)
    # What the preemption of such a GT does with its KV: swap it to the host
    # tier (`Policy.evict`: where `swap_mode` and the tier's room allow, else
    # dropped), drop it (EconoServe's offload-free preemption, §3.3.2:
    # recomputed when the GT is admitted again), or keep it on the device
    # while it waits.  Swapping measured best where a tier is configured
    # (studies/econoserve_live, "Pausing to the host tier"); keeping, no
    # better than dropping: the kept blocks shrink the batch.
    pause_kv: Literal["drop", "keep", "swap"] = "swap"

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pause_keeps_kv" in data:
            raise ValueError("pause_keeps_kv is now pause_kv: drop (false), keep (true) or swap")
        return data

    @field_validator("deadline_ranges_s")
    @classmethod
    def _ascending(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if list(v) != sorted(v) or any(x <= 0 for x in v):
            raise ValueError("deadline_ranges_s must be positive and ascending")
        return v


class SurvivalConfig(BaseModel):
    """Incremental KV checkpoints of every running job, so that a job whose
    engine replica dies resumes elsewhere from its last checkpoint instead
    of recomputing its whole context (ConServe §4.4's mechanism, for every
    class; deployments/resume.py re-admits it, the host tier's blocks
    outlive their writer: kvstore/directory.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Copy each running job's full KV blocks to the host tier as they fill.
    checkpoint: bool = False
    # A job's blocks are copied once it has this many full ones without a
    # copy: fewer, larger copies; at most this many blocks' worth of tokens
    # (times block_size) is recomputed after a failure.
    every_blocks: int = Field(4, ge=1)
    # Blocks copied per iteration, at most (and at most what the tier
    # stores while one iteration computes, as ConServe's I/O budget).
    max_blocks_per_iteration: int = Field(64, ge=1)


class SpeculativeConfig(BaseModel):
    """Speculative decoding with drafts looked up in the job's own tokens
    (prompt lookup: an n-gram ending the text is found earlier in it, and
    the tokens that followed it there are proposed; scheduler/speculation.py).
    The engine verifies the drafts in the job's decode pass, which then
    yields the accepted drafts and one more token (engine/speculative.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Draft tokens proposed per decode step, at most; 0: off.
    num_tokens: int = Field(0, ge=0, le=16)
    # Lengths of the n-gram looked up, the longest first.
    min_ngram: int = Field(2, ge=1, le=16)
    max_ngram: int = Field(4, ge=1, le=16)
    # Drafts are proposed only while a plan decodes at most this many jobs:
    # verifying k drafts costs a step what k more rows do, which pays while
    # a step is bound by reading the weights, not once it is bound by compute.
    max_batch: int = Field(8, ge=1, le=4096)
    # Adaptive draft length: the n-th draft of a step is proposed only while
    # the job's recent acceptance rate a gives a^n (the chance that it and
    # the drafts before it are all accepted) at least this; a job below it
    # for even one draft proposes one every 8th step to measure again.
    # 0 (the default: studies/speculative/README.md found no steady gain):
    # always `num_tokens`.
    min_acceptance: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpeculativeConfig":
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")
        return self


class SchedulingSettings(BaseModel):
    """The scheduling fields a user sets as they are.  The KV sizes are not
    here: the scheduler counts them in blocks, a user in tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A name in `scheduler.policies.POLICIES`.
    policy: str = "fcfs"
    block_size: int = Field(16, ge=1, le=256)
    # How many consecutive blocks a job's growth is handed where the pool
    # allows (scheduler/free_blocks.py); 1: first come, first served.
    block_run: int = Field(8, ge=1, le=1024)
    max_batch_size: int = Field(32, ge=1, le=4096)
    # Token budget of one iteration: decodes count one each, prefill chunks
    # their length (chunked prefill, as in vLLM / Sarathi).
    max_batch_tokens: int = Field(512, ge=1)
    # A prompt token and one output token at least (the engine's minimum).
    max_model_len: int = Field(2048, ge=2)
    # What preemption does with KV (scheduler/swap.py): drop it and
    # recompute, or swap it to the host tier (FastServe §4.2).  `reactive`
    # swaps when memory runs out or a job must run; `proactive` also keeps a
    # burst reserve and prefetches.
    swap_mode: Literal["recompute", "reactive", "proactive"] = "recompute"
    # Proactive mode: free blocks kept for arrivals.  None: sized from the
    # recent arrival rate (FastServe §4.2, "handling a burst").
    reserve_blocks: int | None = Field(None, ge=0)
    # Keep computed KV blocks after their jobs end, indexed by content, so
    # that a later prompt beginning with the same tokens (a system prompt,
    # a conversation's earlier turns) adopts them instead of computing
    # them (scheduler/prefix_cache.py).
    prefix_caching: bool = True
    mlfq: MLFQConfig = MLFQConfig()
    conserve: ConserveConfig = ConserveConfig()
    econoserve: EconoserveConfig = EconoserveConfig()
    survival: SurvivalConfig = SurvivalConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        # Imported here: the policies import this module.  Looked up at
        # validation, so a policy registered later (bench/oracle.py) counts.
        from scheduler.policies import policy_class

        policy_class(v)
        return v


class SchedulerConfig(SchedulingSettings):
    # Device KV cache in blocks.
    num_blocks: int = Field(..., ge=1)
    # Host KV tier capacity in blocks (0: no host tier, always recompute).
    host_kv_blocks: int = Field(0, ge=0)
    # Padding of the allocation made from the engine's length head
    # (`predictor.padding_ratio`, as the Predictor deployment's).
    length_padding_ratio: float = Field(0.15, ge=0.0, le=4.0)

    @model_validator(mode="after")
    def _fits(self) -> "SchedulerConfig":
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"a KV cache of {self.num_blocks * self.block_size} tokens "
                f"({self.num_blocks} blocks of {self.block_size}) cannot hold one "
                f"sequence of max_model_len = {self.max_model_len}"
            )
        return self

    @model_validator(mode="after")
    def _survival_needs_a_host_tier(self) -> "SchedulerConfig":
        if self.survival.checkpoint and not self.host_kv_blocks:
            raise ValueError("survival.checkpoint copies KV to the host tier: set "
                             "host_kv_tokens above 0")
        return self


class OfflinePoolConfig(BaseModel):
    """The cluster-level offline pool (scheduler/offline_pool.py): under
    `policy: conserve`, offline requests wait in the Scheduler deployment
    and engine replicas with spare capacity are handed them (ConServe §4.1:
    the scheduler "continuously fetches" offline requests from a pool)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # False: offline requests are placed on a replica at once, as online
    # ones are (outside admission control).
    enabled: bool = True
    # Offline jobs a replica may hold outside its running batch, beyond the
    # batch slots it has free: enough to refill its offline batch as jobs
    # finish between two load reports (0.5 s apart), few enough that work
    # does not sit on a busy replica while another has idle capacity.
    replica_queue_jobs: int = Field(4, ge=1, le=4096)
    # Offline requests a replica holds waiting while it serves online work
    # (unstarted, or started with their KV in the host tier) go back to the
    # pool when another replica has free batch slots and the pool is empty
    # (scheduler/offline_pool.py, `to_give_back`).
    move_queued: bool = True
    # A replica's queue grows to this many times the offline jobs it started
    # between its last two reports, when that is more than
    # `replica_queue_jobs` (a fast replica takes in dozens a report).  0: the
    # queue stays `replica_queue_jobs`.
    queue_per_start: float = Field(2.0, ge=0)
