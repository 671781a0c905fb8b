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


@pytest.mark.parametrize("backend_name", ["torch", "compiled", "cpp"])
@pytest.mark.parametrize("shapes", [MIXED, EQUAL, NARROW, LONE],
                         ids=["mixed", "equal-context", "narrow", "lone-decode"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_dense(
    heads: int, kv_heads: int, shapes: list[tuple[int, int]], backend_name: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    d, bs, num_blocks = 8, 4, 64
    cache = KVCache(1, num_blocks, bs, kv_heads, d, torch.float32, "cpu")
    backend = get_attention_backend(backend_name)(heads, kv_heads, d, bs, torch.device("cpu"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    history = []  # full K/V of each sequence, the dense truth
    spans = []
    for start, n in shapes:
        ctx = start + n
        table = [free.pop() for _ in range(-(-ctx // bs))]
        keys = torch.randn(ctx, kv_heads, d, generator=gen)
        values = torch.randn(ctx, kv_heads, d, generator=gen)
        # Earlier tokens were written by earlier steps.
        for pos in range(start):
            cache.key(0)[table[pos // bs], pos % bs] = keys[pos]
            cache.value(0)[table[pos // bs], pos % bs] = values[pos]
        history.append((keys, values))
        spans.append(SeqSpan(start, n, table))

    total = sum(n for _, n in shapes)
    q = torch.randn(total, heads, d, generator=gen)
    k_new = torch.cat([kv[0][s:] for (s, _), kv in zip(shapes, history)])
    v_new = torch.cat([kv[1][s:] for (s, _), kv in zip(shapes, history)])
    md = backend.build_metadata(spans)
    out = backend.forward(q, k_new, v_new, cache.key(0), cache.value(0), md, d**-0.5)

    row = 0
    for (start, n), (keys, values), span in zip(shapes, history, spans):
        want = _reference(q[row : row + n], keys, values, start)
        torch.testing.assert_close(out[row : row + n], want, rtol=1e-5, atol=1e-5)
        # The new K/V landed in the slots the block table names.
        for pos in range(start, start + n):
            b, off = span.block_table[pos // bs], pos % bs
            torch.testing.assert_close(cache.key(0)[b, off], keys[pos])
            torch.testing.assert_close(cache.value(0)[b, off], values[pos])
        row += n


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
