"""Logprobs a pass owes its requests: those of the tokens it sampled, and
the prompt logprobs of the prompt positions it computed (OpenAI `logprobs`
and vLLM's `prompt_logprobs`), from the pass's logits rows, in float32.  Both
are raw: before penalties, logit bias and temperature."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import RequestState
from engine.sampling import token_logprobs
from scheduler.plan import ScheduledChunk, TokenLogprob


@dataclass(slots=True)
class PromptRows:
    """Logits rows that give `state` the prompt logprobs of tokens q + 1 for
    q in `positions`."""

    state: RequestState
    positions: range


def sampled_logprobs(
    logits: torch.Tensor,
    sampled: list[tuple[ScheduledChunk, RequestState]],
    tokens: list[int],
) -> dict[int, TokenLogprob]:
    """Raw logprobs of the sampled tokens, by row, for the rows that asked."""
    rows = [i for i, (_, s) in enumerate(sampled) if s.params.logprobs is not None]
    if not rows:
        return {}
    found = token_logprobs(
        logits[rows], [tokens[i] for i in rows],
        [sampled[i][1].params.logprobs or 0 for i in rows],
    )
    return dict(zip(rows, found))


def record_prompt_logprobs(logits: torch.Tensor, rows: list[PromptRows]) -> None:
    """Append each request's newly computed prompt logprobs; `logits` holds
    their rows in `rows` order."""
    if not rows:
        return
    targets: list[int] = []
    num_top: list[int] = []
    for r in rows:
        prompt = r.state.prompt_token_ids
        targets.extend(prompt[q + 1] for q in r.positions)
        num_top.extend([r.state.params.prompt_logprobs or 0] * len(r.positions))
    found = token_logprobs(logits, targets, num_top)
    offset = 0
    for r in rows:
        owed = r.state.prompt_logprobs
        assert owed is not None and len(owed) - 1 == r.positions.start
        owed.extend(found[offset : offset + len(r.positions)])
        offset += len(r.positions)
