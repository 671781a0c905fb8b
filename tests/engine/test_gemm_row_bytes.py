"""The VDPBF16PS GEMM's row chunks (`set_gemm_row_bytes`) decide only how
often each weight streams past x's rows, never a result's bits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import engine.attention_cpp as cpp
from tests.engine.test_attention_cpp import needs_cxx


@pytest.fixture
def vectors() -> Iterator[None]:
    """The VDPBF16PS path (the tiles switched off where a build has them);
    the chunk size and the tiles restored after."""
    cpp.load_kernel()
    ops = torch.ops.preempt_serve
    if not ops.bf16_gemm_built():
        pytest.skip("this build has no AVX512-BF16 GEMM")
    tiles, default = ops.gemm_amx(), ops.set_gemm_row_bytes(0)
    ops.set_gemm_amx(False)
    yield
    ops.set_gemm_amx(tiles)
    ops.set_gemm_row_bytes(default)


@needs_cxx
@pytest.mark.parametrize("rows,n,k", [(700, 96, 576), (333, 48, 1536), (9, 4608, 64)])
def test_row_chunks_give_the_same_bits(vectors: None, rows: int, n: int, k: int) -> None:
    ops = torch.ops.preempt_serve
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = ops.pack_bf16(torch.randn(n, k, generator=g).to(torch.bfloat16))
    bias = torch.randn(n, generator=g)
    outs = []
    for size in (192 * 1024, 8 * 1024, 1 << 20, 1):  # 1: one block of 8 rows a chunk
        assert ops.set_gemm_row_bytes(size) == size
        outs.append(ops.linear_bf16(x, w, bias))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    # And it is the product: float32 sums of bf16 operands, one rounding.
    unpacked = w.permute(0, 2, 1, 3).reshape(n, k).float()
    ref = (x.float() @ unpacked.T + bias).to(torch.bfloat16)
    torch.testing.assert_close(outs[0].float(), ref.float(), atol=0.05, rtol=0.02)
    # 0 asks for the setting without changing it.
    assert ops.set_gemm_row_bytes(0) == 1
