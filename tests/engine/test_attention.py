"""The paged-attention backends against a dense per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import SeqSpan, get_attention_backend
from engine.kv_cache import KVCache


def _reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> torch.Tensor:
    """q: [n, H, d] at positions start..; keys/values: [ctx, KVH, d]."""
    n, h, d = q.shape
    group = h // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (start_pos, num_tokens) per chunk: decodes first, then a fresh prefill and
# continuing chunks (chunked prefill / recompute).
MIXED = [(9, 1), (0, 1), (16, 1), (0, 7), (5, 6), (12, 9)]
# Decodes of equal context need no padding mask.
EQUAL = [(7, 1), (7, 1), (7, 1), (3, 5)]
# Contexts within one block (tables one block wide), and a lone decode.
NARROW = [(2, 1), (0, 1), (1, 3)]
LONE = [(13, 1), (0, 4)]


def _check_backend(
    backend_name: str, heads: int, kv_heads: int, shapes: list[tuple[int, int]],
    d: int = 8, bs: int = 4, num_blocks: int = 64, dtype: torch.dtype = torch.float32,
    tol: float = 1e-5, views_of_qkv: bool = False, deterministic: bool = False,
    deterministic_rows: int | None = None,
) -> None:
    """Attend `shapes` (start_pos, num_tokens) chunks with random K/V and
    compare with the dense reference in float32; also check the stores."""
    # Triton's kernels run compiled where CUDA is, else under its interpreter.
    dev = torch.device("cuda" if backend_name == "triton" and torch.cuda.is_available()
                       else "cpu")
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(1, num_blocks, bs, kv_heads, d, dtype, "cpu")
    rows = {} if deterministic_rows is None else {"deterministic_rows": deterministic_rows}
    backend = get_attention_backend(backend_name)(heads, kv_heads, d, bs, dev,
                                                  deterministic=deterministic, **rows)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    history = []  # full K/V of each sequence, the dense truth
    spans = []
    for start, n in shapes:
        ctx = start + n
        table = [free.pop() for _ in range(-(-ctx // bs))]
        keys = torch.randn(ctx, kv_heads, d, generator=gen).to(dtype)
        values = torch.randn(ctx, kv_heads, d, generator=gen).to(dtype)
        # Earlier tokens were written by earlier steps.
        for pos in range(start):
            cache.key(0)[table[pos // bs], pos % bs] = keys[pos]
            cache.value(0)[table[pos // bs], pos % bs] = values[pos]
        history.append((keys, values))
        spans.append(SeqSpan(start, n, table))

    total = sum(n for _, n in shapes)
    q = torch.randn(total, heads, d, generator=gen).to(dtype)
    k_new = torch.cat([kv[0][s:] for (s, _), kv in zip(shapes, history)])
    v_new = torch.cat([kv[1][s:] for (s, _), kv in zip(shapes, history)])
    if views_of_qkv:  # as a model's fused projection hands them over
        qkv = torch.cat([q.flatten(1), k_new.flatten(1), v_new.flatten(1)], dim=1)
        q, k_new, v_new = (t.view(total, -1, d) for t in qkv.split(
            (heads * d, kv_heads * d, kv_heads * d), dim=1))
    md = backend.build_metadata(spans)
    on_dev = KVCache(1, num_blocks, bs, kv_heads, d, dtype, dev)
    on_dev.data.copy_(cache.data)
    out = backend.forward(q.to(dev), k_new.to(dev), v_new.to(dev), on_dev.key(0),
                          on_dev.value(0), md, d**-0.5).cpu()
    cache.data.copy_(on_dev.data)

    row = 0
    for (start, n), (keys, values), span in zip(shapes, history, spans):
        want = _reference(q[row : row + n].float(), keys.float(), values.float(), start)
        torch.testing.assert_close(out[row : row + n].float(), want, rtol=tol, atol=tol)
        # The new K/V landed in the slots the block table names.
        for pos in range(start, start + n):
            b, off = span.block_table[pos // bs], pos % bs
            torch.testing.assert_close(cache.key(0)[b, off], keys[pos])
            torch.testing.assert_close(cache.value(0)[b, off], values[pos])
        row += n


@pytest.mark.parametrize("backend_name", ["torch", "compiled", "cpp", "triton"])
@pytest.mark.parametrize("shapes", [MIXED, EQUAL, NARROW, LONE],
                         ids=["mixed", "equal-context", "narrow", "lone-decode"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_dense(
    heads: int, kv_heads: int, shapes: list[tuple[int, int]], backend_name: str
) -> None:
    _check_backend(backend_name, heads, kv_heads, shapes)


# Contexts of several decode tiles: the Triton backend splits them (split-K)
# and merges the parts; prefill chunks of more than one query tile, one of
# them continuing a long context.
LONG = [(300, 1), (130, 1), (5, 1), (0, 70), (150, 80)]


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_long_contexts_and_query_tiles(backend_name: str) -> None:
    _check_backend(backend_name, 4, 2, LONG, d=16, bs=16, num_blocks=64)


@pytest.mark.parametrize("heads,kv_heads,shapes,rows", [
    (4, 2, MIXED, 16), (6, 1, NARROW, 16), (9, 3, MIXED, 16), (8, 8, EQUAL, 16),
    (9, 3, MIXED, 64), (4, 2, LONG, 64)])
def test_triton_deterministic_kernel_matches_dense(
    heads: int, kv_heads: int, shapes: list[tuple[int, int]], rows: int
) -> None:
    # One kernel for decodes and prefill chunks; query tiles of whole
    # groups (5 tokens x 3 heads in SmolLM2's 9/3 layout, 2 x 8 for MHA;
    # with 64 rows, 21 x 3 and 32 x 2: chunks of several tiles, tiles that
    # hold the end of one chunk only).
    # Contexts of many key tiles run on CUDA (test_triton_on_cuda_at_model_scale).
    _check_backend("triton", heads, kv_heads, shapes, d=16, bs=8, num_blocks=96,
                   deterministic=True, deterministic_rows=rows)


@pytest.mark.parametrize("rows", [8, 24])
def test_triton_deterministic_rows_are_a_power_of_two_of_16_or_more(rows: int) -> None:
    with pytest.raises(ValueError, match="deterministic_rows"):
        get_attention_backend("triton")(4, 2, 16, 8, torch.device("cpu"), deterministic=True,
                                        deterministic_rows=rows)


def test_triton_splits_long_decode_contexts() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = get_attention_backend("triton")(4, 2, 16, 16, dev)
    md = backend.build_metadata([SeqSpan(s, n, list(range(-(-(s + n) // 16))))
                                 for s, n in LONG])
    assert md.decode_num_splits > 1
    assert md.decode_split_len * md.decode_num_splits >= 301


def test_triton_bfloat16_and_fused_projection_views() -> None:
    # A head dim that is not a power of two, K/V as strided views of one
    # fused projection, bf16 operands (float32 accumulation).
    _check_backend("triton", 6, 2, LONG[1:], d=24, bs=8, num_blocks=96,
                   dtype=torch.bfloat16, tol=2e-2, views_of_qkv=True)


def test_rejects_short_block_table() -> None:
    backend = get_attention_backend("torch")(2, 2, 4, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot hold"):
        backend.build_metadata([SeqSpan(4, 2, [0])])


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("triton-someday")


def test_kv_cache_layout() -> None:
    cache = KVCache(3, 10, 4, 2, 8, torch.bfloat16, "cpu")
    assert cache.key(1).shape == (10, 4, 2, 8)
    assert cache.value(2).dtype == torch.bfloat16
    assert cache.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2
    assert cache.nbytes == cache.bytes_per_block * 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_on_cuda_at_model_scale(dtype: torch.dtype, tol: float) -> None:
    # A Llama-3-8B attention shape: 32 query heads over 8 KV heads of 128.
    shapes = [(1000, 1), (37, 1), (513, 1), (2047, 1), (0, 300), (700, 200), (64, 17)]
    for deterministic in (False, True):
        _check_backend("triton", 32, 8, shapes, d=128, bs=16, num_blocks=512, dtype=dtype,
                       tol=tol, deterministic=deterministic)
