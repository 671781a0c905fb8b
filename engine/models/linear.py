"""The matmul behind every projection, chosen once per model for its dtype and device.

On CPUs without native bf16/fp16 matmul support (no AVX512-BF16/AMX and no
oneDNN low-precision path, e.g. AVX2-only x86), ATen falls back to a scalar
reference kernel whose cost grows ~linearly with the rows of the input:
about 6× slower than float32 at 32 rows and 8× at 512.  There we convert the
weight to float32 on the fly and multiply in float32.  The products of two
bf16 (or fp16) numbers are exact in float32 and the reference kernel already
accumulates in float32, so the result differs from the native path only by
summation order; the output is rounded back to the model dtype.  A single
row (decode at batch 1) stays native: converting the weight would cost more
than the matrix-vector product saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# (input, weight, bias=None) -> output, as F.linear.
LinearFn = Callable[..., torch.Tensor]

# Fewer input rows than this: the native kernel is faster than converting.
_MIN_ROWS = 2
# Big weights (the lm_head) are converted in slices of this many output
# rows: each float32 slice stays small enough to come from the allocator's
# heap instead of fresh (page-faulting) memory on every call; the
# conversion is then only worth it from this many input rows on.
SLICE_ROWS = 4096
_MIN_ROWS_SLICED = 8


def native_low_precision_cpu(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` (bf16 / fp16) natively on this CPU."""
    try:
        if dtype is torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype is torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        pass
    return False


def upcast_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    rows, out_features = x.shape[0], w.shape[0]
    if rows < _MIN_ROWS:
        return F.linear(x, w, b)
    xf = x.float()
    if out_features <= SLICE_ROWS:
        bf = None if b is None else b.float()
        return F.linear(xf, w.float(), bf).to(x.dtype)
    if rows < _MIN_ROWS_SLICED:
        return F.linear(x, w, b)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    for start, end, wf, bf in float32_slices(w, b):
        out[:, start:end] = F.linear(xf, wf, bf)
    return out


def float32_slices(
    w: torch.Tensor, b: torch.Tensor | None
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """`(start, end, weight rows, bias)` in float32, SLICE_ROWS output rows
    at a time."""
    for start in range(0, w.shape[0], SLICE_ROWS):
        end = min(start + SLICE_ROWS, w.shape[0])
        yield start, end, w[start:end].float(), None if b is None else b[start:end].float()


def linear_for(dtype: torch.dtype, device: torch.device) -> LinearFn:
    """`F.linear`, or the float32-compute path where low precision is emulated."""
    if (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and not native_low_precision_cpu(dtype)
    ):
        return upcast_linear
    return F.linear
