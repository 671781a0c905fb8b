"""Accuracy and provisioning metrics of RL predictions, and the two baselines.

- MAE, and Acc-k: the share of predictions within k tokens of the true RL
  (Acc-50 / Acc-100 as in the RL-prediction work EconoServe builds on, [23]).
- Padding (EconoServe §2.3, Figures 4c and 5a): the KV allocation is the
  prediction plus a padding ratio, ceil(pred * (1 + r)).  A request is
  under-provisioned when its true RL exceeds the allocation (it then needs
  the reserved KV or an offload-free preemption, §3.3.2).  Over- and
  under-provisioning are also given, like Figure 5a, as a percentage of the
  allocated space per request, averaged over requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from scheduler.job import padded_length

PADDING_RATIOS: tuple[float, ...] = (0.0, 0.10, 0.15, 0.20)
# Prompt-length buckets for the per-bucket-median baseline (tokens).
PROMPT_BUCKETS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)


# KV tokens allocated for a predicted RL with a padding ratio: the
# scheduler's own rule, so that the scores describe what the server does.
allocation = padded_length


class PaddingRow(BaseModel):
    ratio: float
    under_share: float  # share of requests whose true RL exceeds the allocation
    covered_share: float  # 1 - under_share (EconoServe's "prediction accuracy" at a padding)
    mean_over_tokens: float  # mean over requests of max(alloc - RL, 0)
    over_pct_of_alloc: float  # Fig. 5a: mean of max(alloc - RL, 0) / alloc, in %
    under_pct_of_alloc: float  # Fig. 5a: mean of max(RL - alloc, 0) / alloc, in %


class Metrics(BaseModel):
    n: int
    mae: float
    acc50: float
    acc100: float
    mean_pred: float
    mean_true: float
    padding: list[PaddingRow]


def mae(pred: Sequence[float], true: Sequence[int]) -> float:
    return sum(abs(round(p) - t) for p, t in zip(pred, true)) / max(1, len(true))


def acc_within(pred: Sequence[float], true: Sequence[int], k: int) -> float:
    return sum(abs(round(p) - t) <= k for p, t in zip(pred, true)) / max(1, len(true))


def padding_row(pred: Sequence[float], true: Sequence[int], ratio: float) -> PaddingRow:
    n = max(1, len(true))
    allocs = [allocation(p, ratio) for p in pred]
    under = sum(t > a for a, t in zip(allocs, true)) / n
    return PaddingRow(
        ratio=ratio,
        under_share=under,
        covered_share=1.0 - under,
        mean_over_tokens=sum(max(a - t, 0) for a, t in zip(allocs, true)) / n,
        over_pct_of_alloc=100.0 * sum(max(a - t, 0) / a for a, t in zip(allocs, true)) / n,
        under_pct_of_alloc=100.0 * sum(max(t - a, 0) / a for a, t in zip(allocs, true)) / n,
    )


def evaluate_predictions(
    pred: Sequence[float], true: Sequence[int], ratios: Sequence[float] = PADDING_RATIOS
) -> Metrics:
    if len(pred) != len(true):
        raise ValueError("pred and true differ in length")
    n = len(true)
    return Metrics(
        n=n,
        mae=mae(pred, true),
        acc50=acc_within(pred, true, 50),
        acc100=acc_within(pred, true, 100),
        mean_pred=sum(round(p) for p in pred) / max(1, n),
        mean_true=sum(true) / max(1, n),
        padding=[padding_row(pred, true, r) for r in ratios],
    )


def _median(xs: Sequence[int]) -> float:
    s = sorted(xs)
    if not s:
        raise ValueError("median of nothing")
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (s[m - 1] + s[m]) / 2.0


class MedianBaseline:
    """Predicts the training-set median RL for every prompt (MAE-optimal constant)."""

    def __init__(self, train_lengths: Sequence[int]) -> None:
        self.value = _median(train_lengths)

    def predict(self, prompt_tokens: Sequence[int]) -> list[float]:
        return [self.value] * len(prompt_tokens)


class BucketMedianBaseline:
    """Median training RL per prompt-length bucket (falls back to the global median)."""

    def __init__(
        self,
        train_prompt_tokens: Sequence[int],
        train_lengths: Sequence[int],
        edges: Sequence[int] = PROMPT_BUCKETS,
    ) -> None:
        self.edges = list(edges)
        fallback = _median(train_lengths)
        groups: dict[int, list[int]] = {}
        for pt, rl in zip(train_prompt_tokens, train_lengths):
            groups.setdefault(self.bucket(pt), []).append(rl)
        self.medians = {
            b: (_median(groups[b]) if b in groups else fallback) for b in range(len(self.edges) + 1)
        }

    def bucket(self, prompt_tokens: int) -> int:
        for i, e in enumerate(self.edges):
            if prompt_tokens < e:
                return i
        return len(self.edges)

    def predict(self, prompt_tokens: Sequence[int]) -> list[float]:
        return [self.medians[self.bucket(pt)] for pt in prompt_tokens]
