"""The threshold-search cut (engine/top_k_top_p_triton.py) against the
definition of top-k / top-p with ties kept, computed here in float64.

Triton's kernels run compiled where CUDA is, else under its interpreter."""

from __future__ import annotations

import pytest
import torch

from engine.top_k_top_p import _top_k_top_p_sorted
from engine.top_k_top_p_triton import top_k_top_p_searched

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Mass within this of top_p may fall either side of the edge in float32.
EDGE = 1e-5


def _definition(logits: torch.Tensor, ks: list[int], ps: list[float]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: kept, and whether it lies so near the nucleus's edge that
    float32 rounding may decide it.  A token survives top-k iff fewer than
    k tokens are strictly larger, then top-p iff the mass of the surviving
    tokens strictly larger is below p (ties fall together)."""
    x = logits.double().cpu()
    kept = torch.zeros_like(x, dtype=torch.bool)
    near = torch.zeros_like(kept)
    for r, (k, p) in enumerate(zip(ks, ps)):
        row = x[r]
        asc, order = row.sort()
        at_or_below = torch.searchsorted(asc, row, right=True)  # tokens <= each
        in_k = row.numel() - at_or_below < k
        if p >= 1.0 or not torch.isfinite(row).any():
            kept[r] = in_k
            continue
        w = torch.where(in_k, (row - row.max()).exp(), torch.zeros_like(row))
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), w[order].cumsum(0)])
        mass_above = (cum[-1] - cum[at_or_below]) / cum[-1]
        kept[r] = in_k & (mass_above < p)
        near[r] = in_k & ((mass_above - p).abs() < EDGE)
    return kept, near


def _check(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    got = top_k_top_p_searched(logits.to(DEVICE), torch.tensor(ks, device=DEVICE),
                               torch.tensor(ps, device=DEVICE)).cpu()
    assert got.dtype == logits.dtype and got.shape == logits.shape
    kept, near = _definition(logits, ks, ps)
    finite = torch.isfinite(logits)
    got_kept = torch.isfinite(got)
    # Kept tokens keep their logit; a token the definition keeps is kept
    # unless it is -inf already; only edge tokens may differ.
    assert torch.equal(got[got_kept], logits[got_kept])
    wrong = (got_kept != (kept & finite)) & ~near
    assert not wrong.any(), f"{int(wrong.sum())} tokens cut wrongly, rows {wrong.any(1).nonzero()}"
    return got


def test_agrees_with_the_definition_and_the_sort() -> None:
    """Top-k alone, top-p alone, both, k past the vocabulary, p = 1, a row
    that keeps one token, at peaked and flat scales; and the same kept
    sets as the sorted cut the GPU used before (distinct logits)."""
    g = torch.Generator().manual_seed(0)
    vocab = 2500  # not a multiple of the kernel's block
    scales = torch.tensor([3.0, 3.0, 3.0, 0.3, 8.0, 3.0, 1.0, 3.0, 3.0, 0.05])
    logits = torch.randn(len(scales), vocab, generator=g) * scales[:, None]
    ks = [50, vocab, 20, vocab, vocab, 1, 400, vocab + 7, 2, vocab]
    ps = [1.0, 0.9, 0.8, 0.95, 0.5, 0.7, 0.99, 0.3, 1.0, 0.9]
    got = _check(logits, ks, ps)
    want = _top_k_top_p_sorted(logits, torch.tensor(ks), torch.tensor(ps))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert int(torch.isfinite(got[5]).sum()) == 1  # k = 1
    assert torch.equal(got[8].isfinite().sum(), torch.tensor(2))


def test_ties_fall_together() -> None:
    """Logits rounded to a coarse grid: every k-th value and every nucleus
    edge falls inside a run of equal logits, all of which are kept or cut
    together; -0.0 and +0.0 are one value."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 700, generator=g) * 2).round()
    logits[5, :4] = torch.tensor([1.0, 0.0, -0.0, -1.0])
    logits[5, 4:] = -5.0
    ks = [10, 700, 33, 5, 700, 2]
    ps = [1.0, 0.6, 0.9, 0.5, 0.99, 1.0]
    got = _check(logits, ks, ps)
    assert torch.isfinite(got[5, :3]).all() and torch.isinf(got[5, 3:]).all()


def test_masked_tokens_and_empty_rows() -> None:
    """-inf tokens (cut earlier, e.g. by min_p) carry no mass and stay
    -inf; k past the finite tokens keeps them all; a row with nothing
    finite comes back as it went in, without NaN."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 1100, generator=g) * 3
    logits[0, 100:] = float("-inf")
    logits[1, ::2] = float("-inf")
    logits[2] = float("-inf")
    logits[3, :1050] = float("-inf")
    got = _check(logits, [200, 30, 5, 1100], [0.9, 0.8, 0.5, 0.95])
    assert int(torch.isfinite(got[0]).sum()) < 100
    assert torch.isinf(got[2]).all() and not torch.isnan(got).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 1500, generator=g) * 3).to(dtype)
    _check(logits, [40, 1500, 100], [0.9, 0.8, 1.0])


def test_large_vocabulary() -> None:
    """SmolLM2's vocabulary, a flat row whose nucleus holds most of it."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 49152, generator=g) * torch.tensor([[0.5], [3.0]])
    _check(logits, [49152, 49152], [0.95, 0.9])


def test_a_search_that_fails_is_reported_once_and_sorted_after(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import engine.top_k_top_p as cut
    import engine.top_k_top_p_triton as searched

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 800, generator=g) * 3).to(DEVICE)
    ks = torch.tensor([800, 30, 800], device=DEVICE)
    ps = torch.tensor([0.9, 0.8, 0.5], device=DEVICE)
    want = _top_k_top_p_sorted(logits, ks, ps)
    monkeypatch.setattr(cut, "_search_failed", False)
    assert torch.equal(cut._searched_or_sorted(logits, ks, ps, search=True).isfinite(),
                       want.isfinite())
    assert not cut._search_failed  # it searched
    calls = []

    def broken(*args: object) -> torch.Tensor:
        calls.append(args)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(searched, "top_k_top_p_searched", broken)
    with caplog.at_level("WARNING", logger="engine.top_k_top_p"):
        for _ in range(2):
            assert torch.equal(cut._searched_or_sorted(logits, ks, ps, search=True), want)
    assert len(calls) == 1 and cut._search_failed
    assert [r.getMessage() for r in caplog.records if "no compiler" in r.getMessage()]

