"""The serving loop's host path alone: the model's pass and sampling taken out.

On a GPU whose step is short (a 1B shape decodes 128 rows in 1.3–1.5 ms from a graph),
the replica's loop is bound by its host work: planning, staging, completion, swaps' books,
text decoding and delivery.  That work is Python and runs the same on any CPU, so it can
be measured, and changed, without a GPU: `strip_pass` leaves a `ModelRunner` doing
everything but the pass and the sampling, whose places take a constant and random ids.
What the study then reports as `loop_s` is the host path of the plans the policy makes
(staging the inputs, block copies for swaps and the tier's books included; on a CPU those
copies are real, on a GPU they are queued on a side stream).  A policy whose choices follow
measured time (the MLFQ) makes other plans than with a model, whose iterations last longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.runner import ModelRunner

# Sampled ids start past the tokenizer's special tokens, so that every one decodes to text.
_FIRST_ID = 256


def strip_pass(runner: ModelRunner, seed: int = 0) -> None:
    """From now on `runner` computes nothing: a pass that wants logits gets a column of
    zeros, and sampling draws ids uniformly from the vocabulary (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size

    def logits(plan: Any, prepared: Any, pending: Any = None) -> torch.Tensor | None:
        n = len(prepared.logits_indices)
        return torch.zeros(n, 1) if n else None

    def sample(logits: torch.Tensor, requests: Sequence[Any], exact: Any = None) -> torch.Tensor:
        return torch.randint(_FIRST_ID, vocab, (len(requests),), generator=gen)

    # Instance attributes: the runner's own calls find them before its class's methods.
    runner._logits = logits  # type: ignore[method-assign]
    runner.sampler.sample_tensor = sample  # type: ignore[method-assign]
