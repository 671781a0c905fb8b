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

from engine.models import matmul_triton
from engine.models.matmul_triton import (
    CONFIG, LARGE, LARGE_ROWS, InvariantLinear, TileConfig, invariant_linear, splits,
)

BLOCK_M, BLOCK_K = CONFIG.block_m, CONFIG.block_k

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows_alone_and_together(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool, cuts: list[tuple[int, int]],
    config: TileConfig = CONFIG,
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    whole = invariant_linear(x, w, b, config=config)
    for start, size in cuts:
        part = invariant_linear(x[start : start + size], w, b, config=config)
        assert torch.equal(part, whole[start : start + size]), (start, size)
    # float32's rounding error grows with the length of the dot products.
    tol = 1e-5 * max(1.0, k / 4096) if dtype is torch.float32 else 2e-2
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


# Small tiles so that the interpreter splits K without a model-sized weight.
SPLIT = TileConfig(block_m=16, block_n=16, block_k=16, warps=1, stages=1, split_to=8)


def test_the_split_over_k_is_chosen_from_the_weight_alone() -> None:
    # 2 column tiles -> 4 splits wanted, but 14 slices (K = 13 x 16 + 5) give
    # at most 3 of MIN_SLICES or more: 5, 5 and 4 slices.
    assert splits(32, 13 * 16 + 5, SPLIT) == (3, 5)
    # A weight with enough column tiles is not split; nor is a short K.
    assert splits(16 * 8, 4096, SPLIT) == (1, 256)
    assert splits(16, 3 * 16, SPLIT) == (1, 3)
    # The shipped configuration: never more than MAX_SPLITS, whole slices.
    for n, k in ((96, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (128256, 4096)):
        count, per = splits(n, k)
        assert 1 <= count and (count - 1) * per < -(-k // CONFIG.block_k) <= count * per


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_rows_split_over_k_do_not_depend_on_the_batch(dtype: torch.dtype, bias: bool) -> None:
    # Three splits, the last one shorter and ragged, partial sums added in a
    # second kernel.
    m, n, k = 16 + 5, 32, 13 * 16 + 5
    assert splits(n, k, SPLIT)[0] == 3
    cuts = [(0, 1), (0, 5), (16, 1), (16, 5), (0, 16)]
    if DEVICE.type == "cuda":
        cuts += [(3, 1), (m - 1, 1), (2, 17)]
    _rows_alone_and_together(m, n, k, dtype, bias, cuts, SPLIT)


def _larger_tile() -> tuple[TileConfig, int]:
    """The shipped larger tile on CUDA; under the interpreter a small one."""
    if DEVICE.type == "cuda":
        return LARGE, LARGE_ROWS
    return TileConfig(block_m=32, block_n=32, block_k=BLOCK_K, warps=1, stages=1), 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_batches_take_a_larger_tile_that_rounds_the_same(dtype: torch.dtype) -> None:
    large, rows = _larger_tile()
    gen = torch.Generator().manual_seed(3)
    k = BLOCK_K + 40
    w = (torch.randn(96, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    lin = InvariantLinear([w, w.clone()], large, rows)
    # One check per shape and dtype.  Whether the two tiles round alike is
    # the check's to find: on a GPU (LARGE does not even fit the shared
    # memory in float32), and under the interpreter too, whose dot is the
    # CPU's BLAS (alike with OpenBLAS's AVX512 kernels, not with its AVX2
    # ones).  The rows below must agree either way.
    assert list(lin.checked) == [(96, k, dtype)]
    x = torch.randn(max(rows, BLOCK_M) + 9, k, generator=gen).to(dtype).to(DEVICE)
    whole = lin(x, w)  # the larger tile, where it was checked
    # Slices start on a boundary of both tiles: the interpreter's BLAS may
    # round a row by its place in the tile (module docstring).
    for start, size in [(0, 1), (0, 7), (BLOCK_M, 1), (BLOCK_M, 9), (0, 32)]:
        assert torch.equal(lin(x[start : start + size], w), whole[start : start + size])
    torch.testing.assert_close(whole.float(), F.linear(x.float(), w.float()),
                               rtol=2e-2 if dtype is torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype is torch.bfloat16 else 1e-5)


def test_the_larger_tile_only_for_large_batches_on_checked_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    large, rows = _larger_tile()
    w = torch.randn(64, BLOCK_K, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lin = InvariantLinear([w], large, rows)
    used: list[TileConfig] = []
    real = matmul_triton.invariant_linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
            config: TileConfig = CONFIG, split: tuple[int, int] | None = None) -> torch.Tensor:
        used.append(config)
        return real(x, w, b, config=config, split=split)

    monkeypatch.setattr(matmul_triton, "invariant_linear", spy)
    lin.checked[(64, BLOCK_K, w.dtype)] = True
    lin(torch.zeros(rows - 1, BLOCK_K, device=DEVICE), w)
    lin(torch.zeros(rows, BLOCK_K, device=DEVICE), w)
    lin(torch.zeros(rows, BLOCK_K, device=DEVICE), w[:32])  # a weight never checked
    lin.checked[(64, BLOCK_K, w.dtype)] = False  # rounded differently: never used
    lin(torch.zeros(rows, BLOCK_K, device=DEVICE), w)
    assert used == [CONFIG, large, CONFIG, CONFIG]
    with pytest.raises(ValueError, match="block_k"):
        InvariantLinear([w], large._replace(block_k=BLOCK_K // 2), rows)


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
    # Few column tiles and a long K: split over K (the MLP's down projection).
    assert splits(4096, 14336)[0] > 1 or CONFIG.split_to == 0
    _rows_alone_and_together(600, 4096, 14336, dtype, True, [(0, 1), (17, 33), (64, 500)])
