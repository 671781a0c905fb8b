"""The CPU operators for a Llama layer's RMSNorm (bf16 and float32) and its
rotation of q and k: the values of the op-by-op versions they replace (bit
for bit for the rotation, within the sum order for the norm), on strided
views as the layer hands them over; a row's norm whatever rows are beside
it; and the layer taking them where they are loaded."""

from __future__ import annotations

import shutil

import pytest
import torch

import engine.attention_cpp as cpp
import engine.cpp_ops as ops
from engine.models.llama import rms_norm, rms_norm_cpu
from engine.models.rotary import apply_rotary

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
pytestmark = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def _loaded() -> None:
    cpp.load_kernel()


def _tables(max_pos: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (37, 9, 3, 64),
                                                       (5, 8, 8, 128), (3, 4, 2, 6),
                                                       (4, 4, 2, 40)])
def test_rotation_is_the_op_by_op_rotation_bit_for_bit(dtype: torch.dtype, tokens: int,
                                                       heads: int, kv_heads: int,
                                                       dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    # q and k as views of one qkv projection's output, as the layer splits it.
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    assert tokens == 1 or not q.is_contiguous()
    cos_t, sin_t = _tables(300, dim, dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    got_q, got_k = torch.ops.preempt_serve.rotary_qk(q, k, cos_t, sin_t, positions)
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    assert torch.equal(got_q, apply_rotary(q, cos, sin))
    assert torch.equal(got_k, apply_rotary(k, cos, sin))
    assert got_q.is_contiguous() and got_k.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_keeps_special_values_bit_for_bit(dtype: torch.dtype) -> None:
    # Signed zeros, infinities, NaN, subnormals, overflowing products and
    # bf16 rounding ties, through the vector loop and its scalar tail.
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny / 4,
                             -tiny / 2, 3e38, -3e38, 1.00390625, 1.01171875, -2.0, 0.5, 7.0])
    tokens, heads, kv_heads, dim = 6, 4, 2, 40
    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(0, len(specials), (tokens, (heads + kv_heads) * dim), generator=gen)
    qk = specials[picks].to(dtype)
    q, k = qk.split((heads * dim, kv_heads * dim), dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    cos_t, sin_t = _tables(64, dim, dtype)
    cos_t[5], sin_t[5] = -0.0, 1.0  # a zero cosine's sign in the products
    positions = torch.tensor([0, 5, 63, 7, 5, 1])
    got_q, got_k = torch.ops.preempt_serve.rotary_qk(q, k, cos_t, sin_t, positions)
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    bits = torch.int32 if dtype is torch.float32 else torch.int16
    for got, want in ((got_q, apply_rotary(q, cos, sin)), (got_k, apply_rotary(k, cos, sin))):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_rotation_refuses_a_position_past_its_tables() -> None:
    cos_t, sin_t = _tables(16, 8, torch.float32)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="beyond the tables"):
        torch.ops.preempt_serve.rotary_qk(q, k, cos_t, sin_t, torch.tensor([3, 16]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.preempt_serve.rotary_qk(q.bfloat16(), k, cos_t, sin_t, torch.tensor([3, 4]))


@pytest.mark.parametrize("rows,n", [(1, 576), (96, 576), (7, 2048), (3, 10)])
def test_bf16_norm_matches_the_op_by_op_norm(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    wide = (torch.randn(rows, n + 64, generator=gen) * 4).bfloat16()
    x = wide[:, 32 : 32 + n]  # strided rows, as a slice of a wider output
    w = (torch.rand(n, generator=gen) + 0.5).bfloat16()
    got = torch.ops.preempt_serve.rms_norm_bf16(x, w, 1e-5)
    want = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # The float32 sum may be taken in another order than ATen's: a value
    # then lands one bf16 step away, rarely.
    exact = (got == want).float().mean().item()
    assert exact > 0.99
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("rows,n", [(1, 576), (32, 576), (7, 2048), (3, 10)])
def test_float32_norm_is_atens_within_rounding_and_per_row(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n + rows)
    wide = torch.randn(rows, n + 64, generator=gen) * 4
    x = wide[:, 32 : 32 + n]
    w = torch.rand(n, generator=gen) + 0.5
    got = torch.ops.preempt_serve.rms_norm_f32(x, w, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), rtol=4e-6, atol=1e-6)
    # Each row alone gives the bits it gets among the others.
    for r in range(rows):
        assert torch.equal(torch.ops.preempt_serve.rms_norm_f32(x[r : r + 1], w, 1e-5),
                           got[r : r + 1])
    assert torch.equal(rms_norm_cpu(x, w, 1e-5), got)


def test_norm_dispatch_takes_aten_where_the_operator_does_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w = torch.randn(4, 32), torch.rand(32)
    # 3-D rows, a weight of another dtype: ATen's norm.
    assert torch.equal(rms_norm_cpu(x[None], w, 1e-6), rms_norm(x[None], w, 1e-6))
    assert torch.equal(rms_norm_cpu(x, w.double(), 1e-6), rms_norm(x, w.double(), 1e-6))
    with pytest.raises(RuntimeError, match="float32 x and weight"):
        torch.ops.preempt_serve.rms_norm_f32(x, w.bfloat16(), 1e-6)
    xb, wb = x.bfloat16(), w.bfloat16()
    monkeypatch.setattr(ops, "_kernel", None)
    assert torch.equal(rms_norm_cpu(xb, wb, 1e-6), rms_norm(xb, wb, 1e-6))
    assert torch.equal(rms_norm_cpu(x, w, 1e-6), rms_norm(x, w, 1e-6))
