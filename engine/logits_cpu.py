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
"""

from __future__ import annotations

import torch

from engine import attention_cpp

_DTYPES = (torch.float32, torch.bfloat16)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of `[rows, vocab]` logits."""
    if (logits.device.type == "cpu" and logits.dtype in _DTYPES and logits.dim() == 2
            and logits.shape[1] > 0 and attention_cpp.loaded()):
        return torch.ops.preempt_serve.argmax_rows(logits)
    return logits.argmax(dim=-1)
