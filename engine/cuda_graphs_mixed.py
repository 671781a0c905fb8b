"""Mixed iterations (prefill chunks beside decodes) replayed from CUDA graphs.

Decode-only steps replay `engine.cuda_graphs.DecodeGraphs`.  A step that
carries a prefill chunk (a new prompt, the next chunk of a long one, a
recompute after preemption) used to run op by op: on an H200 with a
Llama-3.2-1B shape such a step of up to ~640 tokens cost 6-9 ms, host-bound,
against 1.7-4.8 ms replayed from a graph (`studies/engine_gpu`), and a
burst of arrivals makes most steps mixed.  `MixedGraphs` captures the forward pass and the lm_head once
per bucket of step tokens (padded), and a step replays the smallest bucket
that holds its tokens.

What makes a mixed step capturable is that no launch depends on the mix:

- the decode kernel is launched for `max_spans` rows whatever the step's
  decodes; a row past them has context 0 and exits at once;
- the prefill kernel runs over a flat list of query tiles (each tile names
  its first token, rows, first position and block-table row), launched for
  the most tiles a bucket's tokens can make (`tokens / TILE_M + max_spans`);
  the unused tiles have 0 rows and exit;
- the lm_head reads `max_spans` rows (the step's sampled rows, then row 0);
- padding tokens have slot -1 (the KV store skips them) and belong to no
  span: nothing attends to them, and every other operation of the forward
  pass is row by row, so they change no real row's result.

Each bucket's decode split is fixed at capture for `max_spans` rows
(`graph_decode_split`), as in the decode graphs.  Deterministic mode does
not use these graphs (its attention launch depends on the longest chunk).
Steps with prompt logprobs, LoRA steps, speculative-verify steps, steps cut
between layers, and steps larger than the largest bucket run op by op.  On
a CPU device (the test suite, under Triton's interpreter) nothing is
captured and `run` executes the bucket's forward over the same buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention import SeqSpan
from engine.attention_triton import (
    PREFILL_TILE_M,
    TritonAttentionBackend,
    TritonAttentionMetadata,
    prefill_tiles,
    span_layout,
)
from engine.cuda_graphs import Fill, StagedGraphs
from engine.kv_cache import KVCache
from engine.models import CausalLM, ForwardBatch
from engine.table_rows import TableRows

# Step sizes in tokens captured (those below the largest, plus the largest).
# Above a few hundred tokens the matmuls are compute-bound, so a padding
# token costs about what a real one does: there the steps are 128 tokens
# apart (a 2,175-token step padded to 2,560 replayed slower than op by op
# on an H200, `studies/engine_gpu/mixed_step.json`), 512 past 4,096.
TOKEN_BUCKETS = ((16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
                 + tuple(range(640, 4097, 128)) + tuple(range(4608, 16385, 512)))


@dataclass(slots=True)
class _Bucket:
    tokens: int
    tiles: int
    batch: ForwardBatch
    graph: torch.cuda.CUDAGraph | None = None
    # The captured final hidden states `[max_spans, hidden]` and lm_head
    # output `[max_spans, vocab]` (float32).
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class MixedGraphs(StagedGraphs):
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        attn: TritonAttentionBackend,
        max_spans: int,
        max_tokens: int,
        max_model_len: int,
        pool: Any = None,
    ) -> None:
        if max_spans < 1 or max_tokens < 2:
            raise ValueError(f"mixed graphs need max_spans >= 1 and max_tokens >= 2, got "
                             f"{max_spans} and {max_tokens}")
        if attn.deterministic:
            raise ValueError("deterministic mode replays decode-only steps only")
        spans, tokens = max_spans, max_tokens
        self.max_spans, self.max_tokens = max_spans, max_tokens
        self.width = -(-max_model_len // kv_cache.block_size)
        self.max_tiles = -(-max_tokens // PREFILL_TILE_M) + max_spans
        # The host buffer's block-table rows keep what the last step wrote.
        self._table_rows = TableRows(max_spans)
        # Static inputs: token ids | positions | logits rows (int64), then
        # one int32 buffer of slots | decode contexts | block tables | tiles.
        super().__init__(model, kv_cache, 2 * tokens + spans,
                         tokens + spans * (1 + self.width) + 4 * self.max_tiles)
        ids, pos, rows = self._long.split([tokens, tokens, spans])
        slots, ctx, tables, tiles = self._meta.split(
            [tokens, spans, spans * self.width, 4 * self.max_tiles])
        split_len, splits = attn.graph_decode_split(spans, max_model_len)
        part_out, part_lse = attn.split_buffers(spans, splits)
        sizes = [t for t in TOKEN_BUCKETS if t < max_tokens] + [max_tokens]
        self._buckets: list[_Bucket] = []
        for size in sizes:
            n_tiles = min(-(-size // PREFILL_TILE_M) + min(spans, size), self.max_tiles)
            md = TritonAttentionMetadata(
                slot_mapping=slots[:size], block_tables=tables.view(spans, self.width),
                num_decodes=spans, decode_context=ctx, decode_split_len=split_len,
                decode_num_splits=splits, decode_part_out=part_out, decode_part_lse=part_lse,
                prefill_tiles=tiles.view(4, self.max_tiles), num_prefill_tiles=n_tiles,
            )
            self._buckets.append(_Bucket(size, n_tiles, ForwardBatch(
                input_ids=ids[:size], positions=pos[:size], attn_metadata=md,
                logits_indices=rows)))
        self._pad_all()
        self._capture(self._buckets, pool)

    # Host staging ---------------------------------------------------------

    def _host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                             np.ndarray, np.ndarray]:
        """Numpy views of the host staging buffers: ids, positions, logits
        rows, slots, decode contexts, block tables, tiles."""
        t, s = self.max_tokens, self.max_spans
        lng = self._host_long.numpy()
        meta = self._host_meta.numpy()
        tables = meta[t + s : t + s + s * self.width].reshape(s, self.width)
        tiles = meta[t + s + s * self.width :].reshape(4, self.max_tiles)
        return lng[:t], lng[t : 2 * t], lng[2 * t :], meta[:t], meta[t : t + s], tables, tiles

    def _pad_all(self) -> None:
        ids, pos, rows, slots, ctx, _tables, tiles = self._host()
        ids[:] = 0
        pos[:] = 0
        rows[:] = 0
        slots[:] = -1
        ctx[:] = 0
        tiles[:] = 0

    # Steps ------------------------------------------------------------------

    def _bucket(self, num_tokens: int) -> _Bucket | None:
        return next((b for b in self._buckets if b.tokens >= num_tokens), None)

    def fits(self, num_tokens: int, num_spans: int, num_rows: int) -> bool:
        """Whether a step of `num_tokens` tokens in `num_spans` spans, with
        `num_rows` logits rows, can replay a bucket."""
        return (num_spans <= self.max_spans and num_rows <= self.max_spans
                and num_tokens <= self.max_tokens)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The captured step size a step of `num_tokens` tokens runs in."""
        bucket = self._bucket(num_tokens)
        return None if bucket is None else bucket.tokens

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[SeqSpan],
        logits_indices: Sequence[int],
        fill: Fill = None,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` (float32) of a step whose
        tokens are laid out as `spans` (decodes first); `fill` as in
        `DecodeGraphs.run`."""
        n, num = len(input_ids), len(spans)
        bucket = self._bucket(n)
        if bucket is None or n == 0 or not self.fits(n, num, len(logits_indices)):
            raise ValueError(f"a step of {n} tokens in {num} spans with {len(logits_indices)} "
                             f"logits rows does not fit the captured buckets (max "
                             f"{self.max_tokens} tokens, {self.max_spans} spans)")
        self._staging()
        ids, pos, rows, slots, ctx, tables, tiles = self._host()
        lay = span_layout(spans, self.kv_cache.block_size, self.width, tables, self._table_rows)
        nd, size = lay.num_decodes, bucket.tokens
        ids[:n] = input_ids
        ids[n:size] = 0
        pos[:n] = positions
        pos[n:size] = 0
        k = len(logits_indices)
        rows[:k] = logits_indices
        rows[k:] = 0
        slots[:n] = lay.slots
        slots[n:size] = -1
        ctx[:nd] = lay.ctx[:nd]
        ctx[nd:] = 0
        pre = slice(nd, num)
        new = prefill_tiles(lay.first[pre], lay.ntok[pre], lay.start[pre], np.arange(nd, num))
        used = new.shape[1]
        assert used <= bucket.tiles
        tiles[:, :used] = new
        tiles[1, used : bucket.tiles] = 0
        return self._run(bucket, k, fill)
