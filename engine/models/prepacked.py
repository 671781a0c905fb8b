"""`F.linear` on weights prepacked once into oneDNN's blocked layout (CPU).

MKL's sgemm, behind `F.linear` on CPU, is slow where the output is very
wide and the input has few rows: the lm_head of a decode step (SmolLM2:
49,152 × 576, 1 to 128 rows) runs at 23–35 GFLOPS on one AVX2 core, while
oneDNN's matmul on a weight reordered once to its blocked layout runs at
44–60 on the same shapes (`studies/engine_cpu/README.md`).  The reorder is
what vLLM-CPU and Inductor's CPU weight prepacking do too; ATen exposes it
as `mkldnn._reorder_linear_weight` / `mkldnn._linear_pointwise`.

A packed copy is made the first time a weight is used and remade if the
weight tensor is replaced or written in place (its storage or version
changes), so weight loading and later updates stay correct.  The copy
costs the weight's size in memory again, so the models use it for the
lm_head only, where the gain is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row count the reorder is tuned for: the middle of the decode batches served.
_ROWS_HINT = 64


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """float32 on a CPU whose torch build has oneDNN with the packed linear."""
    if device.type != "cpu" or dtype is not torch.float32:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class PrepackedLinear:
    """Callable as `F.linear(x, weight, bias)` for 2-D float32 `x` on CPU."""

    def __init__(self) -> None:
        # id(weight) -> (data_ptr, version, packed)
        self._packed: dict[int, tuple[int, int, torch.Tensor]] = {}

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(w))
        if entry is None or entry[0] != w.data_ptr() or entry[1] != w._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _ROWS_HINT)
            entry = (w.data_ptr(), w._version, packed)
            self._packed[id(w)] = entry
        return entry[2]

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 0:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(w), b, "none", [], "")
