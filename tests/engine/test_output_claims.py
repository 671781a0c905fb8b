"""The bf16 GEMM on AMX tiles and the prefill operator claim their output's
cache lines before they compute them (engine/csrc/vec16.h, claim): a hint
to the caches only, so every result must be the same bits either way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import engine.attention_cpp as cpp
from engine.models import packed_bf16
from tests.engine.test_attention_cpp import needs_cxx
from tests.engine.test_prefill_cpp import CHUNKS, _call, _case, _reference


@pytest.fixture
def claims() -> Iterator[None]:
    """Skips where the build has no claims (no AVX512); leaves them on."""
    cpp.load_kernel()
    if not torch.ops.preempt_serve.set_output_claims(True):
        pytest.skip("this build claims no outputs (no AVX512)")
    yield
    torch.ops.preempt_serve.set_output_claims(True)


def _both(fn) -> tuple[torch.Tensor, torch.Tensor]:
    torch.ops.preempt_serve.set_output_claims(False)
    off = fn()
    torch.ops.preempt_serve.set_output_claims(True)
    return fn(), off


@needs_cxx
# Outputs of 1 MB and more (smaller ones are not claimed): one pass over K,
# passes over K (K 1,536), a last row tile alone and a zero-padded one.
@pytest.mark.parametrize("rows,n,k", [(1024, 3072, 576), (1000, 576, 1536), (333, 3072, 576)])
def test_gemm_gives_the_same_bits_with_claims(claims: None, rows: int, n: int, k: int) -> None:
    if not packed_bf16.on_tiles():
        pytest.skip("the GEMM is not on AMX tiles here")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    # Rows of a wider tensor: the row stride is not the GEMM's K.
    x = torch.cat([x, x[:, :32]], dim=1)[:, :k]
    packed = packed_bf16.pack(w)
    on, off = _both(lambda: packed_bf16.linear(x, packed))
    assert torch.equal(on, off)
    ref = x.float() @ w.float().t()
    assert torch.allclose(on.float(), ref, atol=0.05, rtol=0.02)


@needs_cxx
def test_prefill_gives_the_same_bits_with_claims(claims: None) -> None:
    q, keys, values, tables = _case(CHUNKS, 9, 3, 64, 16, dtype=torch.bfloat16)
    on, off = _both(lambda: _call(q, keys, values, tables, CHUNKS))
    assert torch.equal(on, off)
    ref = _reference(q, keys, values, tables, CHUNKS)
    assert torch.allclose(on.double(), ref, atol=0.03)
