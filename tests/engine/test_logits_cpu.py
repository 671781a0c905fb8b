"""The greedy argmax operator: ATen's index on every row it is given
(ties, NaN, infinities, tails past the last whole vector), float32 and
bfloat16 rows alike (a bfloat16 row's index is its float32 copy's), and
ATen's own call wherever the operator does not apply."""

from __future__ import annotations

import pytest
import torch

import engine.attention_cpp as cpp
import engine.cpp_ops as ops
from engine.logits_cpu import argmax_rows
from tests.engine.helpers import HAS_CXX

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
    monkeypatch.setattr(ops, "_kernel", None)
    calls = []
    real = torch.Tensor.argmax

    def spy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "argmax", spy)
    x = torch.randn(3, 50)
    assert argmax_rows(x).tolist() == real(x, dim=-1).tolist()
    assert calls == [x.shape]


def _tied_at_the_top(n: int, dim: int, logits_dtype: torch.dtype,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden rows and head weight whose rounded logits tie at the top:
    rows of the head near the likeliest one's, a few hundredths of a logit
    apart (in one vector lane, in others, in the tail past the last whole
    vector), so that their exact logits differ where the rounded ones do not."""
    gen = torch.Generator().manual_seed(seed)
    rows = 12
    hidden = torch.randn(rows, dim, generator=gen).bfloat16()
    weight = (torch.randn(n, dim, generator=gen) * 0.02).bfloat16()
    top = int((hidden[0].float() @ weight.float().T).argmax())
    weight[top] = hidden[0] * 0.5  # well ahead of the others in row 0
    for j in {top + 16, top + 3, (top + n // 2) % n, n - 1} - {top}:
        weight[j] = (weight[top].float() * (1 + 1e-2 * torch.randn(dim, generator=gen))).bfloat16()
    exact = hidden.float() @ weight.float().T
    logits = exact.bfloat16().to(logits_dtype)
    logits[rows - 1, n // 3] = float("nan")  # a NaN row keeps its first NaN
    return logits, hidden, weight


def _exact_argmax(logits: torch.Tensor, hidden: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The index each row should get, and how many rows tie at their top."""
    want = logits.float().argmax(dim=-1)
    ties = 0
    for r in range(logits.shape[0]):
        row = logits[r].float()
        if row.isnan().any():
            continue
        ids = (row == row.max()).nonzero().flatten()
        if len(ids) > 1:
            ties += 1
            want[r] = ids[int((weight[ids].float() @ hidden[r].float()).argmax())]
    return want, ties


@pytest.mark.parametrize("logits_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [40, 1000, 49157])
def test_a_tie_at_the_top_goes_to_the_largest_exact_logit(
        n: int, logits_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    logits, hidden, weight = _tied_at_the_top(n, 64, logits_dtype, seed=n)
    want, ties = _exact_argmax(logits, hidden, weight)
    assert ties >= 1
    # Where the first tied index is not the exact one, the plain argmax is wrong.
    assert not torch.equal(logits.float().argmax(dim=-1), want)
    if HAS_CXX:
        cpp.load_kernel()
        assert torch.equal(argmax_rows(logits, (hidden, weight)), want)
        assert torch.equal(
            torch.ops.preempt_serve.argmax_rows_exact(logits, hidden, weight), want)
        # Without the exact source the operator keeps the first index.
        assert torch.equal(argmax_rows(logits), logits.float().argmax(dim=-1))
    monkeypatch.setattr(ops, "_kernel", None)  # ATen's path
    assert torch.equal(argmax_rows(logits, (hidden, weight)), want)


@needs_cxx
def test_the_exact_argmax_refuses_mismatched_shapes() -> None:
    cpp.load_kernel()
    op = torch.ops.preempt_serve.argmax_rows_exact
    logits, hidden, weight = _tied_at_the_top(100, 16, torch.bfloat16, seed=0)
    with pytest.raises(RuntimeError, match="hidden"):
        op(logits, hidden[:3], weight)
    with pytest.raises(RuntimeError, match="hidden"):
        op(logits, hidden, weight[:50])
    with pytest.raises(RuntimeError, match="hidden"):
        op(logits, hidden.float(), weight)
