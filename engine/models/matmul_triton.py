"""A GEMM whose every row rounds the same whatever else is in the batch (CUDA).

cuBLAS picks its kernel, tile and split-K from each call's shape, so a
token's projections round differently at batch 1 than at batch 300, and in
an ordinary engine its greedy continuation depends on what shares its steps
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; the
batch-invariant modes of vLLM and SGLang replace the GEMM the same way).
`invariant_linear` is `F.linear` as one Triton kernel with a single tile
configuration for every shape: each output element is the dot product of its
row with a weight column, accumulated over K in BLOCK_K slices in one fixed
order by the same instructions.  A weight with few column tiles is also
split over K (as cuBLAS does for decode shapes): otherwise a decode step
launches too few programs to keep every multiprocessor reading the weight
(on an H200, 1.32-1.36x cuBLAS's time at 1-32 rows unsplit, 1.04-1.05x
split).  The split is chosen from the weight's shape alone (`splits`), each
split accumulates whole BLOCK_K slices into float32, and a second kernel
adds the splits in index order, so the rounding of every element still
depends on N and K only.  Nothing about a row's result depends on M, on the
row's place in its tile or on the other rows' values.  (A batch of many rows
may take a larger row and column tile, `InvariantLinear`, only on a weight
for which the device was seen to round it exactly alike.) The price is a
configuration that is not tuned per shape: a decode step's few rows ride in
a mostly empty tile (the step is bound by reading the weights, so that costs
little), and a long prefill gets tiles that no autotuner chose and writes
the splits' partial sums (`studies/engine_gpu/invariant_matmul.py` measures
both, and chose the configuration below).

The CPU counterpart is `engine.models.batch_invariant.TiledLinear`, built
on the CPU library's own GEMM.  On CPU tensors this kernel runs only under
Triton's interpreter, for the test suite.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

log = logging.getLogger(__name__)



class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    # Split K until one row tile's launch has at least this many programs
    # (0: never split); see `splits`.
    split_to: int = 0


# At most this many splits, each at least MIN_SLICES BLOCK_K slices long.
MAX_SPLITS = 8
MIN_SLICES = 4


# The one tile configuration.  Changing it changes the rounding of every
# token: never make it depend on the number of rows (the weight's shape
# alone picks the split, `splits`).  split_to 256, about two programs per
# multiprocessor of an H100 or H200, was the fastest of 0-1,024 there at
# 1-32 rows (studies/engine_gpu/README.md, "split over K").
CONFIG = TileConfig(block_m=64, block_n=64, block_k=128, warps=4, stages=3, split_to=256)
# A batch of LARGE_ROWS rows or more (a long prompt's chunk) takes a larger
# tile where it rounds exactly as CONFIG does: the same BLOCK_K slices and
# the same splits of K, only the rows and columns one program covers differ.
# On an H200 (Triton 3.6) every projection of a Llama-3-8B layer and its
# lm_head came out bit for bit the same with it in bfloat16, 1.45x faster at
# 2,048 rows, and so did smaller tiles of it in float32, where it does not
# fit the shared memory (studies/engine_gpu/tile_rounding.py).  No
# specification promises that, so `InvariantLinear` checks it on the model's
# own weights before it uses it.  The row threshold is a guess: the tile was
# timed at 2,048 rows only.
LARGE = TileConfig(block_m=128, block_n=128, block_k=CONFIG.block_k, warps=8, stages=3)
LARGE_ROWS = 512

# M tiles per group in the launch order, so that a group's programs share
# the weight tiles they read through L2 (launch order only: no effect on
# any result).
GROUP_M = 8


def splits(n: int, k: int, config: TileConfig = CONFIG) -> tuple[int, int]:
    """(number of splits over K, BLOCK_K slices per split) for a weight
    `[n, k]`: a function of the weight's shape and the configuration alone,
    never of M, so that every row rounds the same at any batch."""
    slices = triton.cdiv(k, config.block_k)
    count = 1
    if config.split_to:
        count = config.split_to // triton.cdiv(n, config.block_n)
        count = max(1, min(count, MAX_SPLITS, slices // MIN_SLICES))
    per_split = triton.cdiv(slices, count)
    return triton.cdiv(slices, per_split), per_split


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, SLICES_PER_SPLIT,
    stride_am, stride_wn, stride_cm, stride_cs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One (row tile, column tile) of the product over split `program_id(1)`
    of K; with one split the finished tile (bias added, cast), else its
    float32 partial sum into plane `program_id(1)` of c (stride_cs apart)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
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
    k_first = split * SLICES_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(K, k_first + SLICES_PER_SPLIT * BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + rows.to(tl.int64)[:, None] * stride_am + k_first + ks[None, :]
    # The weight is [N, K] row-major: its tile is read as [BLOCK_K, BLOCK_N].
    w = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + k_first + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        k_mask = ks < k_end - k0
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
    c = c_ptr + split.to(tl.int64) * stride_cs
    c += rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _sum_splits(
    part_ptr, bias_ptr, c_ptr, total, N, SPLITS, stride_ps,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """c = ((part[0] + part[1]) + part[2]) + ... (+ bias): the splits in
    index order, the same for every element whatever M."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    part = part_ptr + offs
    acc = tl.load(part, mask=mask, other=0.0)
    for _ in range(1, SPLITS):
        part += stride_ps
        acc += tl.load(part, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


SUM_BLOCK = 1024


def invariant_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
    config: TileConfig = CONFIG, split: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, b)` for x `[M, K]`, w `[N, K]`, in the fixed tile
    configuration: row i of the result depends on row i of x alone.
    (`config`, and `split` in place of `splits(n, k, config)`, are for the
    studies that chose CONFIG and compare tile shapes, never per call.)"""
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
    count, per_split = splits(n, k, config) if split is None else split
    # With several splits the partial sums go to float32 planes first.
    dest = out if count == 1 else torch.empty(count, m, n, dtype=torch.float32,
                                              device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), count)
    _invariant_matmul[grid](
        x, w, x if b is None else b, dest, m, n, k, per_split,
        x.stride(0), w.stride(0), n, m * n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=GROUP_M, HAS_BIAS=b is not None and count == 1,
        # float32 in full precision (Triton's default for it is tf32).
        PRECISION="ieee" if x.dtype is torch.float32 else None,
        # The interpreter's dot multiplies bf16/fp16 bit patterns as integers.
        DOT_F32=x.device.type == "cpu",
        num_warps=config.warps, num_stages=config.stages,
    )
    if count > 1:
        _sum_splits[(triton.cdiv(m * n, SUM_BLOCK),)](
            dest, x if b is None else b, out, m * n, n, count, m * n,
            BLOCK=SUM_BLOCK, HAS_BIAS=b is not None,
        )
    return out


def rounds_like_config(w: torch.Tensor, large: TileConfig = LARGE,
                       rows: int = LARGE_ROWS) -> bool:
    """Whether `large`, with CONFIG's split of K, multiplies a random
    `[rows, K]` batch by `w` bit for bit as CONFIG does."""
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(rows, w.shape[1], generator=gen, device=w.device).to(w.dtype)
    try:
        got = invariant_linear(x, w, config=large, split=splits(w.shape[0], w.shape[1]))
    except OutOfResources:  # e.g. float32 tiles too large for the shared memory
        return False
    return torch.equal(got, invariant_linear(x, w))


class InvariantLinear:
    """`invariant_linear`, but with LARGE for batches of `large_rows` rows or
    more by a weight whose shape and dtype passed `rounds_like_config` when
    this was built (`weights`: the model's own), so that a row rounds the
    same at any batch with either tile."""

    def __init__(self, weights: Iterable[torch.Tensor], large: TileConfig = LARGE,
                 large_rows: int = LARGE_ROWS) -> None:
        if large.block_k != CONFIG.block_k:
            raise ValueError("a larger tile must keep CONFIG's block_k (its slices of K)")
        self.large, self.large_rows = large, large_rows
        self.checked: dict[tuple[int, int, torch.dtype], bool] = {}
        for w in weights:
            key = (w.shape[0], w.shape[1], w.dtype)
            if key not in self.checked:
                self.checked[key] = rounds_like_config(w, large, large_rows)
        if self.checked:
            log.info("deterministic GEMM: %d of %d weight shapes take the %dx%d tile from %d "
                     "rows (it rounds them as the %dx%d tile does)", sum(self.checked.values()),
                     len(self.checked), large.block_m, large.block_n, large_rows,
                     CONFIG.block_m, CONFIG.block_n)

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] >= self.large_rows and self.checked.get((w.shape[0], w.shape[1], w.dtype)):
            return invariant_linear(x, w, b, config=self.large,
                                    split=splits(w.shape[0], w.shape[1]))
        return invariant_linear(x, w, b)
