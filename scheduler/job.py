"""The `Job`: one request's scheduling state, from arrival to its end.

State machine (`_TRANSITIONS` below):

    WAITING ──► RUNNING ──► FINISHED
                   │  ▲         ▲
                   ▼  │         │
                PREEMPTED ──────┘          any non-terminal state ──► ABORTED

A job carries from the start what later policies need: its class (online /
offline), priority level, deadline, predicted response length, attained
service and where each KV block lives.  The token ids themselves are kept
here because recomputation after a preemption re-feeds prompt + output.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class JobState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class JobClass(str, enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"


class BlockLocation(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    BOTH = "both"


_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.WAITING: frozenset({JobState.RUNNING, JobState.ABORTED}),
    JobState.RUNNING: frozenset(
        {JobState.PREEMPTED, JobState.FINISHED, JobState.ABORTED}
    ),
    # FINISHED: preempted while its last token was in flight
    # (scheduler/ahead.py), which turned out to end it.
    JobState.PREEMPTED: frozenset({JobState.RUNNING, JobState.FINISHED, JobState.ABORTED}),
    JobState.FINISHED: frozenset(),
    JobState.ABORTED: frozenset(),
}


def padded_length(predicted: float, ratio: float) -> int:
    """The answer length a predicted one is provisioned for: the prediction
    (rounded) plus a padding ratio, ceil(pred * (1 + ratio)), at least one
    token (EconoServe §2.3 and §3.3.1; the predictor's metrics score the
    same allocation, predictor/metrics.py)."""
    return max(1, math.ceil(round(predicted) * (1.0 + ratio) - 1e-9))


class InvalidTransition(RuntimeError):
    pass


# Plain dataclass, not pydantic: a job is touched several times per iteration
# on the hot path, and it never crosses a process boundary by itself.
@dataclass(eq=False)
class Job:
    job_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    job_class: JobClass = JobClass.ONLINE
    # vLLM's meaning: a lower value runs first.  Policies order by it
    # before anything else and evict the largest value first.
    priority: int = 0
    deadline: float | None = None
    predicted_output_len: int | None = None
    # The KV the predictor asks for: the prediction plus its padding
    # (EconoServe §2.3); `policy: econoserve` allocates it to the job.
    allocated_output_len: int | None = None
    # The prediction came from the engine's length head (at the first
    # token), which reads the served model's own state: the predictor's
    # estimate, if it lands later, no longer replaces it.
    length_from_engine: bool = False

    state: JobState = JobState.WAITING
    # Order of arrival at its scheduler core (stamped by `SchedulerCore.add`):
    # FCFS breaks priority ties by it, so a job keeps its place in line
    # however late it reaches the policy (a held sibling, a preempted job).
    arrival_seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens (prompt + output) whose KV is in the device cache.
    num_computed_tokens: int = 0
    # Device block ids in logical order; index i holds tokens
    # [i*block_size, (i+1)*block_size).
    block_table: list[int] = field(default_factory=list)
    # A copy of `block_table` that plans hand the engine, made once per
    # change instead of once per chunk (most decodes keep their table):
    # `BlockManager` drops it whenever it changes the table.  Never
    # changed in place.
    table_copy: list[int] | None = field(default=None, repr=False)
    block_locations: list[BlockLocation] = field(default_factory=list)
    # Blocks of this job's KV held in the host tier only (FastServe §4.2
    # swap, or a preemption back to its checkpoint): fetched before it runs.
    num_host_blocks: int = 0
    # Leading blocks with a host copy taken while they stayed on the device
    # (ConServe §4.4, incremental checkpointing); kept until the job ends.
    num_checkpointed_blocks: int = 0
    # A swap in flight: "swap_out" or "swap_in" until the engine reports it
    # done; the job is not runnable meanwhile.
    swap_pending: str | None = None
    swap_in_issued_at: float | None = None
    # Seconds this job waited for its KV to come back from the host tier.
    swap_wait_time: float = 0.0
    # Seconds of iteration time this job has been part of (MLFQ, §4.1).
    attained_service: float = 0.0
    num_preemptions: int = 0
    # vLLM's `cache_salt`: the prefix cache shares blocks only between jobs
    # of the same salt (None is a salt of its own).
    cache_salt: str | None = None
    # Prompt tokens whose KV it found in the prefix cache before it first
    # ran (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # Whether it may adopt cached KV at all (not when it needs the logits
    # of every prompt position), and the prefix cache's version when a
    # lookup last found nothing for it: until something new is indexed, a
    # lookup again would find nothing again (`BlockManager.reclaim_cached`).
    adopts_cached_kv: bool = True
    prefix_missed_at: int = -1
    # Its full blocks' tokens as the prefix cache first read them (final,
    # none in flight), packed (`PrefixCache.index`): a job swapped back in,
    # its parked blocks evicted meanwhile, is indexed again without reading
    # and hashing its tokens anew.
    block_tokens: list[bytes | tuple[int, ...]] = field(default_factory=list, repr=False)
    # Speculative decoding (scheduler/speculation.py): whether drafts may be
    # proposed for it (not with logprobs or a grammar), their lookup index,
    # and the drafts proposed and accepted so far.
    speculate: bool = False
    drafts: object | None = field(default=None, repr=False)
    num_drafted: int = 0
    num_accepted: int = 0
    # Recent drafts accepted and runs ended by a refusal, decayed
    # (`speculation.observe`): its acceptance rate, for the draft length;
    # a new job's is 4 in 5.
    draft_hits: float = 4.0
    draft_misses: float = 1.0
    # OpenAI's Predicted Outputs: the text the answer is expected to repeat,
    # looked up first for drafts; whether the latest drafts came from it,
    # and how many of its tokens were proposed and accepted.
    prediction: list[int] | None = field(default=None, repr=False)
    predicted_drafts: bool = False
    num_prediction_drafted: int = 0
    num_prediction_accepted: int = 0
    first_scheduled_time: float | None = None
    # When its response-length prediction landed (None: on arrival, or never).
    prediction_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: prompt plus everything sampled."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.state in (JobState.FINISHED, JobState.ABORTED)

    @property
    def is_resident(self) -> bool:
        """Its computed KV is all in device memory and no copy is in flight."""
        return self.num_host_blocks == 0 and self.swap_pending is None

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def transition(self, new: JobState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise InvalidTransition(
                f"job {self.job_id}: {self.state.value} -> {new.value} is not allowed"
            )
        self.state = new
