"""RMSNorm and rotary embedding as one Triton kernel each (CUDA).

Op by op, a Llama layer's two norms and the rotation of q and k cost about
eighteen small kernels (upcast, norm, downcast, scale; negate, concatenate,
two products and a sum, twice), each a few microseconds of device time
whatever the batch: at decode, about 1.5 ms of a 7 ms step of an 8B model
on an H200 (`studies/engine_gpu`).  Here each is one launch.

Both round where the op-by-op versions in `engine.models.llama` and
`engine.models.rotary` round (the norm in float32, then the weight product
in the model dtype; each rotary product, then their sum, in the model
dtype): a bf16 model computes the same values either way but for the order
of the norm's sum (and, in float32, a product and sum that the compiler may
fuse into one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps,
    BLOCK: tl.constexpr, LOW_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0)
    if LOW_PRECISION:
        y = (normed.to(w.dtype).to(tl.float32) * w.to(tl.float32)).to(w.dtype)
    else:
        y = normed * w
    tl.store(out_ptr + row * stride_out + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`engine.models.llama.rms_norm` in one kernel: x `[T, hidden]`."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.stride(0), out.stride(0), n, eps,
            BLOCK=triton.next_power_of_2(n), LOW_PRECISION=x.dtype is not torch.float32,
            num_warps=8 if n >= 2048 else 4,
        )
    return out


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr, LOW_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    c = tl.arange(0, BLOCK_HALF)
    mask = c < half
    pos = tl.load(pos_ptr + token).to(tl.int64)
    # The tables repeat each frequency in both halves of a row.
    cos = tl.load(cos_ptr + pos * HEAD_DIM + c, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + c, mask=mask, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * NUM_Q_HEADS + head) * HEAD_DIM
    else:
        src = k_ptr + token * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        dst = k_out_ptr + (token * NUM_K_HEADS + head - NUM_Q_HEADS) * HEAD_DIM
    lo = tl.load(src + c, mask=mask, other=0.0)
    hi = tl.load(src + half + c, mask=mask, other=0.0)
    dtype = lo.dtype
    lo = lo.to(tl.float32)
    hi = hi.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo).
    a_lo, b_lo = lo * cos, -hi * sin
    a_hi, b_hi = hi * cos, lo * sin
    if LOW_PRECISION:
        a_lo = a_lo.to(dtype).to(tl.float32)
        b_lo = b_lo.to(dtype).to(tl.float32)
        a_hi = a_hi.to(dtype).to(tl.float32)
        b_hi = b_hi.to(dtype).to(tl.float32)
    tl.store(dst + c, (a_lo + b_lo).to(dtype), mask=mask)
    tl.store(dst + half + c, (a_hi + b_hi).to(dtype), mask=mask)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, H, D]` and k `[T, KVH, D]` (strided views allowed) at
    `positions`, reading the `[max_positions, D]` cos / sin tables; returns
    new contiguous tensors."""
    t, h, d = q.shape
    kvh = k.shape[1]
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    if t:
        _rotary_kernel[(t, h + kvh)](
            q, k, q_out, k_out, cos_table, sin_table, positions,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NUM_Q_HEADS=h, NUM_K_HEADS=kvh, HEAD_DIM=d,
            BLOCK_HALF=triton.next_power_of_2(d // 2),
            LOW_PRECISION=q.dtype is not torch.float32,
        )
    return q_out, k_out
