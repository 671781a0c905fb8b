"""The float32-compute path for bf16 projections on CPUs without native bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import linear


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("out_features", [96, 9000])
def test_upcast_matches_float32_reference(rows: int, out_features: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    w = torch.randn(out_features, 64, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    got = linear.upcast_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # bf16 inputs multiply exactly in float32; only the final rounding to
    # bf16 (and summation order) separates it from the float32 result.
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


def test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert linear.linear_for(torch.float32, cpu) is F.linear
    native = linear.native_low_precision_cpu(torch.bfloat16)
    chosen = linear.linear_for(torch.bfloat16, cpu)
    assert chosen is (F.linear if native else linear.upcast_linear)
    # Both kinds of CPU, whichever this one is.
    for native, want in ((True, F.linear), (False, linear.upcast_linear)):
        monkeypatch.setattr(linear, "native_low_precision_cpu", lambda dtype, n=native: n)
        for dtype in (torch.bfloat16, torch.float16):
            assert linear.linear_for(dtype, cpu) is want, (native, dtype)
        assert linear.linear_for(torch.float32, cpu) is F.linear
