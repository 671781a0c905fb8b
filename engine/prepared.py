"""One plan flattened into one forward batch (`ModelRunner._prepare`): what
the pass reads, which rows it samples or owes prompt logprobs for, and the
rows whose token the pass in flight samples (scheduler/ahead.py).  The
shards of a split model get its tensor-free part (engine/shards.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.attention import SeqSpan
from engine.lora import Adapter
from engine.request import RequestState
from engine.step_logprobs import PromptRows
from scheduler.plan import ScheduledChunk


@dataclass(slots=True)
class PreparedStep:
    input_ids: list[int]
    positions: list[int]
    spans: list[SeqSpan]
    # Logits rows: the sampled chunks' last tokens, then the rows verifying
    # drafts (`verify`), then owed prompt positions.
    logits_indices: list[int]
    sampled: list[tuple[ScheduledChunk, RequestState]]
    prompt_rows: list[PromptRows]
    # Rows of `input_ids` whose token the pass in flight samples
    # (`PENDING_TOKEN`), and that pass's rows they come from.
    fill_rows: list[int]
    fill_from: list[int]
    # id(adapter) -> the LoRA adapter and the rows of its requests' tokens.
    lora_rows: dict[int, tuple[Adapter, list[int]]] = field(default_factory=dict)
    # Speculative decoding (engine/speculative.py): index in `sampled` of a
    # chunk with drafts -> where its verifying rows start among the rows
    # after the sampled ones; and how many such rows there are.
    verify: dict[int, int] = field(default_factory=dict)
    num_verify: int = 0
