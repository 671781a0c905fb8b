"""The scheduler/engine contract: one iteration's `Plan` and its `StepResult`.

The scheduler never touches tensors: each iteration it emits a `Plan` naming,
for every scheduled job, the token range whose KV is to be computed now
(a prefill chunk, a recompute after preemption, or a single decode token),
the job's block table, and whether a token must be sampled at the end of the
range.  KV block operations (swap out / in, checkpoint, prefetch, drop)
ride along in the same plan (`Plan` says when the engine applies them).

These are dataclasses rather than pydantic models: a plan is built and read
once per iteration on the hot path, and pickles as is when it must reach
TP/PP workers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


# The token sampled by a pass still in flight when the next plan was made
# (scheduler/ahead.py): its place in the next decode chunk, which the engine
# fills from that pass's sampled ids on the device.
PENDING_TOKEN = -1


@dataclass(slots=True)
class ScheduledChunk:
    job_id: str
    # Token ids to feed, occupying positions [start_pos, start_pos + len).
    token_ids: list[int]
    start_pos: int
    # Device block ids covering at least start_pos + len(token_ids) tokens.
    block_table: list[int]
    # True when this chunk reaches the last known token, so the engine
    # samples the job's next token from its final position.
    sample: bool
    # Index of the token to be sampled among the job's outputs; seeded
    # sampling derives its random stream from it so that recomputation
    # reproduces the same tokens (preemption transparency).
    output_index: int
    # Speculative decoding (scheduler/speculation.py): the last `draft` of
    # `token_ids` are proposed outputs the engine verifies; a sampling chunk
    # then yields the accepted ones and one token more.
    draft: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.sample and len(self.token_ids) == 1 and self.output_index > 0

    @property
    def num_known_tokens(self) -> int:
        """Its tokens that are not drafts."""
        return len(self.token_ids) - self.draft


class BlockOpKind(str, enum.Enum):
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    # ConServe §4.4: copy a running job's newly filled blocks to the host
    # tier; the device blocks stay in use.
    CHECKPOINT = "checkpoint"
    # Copy a job's checkpointed blocks back into device blocks, keeping the
    # host copy (a SWAP_IN is a move: its host copy is dropped once fetched).
    PREFETCH = "prefetch"
    DROP = "drop"


@dataclass(slots=True)
class BlockOp:
    """One job's blocks of one kind: its logical blocks `first_block`,
    `first_block` + 1, ... held in `device_blocks`, in that order (a DROP
    names none).  One op per job, not per block: a swap moves a job's whole
    table, and a plan that swaps makes one object per job it moves."""

    kind: BlockOpKind
    job_id: str
    first_block: int
    device_blocks: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks)

    @property
    def block_indices(self) -> range:
        """The job's logical blocks it moves."""
        return range(self.first_block, self.first_block + len(self.device_blocks))


@dataclass(slots=True)
class Plan:
    """One iteration.  The engine applies `block_ops` in order before the
    forward pass writes to the cache: SWAP_OUT copies read blocks that the
    scheduler has already freed and may hand to a chunk of this very plan;
    CHECKPOINT copies blocks the job keeps; DROP forgets a job's host copy;
    SWAP_IN and PREFETCH fill freshly allocated blocks and may complete in a
    later iteration."""

    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_ops: list[BlockOp] = field(default_factory=list)
    # Jobs preempted by this plan; the engine drops per-job transient state.
    preempted: list[str] = field(default_factory=list)
    # ConServe §4.3: a pure-offline batch may be cut at a layer boundary.
    preemptible_at_layers: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.block_ops


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one token under the model's raw next-token
    distribution (before penalties, logit bias and temperature), and the
    most likely alternatives at that position."""

    logprob: float
    # (token id, logprob) of the `k` most likely tokens, most likely first;
    # empty when the request asked for 0 alternatives.
    top: list[tuple[int, float]] = field(default_factory=list)
    # 1 + the number of tokens more likely than this one (vLLM's rank).
    rank: int | None = None


@dataclass(slots=True)
class JobOutput:
    job_id: str
    # The token sampled this iteration, or None for a non-final prefill chunk.
    token_id: int | None
    # Set by the engine when a stop condition it owns fired (EOS, stop token,
    # stop string, max_tokens): "stop" or "length".
    finish_reason: str | None = None
    # Detokenized text this token adds to the response (may be empty while
    # a possible stop string or a partial UTF-8 sequence is held back).
    text: str = ""
    # The sampled token's logprob, when the request asked for logprobs.
    logprobs: TokenLogprob | None = None
    # On a request's first sampled token, when it asked for prompt logprobs:
    # one entry per prompt token (None for the first, which has no context).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set instead of `text` where the finish did not depend on the text
    # (no stop strings): called once, in token order for the job, it
    # returns the delta, so that decoding runs off the iteration's thread.
    text_later: Callable[[], str] | None = None
    # On a job's first sampled token, with a length head: its answer length
    # estimated from the prompt's last hidden state (engine/length_head.py).
    predicted_output_len: int | None = None
    # vLLM's `stop_reason`, with a "stop" finish: the stop string or stop
    # token id (not EOS) that ended the request.
    stop_reason: str | int | None = None
    # The chunk's drafts the engine accepted, in order, before `token_id`
    # (scheduler/speculation.py); `text` covers them too.
    accepted: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step: int
    outputs: list[JobOutput]
    # Measured (or, in the simulator, modelled) seconds of the forward pass;
    # for a pass launched while another was in flight (scheduler/ahead.py),
    # from that one's tokens landing to this one's: its share of the device.
    iteration_time: float
    # Jobs whose swap-in copies landed since the last result (all of that
    # job's SWAP_IN or PREFETCH blocks).  A synchronous engine reports the plan's own
    # swap-ins here; an asynchronous one reports them when they land.
    swaps_in_done: list[str] = field(default_factory=list)
    # Jobs whose host copy could not be fetched (host tier full at offload
    # time, or lost): the scheduler falls back to recomputing them.
    swaps_in_failed: list[str] = field(default_factory=list)
    # The forward pass was cut between layers (ConServe §4.3, a plan with
    # `preemptible_at_layers`): no chunk was computed; its block ops were.
    interrupted: bool = False
    # Blocks per second the host tier has been storing (measured by the
    # engine, modelled by the simulator); None until known.  Bounds the
    # checkpoint copies of a plan (ConServe §4.5).
    copy_rate: float | None = None
