"""Arrival processes: Poisson at a rate, Gamma with a coefficient of variation.

FastServe §6.1 (following vLLM) draws arrival times from a Poisson process
parameterized by the arrival rate.  Burstier traffic uses Gamma-distributed
inter-arrival times with the same mean 1/rate and a coefficient of variation
`cv` (shape k = 1/cv², scale = 1/(rate·k)); cv = 1 is Poisson, cv > 1 is
burstier, cv < 1 smoother.  vLLM's `--burstiness b` is the shape, so
cv = 1/sqrt(b).  A rate of infinity sends everything at t = 0 (an offline
batch, or the saturation run that measures capacity).

Everything is drawn from a `numpy.random.Generator`, so a seed fixes the
arrival times exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ArrivalSpec(BaseModel):
    # An infinite rate is written as JSON's non-standard `Infinity` (which
    # Python's json and pydantic read back), not as null.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    process: Literal["poisson", "gamma"] = "poisson"
    # Requests per second; math.inf means all at `start`.
    rate: float = Field(1.0, gt=0)
    # Coefficient of variation of the inter-arrival time (gamma only).
    cv: float = Field(1.0, gt=0)
    start: float = Field(0.0, ge=0)

    @field_validator("rate", mode="before")
    @classmethod
    def _null_is_all_at_once(cls, v: object) -> object:
        # Results written before the rate kept its infinity hold null there.
        return math.inf if v is None else v

    @model_validator(mode="after")
    def _poisson_cv(self) -> "ArrivalSpec":
        if self.process == "poisson" and self.cv != 1.0:
            raise ValueError("a Poisson process has cv = 1; use process='gamma'")
        return self


def inter_arrival_times(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` independent inter-arrival gaps with mean 1/rate."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(spec.rate):
        return np.zeros(n)
    if spec.process == "poisson":
        return rng.exponential(1.0 / spec.rate, size=n)
    shape = 1.0 / (spec.cv**2)
    return rng.gamma(shape, 1.0 / (spec.rate * shape), size=n)


def arrival_times(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Absolute arrival times of `n` requests, non-decreasing.

    The first request arrives at `start` and each later one one gap after
    its predecessor (as vLLM's benchmark sends its first request at once).
    """
    gaps = inter_arrival_times(spec, n, rng)
    if n == 0:
        return gaps
    times = np.empty(n)
    times[0] = 0.0
    np.cumsum(gaps[1:], out=times[1:])
    return spec.start + times
