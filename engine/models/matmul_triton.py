"""A GEMM whose every row rounds the same whatever else is in the batch (CUDA).

cuBLAS picks its kernel, tile and split-K from each call's shape, so a
token's projections round differently at batch 1 than at batch 300, and in
an ordinary engine its greedy continuation depends on what shares its steps
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; the
batch-invariant modes of vLLM and SGLang replace the GEMM the same way).
`invariant_linear` is `F.linear` as one Triton kernel with a single tile
configuration for every shape: each output element is the dot product of
its row with a weight column, accumulated over K in BLOCK_K slices in one
fixed order by the same instructions, and never split over K.  Nothing about
a row's result depends on M, on the row's place in its tile or on the other
rows' values.  The price is a configuration that is not tuned per shape: a
decode step's few rows ride in a mostly empty tile (the step is bound by
reading the weights, so that costs little), and a long prefill gets tiles
that no autotuner chose (`studies/engine_gpu/invariant_matmul.py` measures
both, and chose the tile below).

The CPU counterpart is `engine.models.batch_invariant.TiledLinear`, built
on the CPU library's own GEMM.  On CPU tensors this kernel runs only under
Triton's interpreter, for the test suite.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl



class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# The one tile configuration.  Changing it changes the rounding of every
# token: never make it depend on the call's shape.
CONFIG = TileConfig(block_m=64, block_n=64, block_k=128, warps=4, stages=3)
# M tiles per group in the launch order, so that a group's programs share
# the weight tiles they read through L2 (launch order only: no effect on
# any result).
GROUP_M = 8


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_wn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    # The weight is [N, K] row-major: its tile is read as [BLOCK_K, BLOCK_N].
    w = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(a, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        y = tl.load(w, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, y, acc, input_precision=PRECISION)
        a += BLOCK_K
        w += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def invariant_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
    config: TileConfig = CONFIG,
) -> torch.Tensor:
    """`F.linear(x, w, b)` for x `[M, K]`, w `[N, K]`, in the fixed tile
    configuration: row i of the result depends on row i of x alone.
    (`config` is for the study that chose CONFIG, never per call.)"""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"invariant_linear needs x [M, K] and w [N, K], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _invariant_matmul[grid](
        x, w, x if b is None else b, out, m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=GROUP_M, HAS_BIAS=b is not None,
        # float32 in full precision (Triton's default for it is tf32).
        PRECISION="ieee" if x.dtype is torch.float32 else None,
        # The interpreter's dot multiplies bf16/fp16 bit patterns as integers.
        DOT_F32=x.device.type == "cpu",
        num_warps=config.warps, num_stages=config.stages,
    )
    return out
