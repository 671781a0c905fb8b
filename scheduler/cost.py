"""What a policy may ask about iteration cost (FastServe §4.1: "the
execution time of each iteration is predictable").

Policies see only this protocol.  The engine replica fills it from the
profiler's measurements of its own model; the simulator from its cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field


class CostEstimator(Protocol):
    def prefill_time(self, num_tokens: int) -> float:
        """Seconds of an iteration that prefills `num_tokens` of one job."""
        ...

    def decode_time(self, batch_size: int) -> float:
        """Seconds of an iteration that decodes `batch_size` jobs."""
        ...

    def batch_time(self, decodes: int, decode_context: int, prefill_tokens: int,
                   prefill_attn: int) -> float:
        """Seconds of a mixed iteration: `decodes` one-token chunks over
        `decode_context` context tokens in all, and prefill chunks of
        `prefill_tokens` tokens with `prefill_attn` (query, key) pairs
        (the co-serving budget, ConServe §4.5)."""
        ...


@dataclass(frozen=True)
class LinearCost:
    """t = base + per_token * tokens (prefill); decode_base + per_seq * batch
    (decode; decode_base defaults to base)."""

    base_s: float
    prefill_per_token_s: float
    decode_per_seq_s: float
    # The fixed cost of a decode iteration, when measured apart from the
    # prefill fit's intercept (engine/profiler.py fits both).
    decode_base_s: float | None = None

    def prefill_time(self, num_tokens: int) -> float:
        return self.base_s + self.prefill_per_token_s * num_tokens

    def decode_time(self, batch_size: int) -> float:
        base = self.base_s if self.decode_base_s is None else self.decode_base_s
        return base + self.decode_per_seq_s * batch_size

    def batch_time(self, decodes: int, decode_context: int, prefill_tokens: int,
                   prefill_attn: int) -> float:
        # Measured at short contexts: the context terms are not in the fit.
        if not prefill_tokens:
            return self.decode_time(decodes)
        return (self.base_s + self.decode_per_seq_s * decodes
                + self.prefill_per_token_s * prefill_tokens)


class IterationCostSettings(BaseModel):
    """A replica's iteration cost pinned in its config (`iteration_cost`),
    instead of timed when it starts (engine/profiler.py): the figures a
    replica logs and reports (`Engine.stats`, "engine" → "iteration_cost"),
    so that a replica started again on the same hardware, model, dtype and
    threads (a restart after a death, an autoscaled one) is serving a few
    seconds sooner, and its quanta do not depend on how busy the machine
    was while it started."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_s: float = Field(gt=0)
    prefill_per_token_s: float = Field(ge=0)
    decode_per_seq_s: float = Field(ge=0)
    decode_base_s: float | None = Field(None, gt=0)

    def cost(self) -> LinearCost:
        return LinearCost(**self.model_dump())
