"""Top-k and top-p truncation on a GPU by a threshold search instead of a
sort (the rows `top_k_top_p_without_waiting` would sort in full; taken
where `engine.top_k_top_p.SEARCH_ON_CUDA` is on, off until timed on a GPU).

A row's kept set is every token whose logit reaches a threshold: the k-th
largest logit for top-k (ties kept), then, among those, the largest logit
`t` whose tokens at or above it hold at least `top_p` of the mass (a token
survives iff the mass strictly above it is below `top_p`: what the sorted
cut keeps, ties kept).  Both thresholds are found by a many-way search over
the logits' order-preserving integer keys: each pass over the row counts
(or weighs, `exp(x - max)`) the tokens at or above 16 pivots at once, keeps
the bucket where the count crosses its target and shrinks it to the keys
actually in it, until one key is left.  A row takes one program and
some ten reads of it (its bounds, a few passes a threshold, the write),
writes nothing but the result and reads nothing back to the host; whether
that beats a segmented sort, and from how many rows, is the GPU
benchmark's to say (`bench.sampling_bench --device cuda`).

This is the same kind of search as vLLM's pivot-based Triton top-k/top-p
(after Qrita); the semantics here are the sorted cut's, with ties kept.
Under `TRITON_INTERPRET=1` it runs on CPU tensors, for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One wide program a row (512 threads, 4 of a block's logits each: 86
# registers a thread on sm_90, no spills), so that one row alone keeps many
# loads in flight; twice as wide spills.
_BLOCK = 2048
_WARPS = 16
_KEY_ABOVE = tl.constexpr(2**31 - 1)  # no key reaches either
_KEY_BELOW = tl.constexpr(-(2**31))
_PIVOTS = 16  # 15 buckets between 16 pivots, the last pivot the range's top
_MAX_PASSES = 40  # a 32-bit key range shrinks 15× a pass: 9 suffice


@triton.jit
def _keys(x):
    """int32 keys whose order is the float32 values' (-0.0 taken as +0.0;
    no NaN: +inf's key is below the int32 maximum, -inf's above the minimum)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _bounds(row, vocab, BLOCK: tl.constexpr):
    """The row's largest value and its smallest and largest keys."""
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.full([BLOCK], _KEY_ABOVE, tl.int32)
    high = tl.full([BLOCK], _KEY_BELOW, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab
        x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        key = _keys(x)
        top = tl.maximum(top, x)
        low = tl.minimum(low, tl.where(valid, key, _KEY_ABOVE))
        high = tl.maximum(high, tl.where(valid, key, _KEY_BELOW))
    return tl.max(top, 0), tl.min(low, 0), tl.max(high, 0)


@triton.jit
def _search(row, vocab, lo, hi, floor, top, share, WEIGHTED: tl.constexpr,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The largest key `t` in [lo, hi) whose tokens at or above it (among
    those keyed at least `floor`) count at least `share` (WEIGHTED: hold at
    least `share` of the mass at or above `lo`, each token weighing
    `exp(x - top)`).  The caller holds lo to reach the target, hi not to."""
    j = tl.arange(0, PIVOTS)
    total = share * 0.0 - 1.0  # the mass at or above lo, once weighed
    passes = 0
    while (lo + 1 < hi) & (passes < MAX_PASSES):
        # piv[0] = lo, piv[-1] = hi (hi - lo may pass the int32 range).
        span = hi.to(tl.int64) - lo.to(tl.int64)
        piv = (lo.to(tl.int64) + (span * j) // (PIVOTS - 1)).to(tl.int32)
        acc = tl.zeros([PIVOTS], tl.float32)
        first = tl.full([PIVOTS], _KEY_ABOVE, tl.int32)  # smallest key >= piv[j]
        last = tl.full([PIVOTS], _KEY_BELOW, tl.int32)  # largest key < piv[j]
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < vocab
            x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
            key = _keys(x)
            valid = valid & (key >= floor)
            if WEIGHTED:
                w = tl.where(valid, tl.exp(x - top), 0.0)
            else:
                w = valid.to(tl.float32)
            ge = key[None, :] >= piv[:, None]
            acc += tl.sum(tl.where(ge, w[None, :], 0.0), 1)
            inside = valid[None, :]
            first = tl.minimum(first, tl.min(tl.where(ge & inside, key[None, :], _KEY_ABOVE), 1))
            last = tl.maximum(last, tl.max(tl.where(~ge & inside, key[None, :], _KEY_BELOW), 1))
        if WEIGHTED:
            # The first pass weighs everything at or above lo: the mass the
            # share is of.
            total = tl.where(total < 0.0, tl.sum(tl.where(j == 0, acc, 0.0), 0), total)
            target = share * total
        else:
            target = share
        # acc falls with j; the bucket [piv[b], piv[b + 1]) holds the crossing
        # (clamped: rounding may put acc[0] a hair under a weighed target).
        b = tl.minimum(tl.maximum(tl.sum((acc >= target).to(tl.int32), 0) - 1, 0), PIVOTS - 2)
        lo = tl.sum(tl.where(j == b, first, 0), 0)
        hi = tl.sum(tl.where(j == b + 1, last, 0), 0) + 1
        passes += 1
    return lo


@triton.jit
def _cut_rows(logits, out, top_k, top_p, vocab, stride_in, stride_out,
              BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = logits + r * stride_in
    k = tl.load(top_k + r)
    p = tl.load(top_p + r).to(tl.float32)
    top, low, high = _bounds(row, vocab, BLOCK)
    # Top-k: the k-th largest key (a count of k at or above it).
    k_hi = tl.where(k < vocab, high + 1, low + 1)
    kth = _search(row, vocab, low, k_hi, low, top, k.to(tl.float32), False,
                  BLOCK, PIVOTS, MAX_PASSES)
    # Top-p among the tokens top-k kept; none to cut where p = 1 or the
    # row holds no finite logit.
    p_hi = tl.where((p < 1.0) & (top > float("-inf")), high + 1, kth + 1)
    cut = _search(row, vocab, kth, p_hi, kth, top, p, True, BLOCK, PIVOTS, MAX_PASSES)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab
        x = tl.load(row + offs, mask=valid, other=float("-inf"))
        kept = tl.where(_keys(x.to(tl.float32)) >= cut, x, float("-inf"))
        tl.store(out + r * stride_out + offs, kept.to(out.dtype.element_ty), mask=valid)


def top_k_top_p_searched(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`logits` `[rows, vocab]` with every token outside its row's top-k and
    nucleus set to -inf (top_k: `[rows]` integers, vocab or more = off;
    top_p: `[rows]` floats, 1 = off), by the threshold search above.  The
    logits may be float32, bfloat16 or float16; they are compared in float32."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _cut_rows[(rows,)](
        logits, out, top_k.to(torch.int64).contiguous(), top_p.to(torch.float32).contiguous(),
        vocab, logits.stride(0), out.stride(0),
        BLOCK=_BLOCK, PIVOTS=_PIVOTS, MAX_PASSES=_MAX_PASSES, num_warps=_WARPS)
    return out
