"""Paged attention in Triton: the CUDA default backend.

This builds each step's metadata and launches the kernels of
`engine/attention_triton_kernels.py`: a fused K/V store, paged decode
attention split over long contexts and merged by log-sum-exp, and causal
prefill / chunked-prefill / recompute attention over the paged cache.

Metadata is built on the host with numpy in one int32 array and copied to
the device in one transfer.  The decode kernel's reductions run in an order
set by the split length, which depends on the batch (to fill the GPU), and
the prefill kernel's tiles differ from the decode kernel's, so a token's
attention rounds differently as a decode than in a recompute.
Deterministic mode replaces both with `_paged_rows`, one kernel for every
query token whose result depends on its own query and context alone.  The
price is no split-K for a few long decodes and a prefill that re-reads K/V
per few query tokens (`studies/engine_gpu`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton

from engine.attention import AttentionBackend, AttentionMetadata, SeqSpan
from engine.attention_triton_kernels import (
    _merge_splits,
    _paged_decode,
    _paged_prefill,
    _paged_rows,
    _store_kv,
)
from engine.table_rows import TableRows, fill_block_tables

# Keys per inner iteration of the decode kernel, and per split at least.
DECODE_TILE = 64
# Query rows and keys per tile of the prefill kernel, its warps and stages.
PREFILL_TILE_M = 64
PREFILL_TILE_N = 64
PREFILL_WARPS = 4
PREFILL_STAGES = 3
# Warps per decode program, and the depth of its software pipeline.
DECODE_WARPS = 4
DECODE_STAGES = 3
# Programs the decode kernel aims for before it splits contexts: a few per
# multiprocessor, so that loads of one hide the latency of another's.
PROGRAMS_PER_SM = 4
# Deterministic mode's query tile (`_paged_rows`), in (token, head) rows: at
# least a KV head's group.  Every token, decoded or prefilled, rides in a tile
# of this one shape, so a larger tile cuts how often a prompt's K/V are read
# (once per tile's tokens) at the price of padding rows in every decode.
DETERMINISTIC_ROWS = 16


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    # [T] int32: flat cache row (block * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [spans, max_blocks] int32 block ids, decodes' rows first, padded with 0.
    block_tables: torch.Tensor
    num_decodes: int
    # [decodes] int32 context lengths.
    decode_context: torch.Tensor
    decode_split_len: int
    decode_num_splits: int
    # With more than one split: each split's normalised result
    # `[decodes, heads, splits, BLOCK_D]` and log-sum-exp `[decodes, heads,
    # splits]` (float32), allocated once for the step's layers.
    decode_part_out: torch.Tensor | None
    decode_part_lse: torch.Tensor | None
    # The prefill kernel's tiles (`prefill_tiles`): `[4, stride]` int32, the
    # first `num_prefill_tiles` columns launched (padding tiles have 0 rows).
    prefill_tiles: torch.Tensor
    num_prefill_tiles: int
    # Deterministic mode, every span: [spans] int32 first token in the
    # batch, query tokens, context length after the step (None otherwise).
    span_q_start: torch.Tensor | None = None
    span_q_len: torch.Tensor | None = None
    span_context: torch.Tensor | None = None
    max_q: int = 0


def prefill_tiles(
    first: np.ndarray, ntok: np.ndarray, start: np.ndarray, table_rows: np.ndarray,
    tile_m: int = PREFILL_TILE_M,
) -> np.ndarray:
    """The prefill kernel's tiles of chunks with first batch token `first`,
    `ntok` query tokens, first position `start` and block-table row
    `table_rows`: `[4, tiles]` int64 (first token, rows, first position,
    table row of each tile of up to `tile_m` query rows)."""
    per = -(-ntok // tile_m)
    chunk = np.repeat(np.arange(ntok.size), per)
    off = (np.arange(chunk.size) - np.repeat(np.cumsum(per) - per, per)) * tile_m
    return np.stack([first[chunk] + off, np.minimum(tile_m, ntok[chunk] - off),
                     start[chunk] + off, table_rows[chunk]])


@dataclass(slots=True)
class SpanLayout:
    """A step's spans as arrays (int64, span order): where each starts, its
    query tokens, its context after the step, its first token in the batch;
    the block tables `[spans, width]`; each new token's cache slot."""

    start: np.ndarray
    ntok: np.ndarray
    ctx: np.ndarray
    first: np.ndarray
    tables: np.ndarray
    slots: np.ndarray
    num_decodes: int


def span_layout(spans: Sequence[SeqSpan], block_size: int, width: int | None = None,
                tables: np.ndarray | None = None, rows: TableRows | None = None) -> SpanLayout:
    """Lay out `spans` (decodes first), checking that every block table
    holds its context; block tables `width` blocks wide (None: as wide as
    the longest needs), written into `tables` where given (through `rows`,
    which knows what that buffer's rows already hold, where given)."""
    bs, num = block_size, len(spans)
    start = np.fromiter((s.start_pos for s in spans), np.int64, num)
    ntok = np.fromiter((s.num_tokens for s in spans), np.int64, num)
    ctx = start + ntok
    need = -(-ctx // bs)
    have = np.fromiter((len(s.block_table) for s in spans), np.int64, num)
    short = np.flatnonzero(have < need)
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of {int(have[i])} blocks cannot hold {int(ctx[i])} "
                         f"tokens (block_size {bs})")
    is_decode = ntok == 1
    num_decodes = int(is_decode.sum())
    if num_decodes and not is_decode[:num_decodes].all():
        raise ValueError("single-token spans must precede multi-token spans")
    longest = int(need.max()) if num else 1
    if width is None:
        width = longest
    elif longest > width:
        raise ValueError(f"a context of {int(ctx.max())} tokens exceeds the captured block "
                         f"tables ({width} blocks)")
    if tables is None:
        tables = np.zeros((num, width), np.int32)
        rows = None
    if rows is not None:
        rows.fill(tables, spans, need)
    else:
        fill_block_tables(tables, spans, need)
    # Each new token's slot, from its span's table row and position.
    total = int(ntok.sum())
    owner = np.repeat(np.arange(num), ntok)
    first = np.cumsum(ntok) - ntok
    pos = start[owner] + np.arange(total) - first[owner]
    slots = tables[owner, pos // bs].astype(np.int64) * bs + pos % bs
    return SpanLayout(start, ntok, ctx, first, tables[:num], slots, num_decodes)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # With `deterministic`, through `_paged_rows`.
    batch_invariant = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
        device: torch.device, deterministic: bool = False, dtype: torch.dtype | None = None,
        deterministic_rows: int = DETERMINISTIC_ROWS,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device, deterministic,
                         dtype)
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention backend 'triton' runs on CUDA devices, not {device.type!r} "
                "(on CPU tensors only under TRITON_INTERPRET=1, for tests)")
        self.group = num_heads // num_kv_heads
        self.block_d = max(16, triton.next_power_of_2(head_dim))
        # tl.dot needs at least 16 rows: a small group rides in a padded tile.
        self.block_g = max(16, triton.next_power_of_2(self.group))
        # Deterministic mode's query tile: as many whole groups as fit.
        if deterministic_rows < 16 or deterministic_rows & (deterministic_rows - 1):
            raise ValueError(f"deterministic_rows must be a power of two of at least 16, "
                             f"not {deterministic_rows}")
        self.block_r = max(self.block_g, deterministic_rows)
        self.row_tokens = self.block_r // self.group
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)

    def build_metadata(self, spans: Sequence[SeqSpan]) -> TritonAttentionMetadata:
        lay = span_layout(spans, self.block_size)
        num, num_decodes, tables = len(spans), lay.num_decodes, lay.tables
        width = tables.shape[1]
        start, ntok, ctx, first, slots = lay.start, lay.ntok, lay.ctx, lay.first, lay.slots
        prefill = slice(num_decodes, num)
        # Deterministic mode attends every span with `_paged_rows` instead.
        tiles = (np.zeros((4, 0), np.int64) if self.deterministic else prefill_tiles(
            first[prefill], ntok[prefill], start[prefill], np.arange(num_decodes, num)))
        if self.deterministic:
            split_len, num_splits = DECODE_TILE, 1
        else:
            split_len, num_splits = self._decode_split(
                num_decodes, int(ctx[:num_decodes].max()) if num_decodes else 0)
        parts = [
            slots.astype(np.int32), tables.ravel(), ctx[:num_decodes].astype(np.int32),
            tiles.astype(np.int32).ravel(),
        ]
        if self.deterministic:
            parts += [first.astype(np.int32), ntok.astype(np.int32), ctx.astype(np.int32)]
        host = np.concatenate(parts)
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        cuts = np.cumsum([p.size for p in parts[:-1]])
        slot_t, tables_t, ctx_t, tiles_t, *span = torch.tensor_split(dev, cuts.tolist())
        part_out, part_lse = self.split_buffers(num_decodes, num_splits)
        span_q_start, span_q_len, span_ctx = span if span else (None, None, None)
        return TritonAttentionMetadata(
            slot_mapping=slot_t,
            block_tables=tables_t.view(num, width),
            num_decodes=num_decodes,
            decode_context=ctx_t,
            decode_split_len=split_len,
            decode_num_splits=num_splits,
            decode_part_out=part_out,
            decode_part_lse=part_lse,
            prefill_tiles=tiles_t.view(4, tiles.shape[1]),
            num_prefill_tiles=tiles.shape[1],
            span_q_start=span_q_start,
            span_q_len=span_q_len,
            span_context=span_ctx,
            max_q=int(ntok.max()) if num else 0,
        )

    def split_buffers(
        self, num_decodes: int, splits: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The split partials' buffers (None, None with one split)."""
        if num_decodes == 0 or splits == 1:
            return None, None
        shape = (num_decodes, self.num_heads, splits)
        return (torch.empty(*shape, self.block_d, dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.float32, device=self.device))

    def graph_decode_split(self, batch: int, max_model_len: int) -> tuple[int, int]:
        """(tokens per split, splits) fixed for a captured decode graph of
        `batch` rows, whose contexts are unknown at capture: one tile per
        split where the batch alone does not fill the GPU (splits past a
        context's end exit at once), else no split; at most 256 splits."""
        tiles = -(-max_model_len // DECODE_TILE)
        if batch * self.num_kv_heads >= PROGRAMS_PER_SM * self.num_sms:
            split_len = tiles * DECODE_TILE
        else:
            split_len = -(-tiles // 256) * DECODE_TILE
        return split_len, -(-max_model_len // split_len)

    def _decode_split(self, num_decodes: int, max_context: int) -> tuple[int, int]:
        """(tokens per split, splits) for the step's decodes: split the
        contexts until the launch has a few programs per multiprocessor,
        but never below one tile per split."""
        if not num_decodes:
            return DECODE_TILE, 1
        programs = num_decodes * self.num_kv_heads
        want = max(1, -(-PROGRAMS_PER_SM * self.num_sms // programs))
        tiles = -(-max_context // DECODE_TILE)
        splits = min(want, tiles)
        split_len = -(-tiles // splits) * DECODE_TILE
        return split_len, -(-max_context // split_len)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TritonAttentionMetadata)
        md = metadata
        dev = q.device
        hd, kvh, bd = self.head_dim, self.num_kv_heads, self.block_d
        # float32 dots in full precision (Triton's default for them is tf32).
        precision = "ieee" if q.dtype is torch.float32 else None
        q = q.contiguous()
        # The interpreter's dot multiplies bf16/fp16 bit patterns as
        # integers: there, operands go to float32 first (after the same
        # rounding of the softmax weights as on the GPU).
        interpreted = dev.type == "cpu"
        tokens = q.shape[0]
        if tokens:
            _store_kv[(tokens, kvh)](
                k, v, key_cache, value_cache, md.slot_mapping,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                HEAD_DIM=hd, BLOCK_D=bd, NUM_KV_HEADS=kvh,
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=dev)
        if self.deterministic:
            if md.max_q:
                assert md.span_q_len is not None
                tiles = -(-md.max_q // self.row_tokens)
                _paged_rows[(md.span_q_len.shape[0], kvh, tiles)](
                    q, key_cache, value_cache, md.block_tables, md.span_q_start,
                    md.span_q_len, md.span_context, out,
                    scale, q.stride(0), q.stride(1), md.block_tables.stride(0),
                    HEAD_DIM=hd, BLOCK_D=bd, NUM_KV_HEADS=kvh, GROUP=self.group,
                    BLOCK_R=self.block_r, TOKENS=self.row_tokens, BLOCK_SIZE=self.block_size,
                    TILE_N=DECODE_TILE, PRECISION=precision, DOT_F32=interpreted,
                    num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
                )
            return out
        nd = md.num_decodes
        if nd:
            splits = md.decode_num_splits
            # One split writes `out` directly: the partials' pointers go unused.
            part_out = out if md.decode_part_out is None else md.decode_part_out
            part_lse = out if md.decode_part_lse is None else md.decode_part_lse
            _paged_decode[(nd, kvh, splits)](
                q, key_cache, value_cache, md.block_tables, md.decode_context,
                out, part_out, part_lse,
                scale, q.stride(0), q.stride(1), md.block_tables.stride(0), md.decode_split_len,
                HEAD_DIM=hd, BLOCK_D=bd, NUM_KV_HEADS=kvh, GROUP=self.group,
                BLOCK_G=self.block_g, BLOCK_SIZE=self.block_size, TILE_N=DECODE_TILE,
                NUM_SPLITS=splits, PRECISION=precision, DOT_F32=interpreted,
                num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
            )
            if splits > 1:
                _merge_splits[(nd, self.num_heads)](
                    out, part_out, part_lse, md.decode_context, md.decode_split_len,
                    out.stride(0), out.stride(1),
                    HEAD_DIM=hd, BLOCK_D=bd, NUM_HEADS=self.num_heads, NUM_SPLITS=splits,
                    TILE_S=min(16, triton.next_power_of_2(splits)),
                )
        if md.num_prefill_tiles:
            _paged_prefill[(md.num_prefill_tiles, self.num_heads)](
                q, key_cache, value_cache, md.block_tables, md.prefill_tiles,
                md.prefill_tiles.stride(0), out, scale, q.stride(0), q.stride(1),
                md.block_tables.stride(0),
                HEAD_DIM=hd, BLOCK_D=bd, NUM_KV_HEADS=kvh, GROUP=self.group,
                BLOCK_SIZE=self.block_size, TILE_M=PREFILL_TILE_M, TILE_N=PREFILL_TILE_N,
                PRECISION=precision, DOT_F32=interpreted,
                num_warps=PREFILL_WARPS, num_stages=PREFILL_STAGES,
            )
        return out
