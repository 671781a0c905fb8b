"""The Triton kernels of the paged-attention backend (engine/attention_triton.py).

All read the paged cache through the step's block tables (no gather into a
padded copy, no mask tensor):

- `_store_kv`: writes every new token's K and V into the slot its block
  table names (one launch for both).
- `_paged_decode`: one program per (decode, KV head, context split) attends
  the KV head's whole query group (grouped-query attention without
  repeating K/V) over its split of the context with an online softmax.
  With more than one split, `_merge_splits` combines the partial results by
  their log-sum-exp: a batch of few sequences still spreads over the GPU's
  multiprocessors (split-K, as FlashDecoding).
- `_paged_prefill`: one program per (tile of a chunk's query rows, query
  head) attends over the chunk's whole context in the cache, causally.  The
  same kernel serves a fresh prompt, a later chunk of a chunked prefill and
  a recompute after preemption: the chunk's own K/V were stored first.
- `_paged_rows` (deterministic mode): every query token, of a decode or of
  a prefill chunk, attended by the same code over the same key tiles, from
  position 0, never split, in a query tile of (token, head of the group)
  rows.  A row's result depends on its own query and context alone: the
  matrix units compute each row of a product from that row only, key tiles
  past a row's position are masked to exact zeros (they add 0 and rescale
  by exp(0) = 1), and the tile shape, hence the kernel's layout and
  reduction trees, is one constant.

On CUDA they are compiled by Triton.  On CPU tensors they run only under
Triton's interpreter (`TRITON_INTERPRET=1` in the environment before Triton
is first imported), which is slow and meant for the test suite.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kv(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # A negative slot is a padding row of a captured graph: nothing to store.
    mask = (d < HEAD_DIM) & (d * 0 + slot >= 0)
    dest = slot * (NUM_KV_HEADS * HEAD_DIM) + head * HEAD_DIM + d
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(key_cache_ptr + dest, k, mask=mask)
    tl.store(value_cache_ptr + dest, v, mask=mask)


@triton.jit
def _attend_keys(
    q, key_cache_ptr, value_cache_ptr, table, kv_head, n, n_mask, allowed,
    m_i, l_i, acc, scale, d, d_mask,
    HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Fold keys at positions `n` (a tile; `n_mask` those in range,
    `allowed` `[rows, keys]` the pairs that may attend) into the rows'
    online softmax (m_i, l_i, acc), reading K/V through the block table."""
    block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0)
    row = ((block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
           + kv_head * HEAD_DIM)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(key_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(value_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    p = p.to(v.dtype)
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_causal(
    q, q_pos, end, key_cache_ptr, value_cache_ptr, table, kv_head, scale, d, d_mask,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Attention of `ROWS` query rows at positions `q_pos` over keys
    `[0, end)`, each row causally: key tiles of TILE_N from position 0."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(0, end, TILE_N):
        n = n0 + tl.arange(0, TILE_N)
        n_mask = n < end
        causal = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _attend_keys(
            q, key_cache_ptr, value_cache_ptr, table, kv_head, n, n_mask, causal,
            m_i, l_i, acc, scale, d, d_mask, HEAD_DIM, NUM_KV_HEADS, BLOCK_SIZE, PRECISION,
            DOT_F32)
    return acc / l_i[:, None]


@triton.jit
def _paged_decode(
    q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, ctx_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale, stride_qt, stride_qh, stride_table, split_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * split_len
    if start >= ctx:
        return
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + seq * stride_table
    for n0 in range(start, end, TILE_N):
        n = n0 + tl.arange(0, TILE_N)
        n_mask = n < end
        m_i, l_i, acc = _attend_keys(
            q, key_cache_ptr, value_cache_ptr, table, kv_head, n, n_mask, n_mask[None, :],
            m_i, l_i, acc, scale, d, d_mask, HEAD_DIM, NUM_KV_HEADS, BLOCK_SIZE, PRECISION,
            DOT_F32)

    out = acc / l_i[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: [decodes, heads, NUM_SPLITS, BLOCK_D] and [.., NUM_SPLITS].
        part = (seq * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log(l_i), mask=g_mask)


@triton.jit
def _merge_splits(
    out_ptr, part_out_ptr, part_lse_ptr, ctx_ptr, split_len,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, TILE_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    if ctx == 0:
        return  # a padding row of a captured graph
    used = tl.cdiv(ctx, split_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    # The splits' results weighted by their softmax mass, TILE_S at a time
    # with a running maximum (a graph's launch has up to 256 splits).
    m = tl.max(tl.full([TILE_S], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([TILE_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, used, TILE_S):
        s = s0 + tl.arange(0, TILE_S)
        s_mask = s < used
        lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        rescale = tl.exp(m - m_new)
        w = tl.where(s_mask, tl.exp(lse - m_new), 0.0)
        parts = tl.load(part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * rescale + tl.sum(parts * w[:, None], 0)
        total = total * rescale + tl.sum(w, 0)
        m = m_new
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d,
             (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _paged_prefill(
    q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, tiles_ptr, tiles_stride,
    out_ptr, scale, stride_qt, stride_qh, stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One program per (tile of up to TILE_M query rows of one chunk, query
    head).  `tiles_ptr` holds four rows of `tiles_stride` int32: each tile's
    first token in the batch, its query rows (0: a padding tile of a
    captured graph, which exits), the position of its first row, and its
    chunk's row in the block tables.  A flat list of tiles keeps the launch
    as large as the step's work, whatever the mix of chunk lengths."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    num_q = tl.load(tiles_ptr + tiles_stride + tile)
    if num_q == 0:
        return
    token0 = tl.load(tiles_ptr + tile)
    pos0 = tl.load(tiles_ptr + 2 * tiles_stride + tile)
    table_row = tl.load(tiles_ptr + 3 * tiles_stride + tile).to(tl.int64)
    kv_head = head // GROUP

    m = tl.arange(0, TILE_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < num_q
    d_mask = d < HEAD_DIM
    q_pos = pos0 + m
    q = tl.load(
        q_ptr + (token0 + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    # Keys up to the tile's last query row (causal), within the context.
    end = pos0 + num_q
    out = _attend_causal(
        q, q_pos, end, key_cache_ptr, value_cache_ptr, tables_ptr + table_row * stride_table,
        kv_head, scale, d, d_mask, TILE_M, BLOCK_D, HEAD_DIM, NUM_KV_HEADS, BLOCK_SIZE, TILE_N,
        PRECISION, DOT_F32)
    tl.store(out_ptr + (token0 + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_rows(
    q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr,
    out_ptr, scale, stride_qt, stride_qh, stride_table,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Batch-invariant attention (deterministic mode): one program per
    (span, KV head, TOKENS query tokens); its BLOCK_R rows are those
    tokens' heads of the KV head's group.  Decodes and prefill chunks alike."""
    span = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    num_q = tl.load(q_len_ptr + span)
    if tile * TOKENS >= num_q:
        return
    token0 = tl.load(q_start_ptr + span)
    start_pos = tl.load(ctx_ptr + span) - num_q

    r = tl.arange(0, BLOCK_R)
    t = tile * TOKENS + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < TOKENS * GROUP) & (t < num_q)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (token0 + t)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + rows, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    end = start_pos + tl.minimum((tile + 1) * TOKENS, num_q)
    out = _attend_causal(
        q, start_pos + t, end, key_cache_ptr, value_cache_ptr, tables_ptr + span * stride_table,
        kv_head, scale, d, d_mask, BLOCK_R, BLOCK_D, HEAD_DIM, NUM_KV_HEADS, BLOCK_SIZE, TILE_N,
        PRECISION, DOT_F32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None] & d_mask[None, :])
