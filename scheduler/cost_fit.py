"""An iteration cost estimate that follows the replica's own iterations.

The co-serving budget (ConServe §4.5) admits offline tokens into an
iteration while the estimate of the whole batch stays within the online
TPOT objective, so the budget is only as good as the estimate.  The
start-up fit (engine/profiler.py) times a few iterations of an idle replica
at short contexts; served batches differ from those in three ways that it
cannot see: attention over long contexts (a quarter of a decode step at
256-token contexts on a CPU), batches beyond the sizes it timed, and a
shared host that runs every iteration slower than it did at start-up.
With the start-up fit alone, co-serving on a CPU overshot a 0.3 s TPOT
objective at 0.52 s (studies/conserve_live/README.md).

`LiveCost` keeps the start-up fit as a prior and fits, by ridge-regularised
least squares with exponential forgetting, the iteration times the replica
measures against the shape of each batch:

    t = c0 + c1·[any prefill] + c2·prefill tokens + c3·(query, key) pairs
          + c4·decodes + c5·decode context tokens

`batch_time` answers from that fit.  `prefill_time` and `decode_time` stay
the start-up fit's: MLFQ's quanta and skip-join levels (FastServe §4.1) and
admission's estimate are fixed for the replica's life, and a fit that moved
them would move jobs between queues for no change in the jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from scheduler.cost import LinearCost

_N = 6  # coefficients
COEFFICIENTS = ("fixed_s", "any_prefill_s", "per_prefill_token_s", "per_attention_pair_s",
                "per_decode_s", "per_decode_context_token_s")


@dataclass(frozen=True, slots=True)
class IterationShape:
    """What the cost estimate needs of a batch (`CostEstimator.batch_time`)."""

    decodes: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_attn: int = 0

    def plus(self, start: int, n: int) -> "IterationShape":
        """With a chunk of `n` tokens at position `start` added."""
        if n == 1:
            return IterationShape(self.decodes + 1, self.decode_context + start + 1,
                                  self.prefill_tokens, self.prefill_attn)
        return IterationShape(self.decodes, self.decode_context, self.prefill_tokens + n,
                              self.prefill_attn + n * start + n * (n + 1) // 2)

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> "IterationShape":
        """The shape of a batch of (start position, tokens) chunks."""
        shape = cls()
        for start, n in chunks:
            shape = shape.plus(start, n)
        return shape

    def features(self) -> tuple[float, ...]:
        return (1.0, 1.0 if self.prefill_tokens else 0.0, float(self.prefill_tokens),
                float(self.prefill_attn), float(self.decodes), float(self.decode_context))


def typical_batch(max_batch_size: int, max_batch_tokens: int,
                  max_model_len: int) -> IterationShape:
    """A full batch of a replica with these limits: its decodes at half the
    longest context, or one prefill chunk halfway into the longest prompt."""
    half = max_model_len // 2
    chunk = min(max_batch_tokens, half)
    return IterationShape(decodes=max_batch_size, decode_context=max_batch_size * half,
                          prefill_tokens=chunk, prefill_attn=chunk * half + chunk * (chunk + 1) // 2)


def _prior(cost: LinearCost) -> tuple[float, ...]:
    decode_base = cost.base_s if cost.decode_base_s is None else cost.decode_base_s
    return (decode_base, max(0.0, cost.base_s - decode_base), cost.prefill_per_token_s,
            0.0, cost.decode_per_seq_s, 0.0)


def _solve(a: list[list[float]], b: list[float], free: list[int]) -> dict[int, float]:
    """Solve a[free][free] · x = b[free] by Gaussian elimination with partial
    pivoting (a is symmetric positive definite: the ridge term sees to it)."""
    m = [[a[i][j] for j in free] + [b[i]] for i in free]
    n = len(free)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                row, top = m[r], m[col]
                for c in range(col, n + 1):
                    row[c] -= f * top[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))
        x[r] = s / m[r][r]
    return dict(zip(free, x))


class LiveCost:
    """`CostEstimator` whose `batch_time` is fitted to measured iterations.

    `typical`: a full batch of the replica (`typical_batch`).  `memory`:
    iterations after which a sample's weight has fallen to 1/e (the host's
    speed drifts; the fit follows it).  `prior_iterations`: how many
    iterations' worth of evidence the start-up fit counts for, per
    coefficient, at the larger of its feature's RMS in the samples and an
    eighth of its value in `typical`.
    `outlier`: a sample above this multiple of the current estimate is
    clipped to it, so one stall of a shared host does not swing the fit
    (the budget cannot prevent those)."""

    def __init__(self, prior: LinearCost, typical: IterationShape,
                 memory: float = 200.0, prior_iterations: float = 0.25,
                 outlier: float = 2.0) -> None:
        self.prior = prior
        # Each coefficient is weighed at least at an eighth of a full
        # batch's value of its feature: one learnt from small values (a
        # 4-token prompt) must not predict absurd times for large ones (a
        # 512-token chunk), or the budget would shut out the very batches
        # that could correct it.  (A full batch's value itself held the fit
        # too close to the prior where decodes and their context grow
        # together, as they do in served batches.)
        self._typical = tuple(x / 8 for x in typical.features())
        self._theta0 = _prior(prior)
        self._decay = 1.0 - 1.0 / memory
        self._prior_n = prior_iterations
        self._outlier = outlier
        self._a = [[0.0] * _N for _ in range(_N)]
        self._b = [0.0] * _N
        # Decayed Σ x_k² per feature: the scale the prior is weighed at.
        self._sq = [0.0] * _N
        self.samples = 0
        self._theta: tuple[float, ...] = self._theta0

    # The start-up fit (see the module's docstring) -----------------------

    def prefill_time(self, num_tokens: int) -> float:
        return self.prior.prefill_time(num_tokens)

    def decode_time(self, batch_size: int) -> float:
        return self.prior.decode_time(batch_size)

    # The live fit ----------------------------------------------------------

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(fixed, any prefill, per prefill token, per (query, key) pair,
        per decode, per decode context token), in seconds."""
        return self._theta

    def batch_time(self, decodes: int, decode_context: int, prefill_tokens: int,
                   prefill_attn: int) -> float:
        return self.shape_time(IterationShape(decodes, decode_context, prefill_tokens,
                                              prefill_attn))

    def shape_time(self, shape: IterationShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features()))

    def observe(self, shape: IterationShape, seconds: float) -> None:
        """Fold in one iteration of `shape` that took `seconds`."""
        if seconds <= 0:
            return
        x = shape.features()
        if self.samples:
            seconds = min(seconds, self._outlier * max(self.shape_time(shape), 1e-6))
        d = self._decay
        a, b, sq = self._a, self._b, self._sq
        for i in range(_N):
            xi = x[i]
            row = a[i]
            for j in range(_N):
                row[j] = d * row[j] + xi * x[j]
            b[i] = d * b[i] + xi * seconds
            sq[i] = d * sq[i] + xi * xi
        self.samples += 1
        # Solved here, on the thread that observes: readers on other threads
        # (Algorithm 2's cut decision, the replica's stats) see one tuple,
        # swapped whole.
        self._theta = self._fit()

    def _fit(self) -> tuple[float, ...]:
        # In units of each feature's scale (its RMS over the samples, at
        # least the floor above), so that a constant and a count of
        # (query, key) pairs in the hundreds of thousands solve together in
        # float64; there the ridge toward the prior is `prior_iterations` on
        # every coefficient, and an unexcited feature keeps its prior value.
        weight = min(float(self.samples), 1.0 / (1.0 - self._decay))
        s = [max((self._sq[k] / weight) ** 0.5, self._typical[k], 1.0) for k in range(_N)]
        n0 = self._prior_n
        a = [[self._a[i][j] / (s[i] * s[j]) + (n0 if i == j else 0.0) for j in range(_N)]
             for i in range(_N)]
        b = [self._b[i] / s[i] + n0 * self._theta0[i] * s[i] for i in range(_N)]
        # Non-negative: a coefficient solved below zero is pinned at zero and
        # the rest solved again (an active set over six unknowns).
        free = list(range(_N))
        while True:
            sol = _solve(a, b, free)
            negative = [k for k, v in sol.items() if v < 0]
            if not negative:
                break
            free = [k for k in free if k not in negative]
            if not free:
                sol = {}
                break
        return tuple(sol.get(k, 0.0) / s[k] for k in range(_N))
