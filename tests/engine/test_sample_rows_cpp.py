"""The C++ sampling operator (`engine/csrc/sample_rows.cpp`): the inverse of
each row's cumulative distribution at its uniform variate, as the float64
reference computes it, on float32 and bfloat16 logits, at any temperature,
never a token of weight zero; degenerate rows draw their argmax; and the
sampler sends it exactly its plain-temperature rows, seeded rows drawing
the same tokens whatever shares their batch."""

from __future__ import annotations

import pytest
import torch

import engine.attention_cpp as cpp
from engine.sampling import SampleRequest, Sampler, SamplingParams
from tests.engine.helpers import HAS_CXX

pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")


@pytest.fixture
def op():
    cpp.load_kernel()
    return torch.ops.preempt_serve.sample_rows


def _reference(row: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path: softmax, float64 running sum, search."""
    cdf = (row.float() / temperature).softmax(-1).double().cumsum(0)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=row.numel() - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 64, 1000, 49152])
def test_it_inverts_the_distribution(op, dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(3, vocab, generator=gen) * 3).to(dtype)
    logits[2, : vocab // 2] = float("-inf")  # a banned half: never drawn
    draws = 4000
    # A grid of variates: each token is drawn in proportion to its weight.
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    for row in range(3):
        for temperature in (0.3, 1.0, 1.9):
            got = op(logits, torch.full((draws,), row, dtype=torch.long),
                     torch.full((draws,), 1 / temperature), u)
            want = _reference(logits[row], temperature, u)
            # Equal but where a variate falls on a boundary within rounding.
            assert int((got != want).sum()) <= 2, (row, temperature)
            if row == 2:
                assert int(got.min()) >= vocab // 2


def test_it_reads_only_the_rows_it_is_given(op) -> None:
    logits = torch.full((4, 100), float("-inf"))
    for r in range(4):
        logits[r, 10 * r] = 0.0  # one possible token per row
    got = op(logits, torch.tensor([3, 1, 3]), torch.ones(3), torch.tensor([0.1, 0.5, 0.99],
                                                                          dtype=torch.float64))
    assert got.tolist() == [30, 10, 30]
    with pytest.raises(RuntimeError, match="out of range"):
        op(logits, torch.tensor([4]), torch.ones(1), torch.zeros(1, dtype=torch.float64))


def test_degenerate_rows_draw_their_argmax(op) -> None:
    logits = torch.randn(3, 40)
    logits[0] = float("-inf")
    logits[1, 17] = float("inf")
    logits[2, 5] = float("nan")
    got = op(logits, torch.arange(3), torch.ones(3), torch.full((3,), 0.7, dtype=torch.float64))
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_the_sampler_sends_it_plain_rows_only(op, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 2000, generator=gen) * 2
    params = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, min_p=0.1, seed=4),
              SamplingParams(temperature=0.7, seed=12)]
    reqs = [SampleRequest(p, 5) for p in params]
    sent: list[list[int]] = []

    def spy(x, rows, inv_t, u):
        sent.append(rows.tolist())
        return op(x, rows, inv_t, u)

    monkeypatch.setattr(torch.ops.preempt_serve, "sample_rows", spy, raising=False)
    tokens = Sampler(seed=0).sample(logits, reqs)
    assert sent == [[0, 1, 5]]
    # A seeded row draws the same token in a batch of one, and without the
    # operator.
    alone = Sampler(seed=9).sample(logits[5:6], reqs[5:6])
    assert alone == [tokens[5]]
    monkeypatch.setattr(cpp, "loaded", lambda: False)
    torch_path = Sampler(seed=0).sample(logits, reqs)
    assert torch_path[0] == tokens[0] and torch_path[5] == tokens[5]
    assert torch_path[2:5] == tokens[2:5]  # the same path for the other rows
