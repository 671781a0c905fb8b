"""The C++ sampling operator (`engine/csrc/sample_rows.cpp`): the inverse of
each row's cumulative distribution at its uniform variate, as the float64
reference computes it, on float32 and bfloat16 logits, at any temperature,
after min_p, top-k and top-p, never a token of weight zero; degenerate rows
draw their argmax; and the sampler sends it exactly the rows no bias, ban,
penalty or grammar changes, seeded rows drawing the same tokens whatever
shares their batch."""

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


def _truncated_reference(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         min_p: float, u: torch.Tensor) -> torch.Tensor:
    """The sampler's rules in float64: min_p, then top-k (ties at the k-th
    kept), then top-p over the kept weight (the first token always kept, and
    every token tied with the last kept), then the inverse of the kept
    tokens' distribution in index order."""
    key = row.double() / temperature
    key = key - key.max()
    weight = key.exp()
    weight[key < torch.tensor(min_p, dtype=torch.float64).log()] = 0.0
    order = sorted(range(row.numel()), key=lambda j: (-float(key[j]), j))
    order = [j for j in order if weight[j] > 0]
    k_on = top_k < len(order)  # a k past the finite tokens keeps them all
    if k_on:
        kth = float(key[order[top_k - 1]])
        order = [j for j in order if float(key[j]) >= kth]
    if top_p < 1.0:
        z = float(weight[order].sum()) if k_on else float(weight.sum())
        kept, before = [], 0.0
        for j in order:
            if kept and before >= top_p * z and float(key[j]) < float(key[kept[-1]]):
                break
            kept.append(j)
            before += float(weight[j])
        order = kept
    keep = torch.zeros_like(weight)
    keep[order] = weight[order]
    cdf = keep.cumsum(0)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=row.numel() - 1)


@pytest.mark.parametrize("cuts", [dict(top_k=50), dict(top_p=0.9), dict(top_k=20, top_p=0.5),
                                  dict(min_p=0.05), dict(min_p=0.1, top_p=0.8), dict(top_k=1),
                                  dict(top_p=0.01), dict(top_p=0.999), dict(top_k=999),
                                  # the nucleus ends in a bucket before the k-th key's
                                  dict(top_k=500, top_p=0.3),
                                  dict(min_p=0.2, top_k=30)])
@pytest.mark.parametrize("scale", [1.0, 4.0, 10.0])
def test_it_cuts_as_the_sampler_does(op, cuts: dict, scale: float) -> None:
    vocab, draws, temperature = 1000, 1000, 0.8
    gen = torch.Generator().manual_seed(int(scale))
    logits = torch.randn(2, vocab, generator=gen) * scale
    logits[0, 100:150] = float("-inf")
    logits[1, :5] = logits[1, 5]  # ties at the top
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    top_k, top_p, min_p = cuts.get("top_k", vocab), cuts.get("top_p", 1.0), cuts.get("min_p", 0.0)
    for row in (0, 1):
        got = op(logits, torch.full((draws,), row), torch.full((draws,), 1 / temperature), u,
                 torch.full((draws,), top_k), torch.full((draws,), top_p),
                 torch.full((draws,), min_p))
        want = _truncated_reference(logits[row], temperature, top_k, top_p, min_p, u)
        assert int((got != want).sum()) <= 2, (row, cuts)


def test_it_keeps_every_token_tied_with_the_nucleus_edge(op) -> None:
    """Mass above 3 is 0.46 of the row, above each 2 the same 0.46: top_p
    0.6 keeps all three 2s (the sampler's torch cuts keep them too), top_p
    0.4 the 3 alone; every kept token is drawn, in proportion."""
    logits = torch.tensor([[2.0, 0.0, 2.0, 3.0, 2.0]])
    draws = 2000
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    for top_p, want in ((0.6, {0, 2, 3, 4}), (0.4, {3})):
        got = op(logits, torch.zeros(draws, dtype=torch.long), torch.ones(draws), u,
                 torch.full((draws,), 5), torch.full((draws,), top_p), torch.zeros(draws))
        assert set(got.tolist()) == want, top_p
        ref = _truncated_reference(logits[0], 1.0, 5, top_p, 0.0, u)
        assert torch.equal(got, ref)


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


def test_the_sampler_sends_it_the_rows_it_can_draw(op, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 2000, generator=gen) * 2
    params = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, min_p=0.1, seed=4),
              SamplingParams(temperature=0.7, seed=12),
              SamplingParams(temperature=0.9, seed=6, presence_penalty=0.5)]
    reqs = [SampleRequest(p, 5) for p in params]
    sent: list[list[int]] = []

    def spy(x, rows, *args):
        sent.append(rows.tolist())
        return op(x, rows, *args)

    monkeypatch.setattr(torch.ops.preempt_serve, "sample_rows", spy, raising=False)
    tokens = Sampler(seed=0).sample(logits, reqs)
    assert sent == [[0, 1, 2, 4, 5]]  # not the greedy row, nor the penalised one
    # A seeded row draws the same token in a batch of one, and without the
    # operator.
    alone = Sampler(seed=9).sample(logits[5:6], reqs[5:6])
    assert alone == [tokens[5]]
    monkeypatch.setattr(cpp, "loaded", lambda: False)
    torch_path = Sampler(seed=0).sample(logits, reqs)
    assert torch_path[3] == tokens[3] and torch_path[6] == tokens[6]  # the same path
    # The seeded rows the operator drew: the same tokens as the torch path
    # (both invert the same distribution at the same variate).
    assert [torch_path[i] for i in (0, 2, 4, 5)] == [tokens[i] for i in (0, 2, 4, 5)]
