"""The batch-invariant Triton GEMM (engine/models/matmul_triton.py): the
product `F.linear` computes, with every row's result independent of M and
of the rows beside it, bit for bit.

Compiled on CUDA where there is one, else under Triton's interpreter (small
shapes there: it runs every program in Python).  The interpreter's dot is
numpy's, whose rounding of a row depends on the row's place in the tile:
there the slices start on tile boundaries (the same row, the same place),
which still checks the masking of short and ragged batches; on CUDA they
start anywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.matmul_triton import CONFIG, invariant_linear

BLOCK_M, BLOCK_K = CONFIG.block_m, CONFIG.block_k

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows_alone_and_together(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool, cuts: list[tuple[int, int]]
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    whole = invariant_linear(x, w, b)
    for start, size in cuts:
        part = invariant_linear(x[start : start + size], w, b)
        assert torch.equal(part, whole[start : start + size]), (start, size)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(whole.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_rows_do_not_depend_on_the_batch(dtype: torch.dtype, bias: bool) -> None:
    # K not a multiple of BLOCK_K, N not a multiple of BLOCK_N, M across
    # more than one row tile; single rows, a tile's worth, odd slices.
    m, n, k = BLOCK_M + 9, 100, BLOCK_K + 8
    cuts = [(0, 1), (0, 7), (BLOCK_M, 1), (BLOCK_M, 9), (0, BLOCK_M)]
    if DEVICE.type == "cuda":
        cuts += [(5, 1), (m - 1, 1), (3, BLOCK_M), (1, 7), (60, 13)]
    _rows_alone_and_together(m, n, k, dtype, bias, cuts)


def test_strided_input_and_empty_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(5, 96, generator=gen).to(DEVICE)
    w = torch.randn(24, 32, generator=gen).to(DEVICE)
    x = fused[:, 32:64]  # a column slice of a fused projection: row stride 96
    torch.testing.assert_close(invariant_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert invariant_linear(fused[:0, :32], w).shape == (0, 24)
    with pytest.raises(ValueError, match="needs x"):
        invariant_linear(fused, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_do_not_depend_on_the_batch_at_model_scale(dtype: torch.dtype) -> None:
    # A Llama-3-8B MLP projection: one decode row to a 2,048-token prefill.
    cuts = [(0, 1), (777, 1), (5, 31), (100, 64), (1000, 300), (0, 1024)]
    _rows_alone_and_together(2048, 4096, 4096, dtype, False, cuts)
    _rows_alone_and_together(600, 14336, 4096, dtype, False, [(0, 1), (17, 33), (64, 500)])
