"""Request outcomes per second of a live run (overload and soak plots).

Bins the run's clock into `bin_s`-second slots and counts, per slot and
divided by its length: requests sent, requests completed, refusals (429)
and failures, each at the moment it happened (send time, end time).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.records import RequestRecord


class Timeline(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bin_s: float
    # Start of each bin (s); each list below holds events per second.
    t: list[float] = Field(default_factory=list)
    sent: list[float] = Field(default_factory=list)
    completed: list[float] = Field(default_factory=list)
    rejected: list[float] = Field(default_factory=list)
    failed: list[float] = Field(default_factory=list)


def timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> Timeline:
    sent = [r.send_time for r in records if r.error is None or not r.error.startswith("not sent")]
    done = [r.end_time for r in records if r.ok and r.end_time is not None]
    rej = [r.end_time for r in records if r.rejected and r.end_time is not None]
    # A failure has no end time; it happened at its last sign of life.
    failed = [r.token_times[-1] if r.token_times else r.send_time
              for r in records if r.error is not None and not r.error.startswith("not sent")]
    last = max([*sent, *done, *rej, *failed], default=0.0)
    n = max(int(math.ceil(last / bin_s)), 1)
    edges = np.arange(n + 1) * bin_s

    def per_s(xs: list[float]) -> list[float]:
        counts, _ = np.histogram(np.clip(xs, 0.0, edges[-1]), bins=edges)
        return [float(c) / bin_s for c in counts]

    return Timeline(bin_s=bin_s, t=[float(x) for x in edges[:-1]], sent=per_s(sent),
                    completed=per_s(done), rejected=per_s(rej), failed=per_s(failed))
