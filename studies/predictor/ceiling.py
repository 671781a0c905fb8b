"""Same-prompt ceiling: how well a prompt can predict its answer's length at all.

ShareGPT holds some prompts more than once.  Most repeats are re-posts of one
conversation (every copy has the same answer length) and say nothing.  Where
the same prompt got answers of different lengths (regenerations), each
distinct length is predicted by the median of the others.  That predictor
knows more than any model of the prompt can: it has seen this very prompt
answered.  Its Acc-50 / Acc-100 bound what a prompt-only predictor can score
on these answers, and they can be set against the published targets.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel

from predictor.dataset import LengthPair
from predictor.metrics import evaluate_predictions


class CeilingReport(BaseModel):
    min_words: int
    repeated_prompts: int  # prompts of >= min_words words seen more than once
    reposts: int  # of those, prompts whose copies all have one answer length
    groups: int  # prompts with at least two distinct answer lengths
    answers: int  # distinct (prompt, length) pairs scored
    mae: float
    acc50: float
    acc100: float


def same_prompt_ceiling(pairs: Sequence[LengthPair], min_words: int = 5) -> CeilingReport:
    """Leave-one-out median over the distinct answer lengths of each prompt.

    `min_words` leaves out prompts like "hi" or "continue", whose answers
    depend on a conversation the first exchange does not show.
    """
    by_prompt: dict[str, list[int]] = defaultdict(list)
    for p in pairs:
        by_prompt[p.prompt.strip()].append(p.response_len)
    repeated = reposts = groups = 0
    pred: list[float] = []
    true: list[int] = []
    for prompt, lengths in by_prompt.items():
        if len(lengths) < 2 or len(prompt.split()) < min_words:
            continue
        repeated += 1
        distinct = sorted(set(lengths))
        if len(distinct) < 2:
            reposts += 1
            continue
        groups += 1
        for i, y in enumerate(distinct):
            pred.append(float(statistics.median(distinct[:i] + distinct[i + 1 :])))
            true.append(y)
    if not true:
        raise ValueError("no prompt has two distinct answer lengths")
    m = evaluate_predictions(pred, true, ratios=())
    return CeilingReport(
        min_words=min_words, repeated_prompts=repeated, reposts=reposts, groups=groups,
        answers=len(true), mae=m.mae, acc50=m.acc50, acc100=m.acc100,
    )
