"""The fused RMSNorm and rotary kernels against the op-by-op versions
(Triton's interpreter on CPU; compiled where CUDA is)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.models.fused_triton import apply_rotary_qk, rms_norm
from engine.models.llama import rms_norm as reference_rms_norm
from engine.models.rotary import RotaryEmbedding, apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16: the two sides may differ by a rounding of the norm's sum, which can
# move the bf16 norm and then the product by an ulp each.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, hidden + 8, generator=gen) * 3).to(dtype)[:, :hidden]  # strided rows
    w = torch.randn(hidden, generator=gen).to(dtype)
    want = reference_rms_norm(x, w, 1e-5)
    got = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (64, 9, 3), (24, 2, 1)])
def test_rotary_matches_reference(dtype: torch.dtype, head_dim: int, heads: int,
                                  kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(1)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         head_dim=head_dim, rope_theta=10000.0)
    rope = RotaryEmbedding(config, head_dim, 256, dtype, torch.device("cpu"))
    t = 5
    # q and k as strided views of one fused projection, as the model has them.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    positions = torch.tensor([0, 3, 17, 200, 255])
    cos, sin = rope.cos_sin(positions)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = apply_rotary_qk(q.to(DEVICE), k.to(DEVICE), rope.cos.to(DEVICE),
                                   rope.sin.to(DEVICE), positions.to(DEVICE))
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.is_contiguous() and got.dtype == dtype
        # One rounding apart at most (a fused multiply-add in float32).
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=TOL[dtype],
                                   atol=TOL[dtype])
