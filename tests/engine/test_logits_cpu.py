"""The greedy argmax operator: ATen's index on every row it is given
(ties, NaN, infinities, tails past the last whole vector), float32 and
bfloat16 rows alike (a bfloat16 row's index is its float32 copy's), and
ATen's own call wherever the operator does not apply."""

from __future__ import annotations

import shutil

import pytest
import torch

import engine.attention_cpp as cpp
from engine.logits_cpu import argmax_rows

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")


@pytest.fixture
def op():
    cpp.load_kernel()
    return torch.ops.preempt_serve.argmax_rows


def _rows_with_edges(n: int, gen: torch.Generator) -> torch.Tensor:
    rows = [torch.randn(n, generator=gen) for _ in range(4)]
    tied = torch.zeros(n)
    tied[[i for i in (n - 1, n // 2, 3 % n, 17 % n)]] = 2.0  # several at the max
    rows.append(tied)
    rows.append(torch.full((n,), 3.0))  # every entry tied
    rows.append(torch.full((n,), float("-inf")))
    with_nan = torch.randn(n, generator=gen)
    with_nan[[n - 1, n // 3]] = float("nan")
    rows.append(with_nan)
    with_inf = torch.randn(n, generator=gen)
    with_inf[[n // 2, n - 1]] = float("inf")
    rows.append(with_inf)
    tail = torch.randn(n, generator=gen)
    tail[n - 1] = 50.0  # the largest value past the last whole vector
    rows.append(tail)
    return torch.stack(rows)


@needs_cxx
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 1000, 49152, 49157])
def test_matches_aten_on_every_row(op, n: int, dtype: torch.dtype = torch.float32) -> None:
    x = _rows_with_edges(n, torch.Generator().manual_seed(n)).to(dtype)
    want = x.float().argmax(dim=-1)
    assert torch.equal(op(x), want)
    assert torch.equal(argmax_rows(x), want)


@needs_cxx
@pytest.mark.parametrize("n", [1, 15, 17, 33, 49152, 49157])
def test_bfloat16_rows_give_their_float32_copy_index(op, n: int) -> None:
    test_matches_aten_on_every_row(op, n, torch.bfloat16)
    # Values that bfloat16 rounds together: ties at the largest value that a
    # float32 row would not have, the first one wins.
    x = torch.randn(8, n, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[:, (n * 2) // 3] = 1000.0
    x[:, n - 1] = 1001.0  # rounds to 1000.0 in bfloat16
    want = x.float().argmax(dim=-1)
    assert torch.equal(op(x), want)
    assert torch.equal(op(x), x.argmax(dim=-1))


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_strided_rows(op, dtype: torch.dtype) -> None:
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    view = x[::2, 5:260]
    assert not view.is_contiguous()
    assert torch.equal(op(view), view.float().argmax(dim=-1))


@needs_cxx
def test_refuses_what_it_cannot_read(op) -> None:
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        op(torch.randn(3, 4).half())
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        op(torch.randn(12))
    with pytest.raises(RuntimeError, match="empty"):
        op(torch.empty(3, 0))


def test_aten_where_the_operator_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpp, "_kernel", None)
    calls = []
    real = torch.Tensor.argmax

    def spy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "argmax", spy)
    x = torch.randn(3, 50)
    assert argmax_rows(x).tolist() == real(x, dim=-1).tolist()
    assert calls == [x.shape]
