"""A running job's remaining output length, refined as it decodes.

The predictor estimates a response's length once, from the prompt, when
the request arrives (EconoServe §2.3).  While the job decodes, the engine
learns one thing for free: the answer is longer than the tokens generated
so far.  Conditioning the predictor's own error distribution on that gives
a sharper estimate of what is left than the arrival-time prediction, which
has nothing to say once a job outruns it (42 % of the ShareGPT test split
outrun a prediction padded by 15 %):

    remaining(p, g) = q-quantile of { r·p - g : r·p > g }

over the ratios r = true length / prediction of the jobs that finished on
this replica by themselves (an end-of-sequence token or a stop string;
jobs cut by `max_tokens` do not show their length).  It needs no model
call, and it learns the predictor's errors on what this server serves
rather than on the training set.  The model's hidden state at the job's
last position does not sharpen it on the embedded model
(`studies/predictor/README.md`, "Does the hidden state sharpen the
remaining length?").
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque


class RemainingLength:
    def __init__(self, quantile: float = 0.5, min_samples: int = 50,
                 min_tail: int = 10, window: int = 4096) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.min_tail = min_tail
        self._ratios: list[float] = []  # sorted
        self._order: deque[float] = deque()  # arrival order, for the window
        self._window = window

    def __len__(self) -> int:
        return len(self._ratios)

    def observe(self, predicted: int, actual: int) -> None:
        """A job predicted `predicted` tokens ended by itself at `actual`."""
        if predicted <= 0 or actual <= 0:
            return
        r = actual / predicted
        insort(self._ratios, r)
        self._order.append(r)
        if len(self._order) > self._window:
            old = self._order.popleft()
            del self._ratios[bisect_right(self._ratios, old) - 1]

    def remaining(self, predicted: int, generated: int) -> int | None:
        """Output tokens a job predicted at `predicted` is expected to still
        generate after `generated` (at least 1); None while too few finished
        jobs were seen, or too few of them ran this far past their
        prediction, to say."""
        if len(self._ratios) < self.min_samples or predicted <= 0:
            return None
        k = bisect_right(self._ratios, generated / predicted)
        tail = len(self._ratios) - k
        if tail < self.min_tail:
            return None
        r = self._ratios[k + min(tail - 1, int(self.quantile * tail))]
        return max(1, math.ceil(r * predicted - generated))
