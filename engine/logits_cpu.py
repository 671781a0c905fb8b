"""The greedy argmax of a step's logits on CPU, by the C++ operator of
`engine/csrc/logits.cpp` where it is loaded.

ATen's argmax reads a float32 row at about 2 GB/s on one core: 2.8 ms of a
~105 ms SmolLM2 decode step at batch 96 on an AVX512 EPYC, against 0.6 ms
for the operator.  It is built with the paged decode operator
(`engine.attention_cpp`), which the CPU's default attention backend loads
at the engine's start; anywhere else (CUDA, another backend, no compiler)
this is ATen's own call.  Both give the same index: the first of the
row's largest value, NaN counting as largest.  The operator also reads a
bfloat16 model's logits as they are (ATen's bfloat16 argmax is slower
still than its float32 one), the same index as argmax of their float32 copy.

A bfloat16 lm_head rounds its float32 sums to 8 significant bits: at
SmolLM2's logit magnitudes (8-32) neighbours 1/16-1/8 apart, so the two
likeliest tokens of a step often come out equal, and the first index then
wins whatever the model computed.  With `exact` (the rows' hidden states and
the head's weight) a tie at the top is broken by the exact logits: the
dot products, in float32, that the lm_head rounded.  Rounding keeps order,
so that is the argmax of the unrounded logits.
"""

from __future__ import annotations

import torch

from engine import attention_cpp

_DTYPES = (torch.float32, torch.bfloat16)

# The rows' hidden states `[rows, dim]` and the lm_head's weight `[vocab, dim]`.
ExactSource = tuple[torch.Tensor, torch.Tensor]


def argmax_rows(logits: torch.Tensor, exact: ExactSource | None = None) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of `[rows, vocab]` logits; with `exact`, a
    tie of a row's largest value goes to the token whose exact logit is
    largest (ties of those to the lowest index)."""
    cpp = (logits.device.type == "cpu" and logits.dtype in _DTYPES and logits.dim() == 2
           and logits.shape[1] > 0 and attention_cpp.loaded())
    if exact is not None and exact[1].dtype in _DTYPES and exact[0].dtype == exact[1].dtype:
        hidden, weight = exact
        if cpp:  # built with argmax_rows, in one library
            return torch.ops.preempt_serve.argmax_rows_exact(logits, hidden, weight)
        return _argmax_exact(logits, hidden, weight)
    if cpp:
        return torch.ops.preempt_serve.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _argmax_exact(logits: torch.Tensor, hidden: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
    """`argmax_rows` with `exact`, in ATen (no C++ operator)."""
    best = logits.argmax(dim=-1)
    top = logits.gather(1, best.unsqueeze(1))
    tied = ((logits == top).sum(dim=1) > 1).nonzero().flatten().tolist()
    for r in tied:
        ids = (logits[r] == top[r]).nonzero().flatten()
        values = weight[ids].float() @ hidden[r].float()
        # The first of the largest exact values: the lowest such index.
        best[r] = ids[int(values.argmax())]
    return best
