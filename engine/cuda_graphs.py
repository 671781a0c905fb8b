"""Decode iterations replayed from CUDA graphs.

A decode step of a 8B model issues about a thousand small kernels; launched
one by one from Python they cost several times the step's device time (on
an H200, 20 ms a step against 7 ms of device work: `studies/engine_gpu`).
`DecodeGraphs` captures the forward pass and the lm_head of decode-only
iterations once per batch-size bucket at start, over static input buffers,
and replays the smallest bucket that holds a step's decodes: the host then
only copies the step's token ids, positions, cache slots, context lengths
and block tables into those buffers (two transfers) and launches one graph.

Rows past the step's decodes are padding: slot -1 (the KV store skips it),
context 1 over the first block of whatever block-table row they keep (any
block ids do), token 0; their logits are never read.  Each bucket's decode
split is fixed at capture (`graph_decode_split`), so a bucket covers any
context up to `max_model_len`.  In deterministic mode the buckets run the
batch-invariant kernels, so a replay rounds every row as the same step run
op by op would.

On a CPU device (the test suite, with the Triton backend under Triton's
interpreter) nothing is captured: `run` fills the same buffers and runs the
bucket's forward directly, which checks everything but the capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.attention import SeqSpan
from engine.attention_triton import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
)
from engine.kv_cache import KVCache
from engine.models import CausalLM, ForwardBatch
from engine.table_rows import TableRows

if TYPE_CHECKING:
    from engine.cuda_graphs_mixed import MixedGraphs
    from engine.prepared import PreparedStep

# Rows of a step's token ids and the ids, on the device, that replace them.
Fill = tuple[torch.Tensor, torch.Tensor] | None

# Batch sizes captured; a step runs in the smallest that holds it.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class Captured(Protocol):
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor | None
    logits: torch.Tensor | None


def capture(buckets: Sequence[Captured],
            forward: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
            device: torch.device, pool: Any = None) -> None:
    """Capture `forward(bucket)` of every bucket into its `graph`, its
    outputs into its `hidden` and `logits`: largest bucket last in `buckets`, captured
    first, all in one memory pool (`pool`, or a new one), so that a smaller
    graph reuses the larger one's activations, which it never needs at once.
    Graphs that share a pool must never be replayed concurrently."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    stream = torch.cuda.Stream(device)
    for bucket in reversed(buckets):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward(bucket)  # compiles the Triton kernels, warms cuBLAS
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            bucket.hidden, bucket.logits = forward(bucket)
        bucket.graph = graph
    torch.cuda.synchronize(device)


class StagedGraphs:
    """What the decode and the mixed-step graphs share: the model run over
    static device inputs (one int64 and one int32 buffer) that each step
    fills from pinned host copies, and buckets replayed from their graphs
    (or, off CUDA, run over the same buffers)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, long_size: int,
                 meta_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        dev, pin = self.device, self.device.type == "cuda"
        self._long = torch.zeros(long_size, dtype=torch.long, device=dev)
        self._meta = torch.zeros(meta_size, dtype=torch.int32, device=dev)
        self._host_long = torch.zeros(long_size, dtype=torch.long, pin_memory=pin)
        self._host_meta = torch.zeros(meta_size, dtype=torch.int32, pin_memory=pin)
        self._uploaded: torch.cuda.Event | None = None
        # Steps served from the buckets (replayed, or run over the buffers).
        self.num_runs = 0
        # The last step's final hidden states at its logits rows (a view of
        # the bucket's static output, valid until the next replay is queued):
        # the length head (engine/length_head.py) reads a prompt's last row.
        self.hidden: torch.Tensor | None = None

    def _staging(self) -> None:
        """Wait until the last upload has read the staging buffers: with a
        pass kept in flight (scheduler/ahead.py) the next step is staged
        before the device has reached this step's upload."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def _upload(self, fill: Fill = None) -> None:
        self._long.copy_(self._host_long, non_blocking=True)
        self._meta.copy_(self._host_meta, non_blocking=True)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))
        if fill is not None:
            # Token ids sampled by the pass in flight, on the device (the
            # ids lead the int64 buffer in both kinds of graphs).
            self._long.index_copy_(0, *fill)

    @torch.inference_mode()
    def _forward(self, bucket: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states at the bucket's logits rows, and their logits."""
        hidden = self.model(bucket.batch, self.kv_cache)
        logits = self.model.compute_logits(hidden)
        assert logits is not None, "graphs run unsplit models only"
        return hidden, logits

    def _capture(self, buckets: Sequence[Captured], pool: Any) -> None:
        """Fill the device buffers from the (padding) host ones, then
        capture every bucket on CUDA."""
        self._upload()
        if self.device.type == "cuda":
            capture(buckets, self._forward, self.device, pool)

    def _run(self, bucket: Any, rows: int, fill: Fill = None) -> torch.Tensor:
        """Upload the staged step and replay `bucket`: its first `rows`
        logits rows (their hidden states in `self.hidden`)."""
        self._upload(fill)
        self.num_runs += 1
        if bucket.graph is not None:
            bucket.graph.replay()
            hidden, logits = bucket.hidden, bucket.logits
            assert hidden is not None and logits is not None
        else:
            hidden, logits = self._forward(bucket)
        self.hidden = hidden[:rows]
        return logits[:rows]


@dataclass(slots=True)
class _Bucket:
    size: int
    batch: ForwardBatch
    graph: torch.cuda.CUDAGraph | None = None
    # The captured final hidden states `[size, hidden]` and lm_head output
    # `[size, vocab]` (float32).
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs(StagedGraphs):
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        attn: TritonAttentionBackend,
        max_batch: int,
        max_model_len: int,
        pool: Any = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        width = -(-max_model_len // kv_cache.block_size)
        # Static inputs: token ids and positions (int64), then one int32
        # buffer of slots | context lengths | block tables.
        super().__init__(model, kv_cache, 2 * max_batch, max_batch * (2 + width))
        self.attn = attn
        sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.width = width
        # The host buffer's block-table rows keep what the last step wrote.
        self._table_rows = TableRows(max_batch)
        dev, big = self.device, max_batch
        ids_pos = self._long.view(2, big)
        slots, ctx, tables = self._meta.split([big, big, big * self.width])
        tables = tables.view(big, self.width)
        no_prefill = torch.zeros(4, 0, dtype=torch.int32, device=dev)
        rows = torch.arange(big, device=dev)
        # Deterministic mode attends every row as a one-token span.
        span_rows = rows.to(torch.int32)
        ones = torch.ones(big, dtype=torch.int32, device=dev)
        det = attn.deterministic
        self._buckets: list[_Bucket] = []
        for size in sizes:
            split_len, splits = ((max_model_len, 1) if det
                                 else attn.graph_decode_split(size, max_model_len))
            part_out, part_lse = attn.split_buffers(size, splits)
            md = TritonAttentionMetadata(
                slot_mapping=slots[:size], block_tables=tables[:size], num_decodes=size,
                decode_context=ctx[:size], decode_split_len=split_len,
                decode_num_splits=splits, decode_part_out=part_out, decode_part_lse=part_lse,
                prefill_tiles=no_prefill, num_prefill_tiles=0,
                span_q_start=span_rows[:size] if det else None,
                span_q_len=ones[:size] if det else None,
                span_context=ctx[:size] if det else None,
                max_q=1 if det else 0,
            )
            self._buckets.append(_Bucket(size, ForwardBatch(
                input_ids=ids_pos[0, :size], positions=ids_pos[1, :size],
                attn_metadata=md, logits_indices=rows[:size])))
        self._pad(0, max_batch)
        self._capture(self._buckets, pool)

    def _pad(self, start: int, end: int) -> None:
        """Make rows `start:end` of the host staging buffers padding (their
        block-table rows may keep any block ids: a 1-token context reads one
        slot of the first)."""
        big = self.max_batch
        self._host_long.view(2, big)[:, start:end] = 0
        meta = self._host_meta.numpy()
        meta[start:end] = -1  # slots
        meta[big + start : big + end] = 1  # contexts

    def _bucket(self, num_decodes: int) -> _Bucket | None:
        return next((b for b in self._buckets if b.size >= num_decodes), None)

    def bucket_for(self, num_decodes: int) -> int | None:
        """The captured batch size a step of `num_decodes` decodes runs in."""
        bucket = self._bucket(num_decodes)
        return None if bucket is None else bucket.size

    def run(self, input_ids: Sequence[int], spans: Sequence[SeqSpan],
            fill: Fill = None) -> torch.Tensor:
        """Logits `[len(spans), vocab]` (float32) of a decode-only step, in
        span order; every span one token at position `start_pos`.  `fill`:
        (rows, ids) on the device that replace those rows' `input_ids`."""
        n = len(spans)
        bucket = self._bucket(n)
        if bucket is None or n == 0:
            raise ValueError(f"{n} decodes do not fit the captured buckets (max {self.max_batch})")
        big, bs, width = self.max_batch, self.kv_cache.block_size, self.width
        pos = np.fromiter((s.start_pos for s in spans), np.int64, n)
        need = pos // bs + 1
        if need.max() > width:
            raise ValueError(f"a decode at position {int(pos.max())} exceeds the captured "
                             f"block tables ({width} blocks)")
        self._staging()
        ids_pos = self._host_long.numpy().reshape(2, big)
        ids_pos[0, :n] = input_ids
        ids_pos[1, :n] = pos
        meta = self._host_meta.numpy()
        tables = meta[2 * big :].reshape(big, width)
        self._table_rows.fill(tables, spans, need)
        rows = np.arange(n)
        meta[:n] = tables[rows, pos // bs] * bs + pos % bs
        meta[big : big + n] = pos + 1
        # An earlier, larger step may have left real rows in this bucket's tail.
        self._pad(n, bucket.size)
        return self._run(bucket, n, fill)

    def replay_step(self, step: PreparedStep, mixed: MixedGraphs | None,
                    fill: Callable[[PreparedStep], Fill]) -> tuple[torch.Tensor,
                                                                   torch.Tensor] | None:
        """Logits and final hidden states at the logits rows of `step`,
        replayed from these graphs (a decode-only step that fits a bucket) or
        from `mixed` (a step that fits one of its buckets); None where neither
        holds it (it runs op by op).  `fill(step)`: as `run`'s `fill`."""
        n, num = len(step.input_ids), len(step.spans)
        staged: StagedGraphs
        if n == num == len(step.sampled) and self.bucket_for(num) is not None:
            logits, staged = self.run(step.input_ids, step.spans, fill(step)), self
        elif mixed is not None and mixed.fits(n, num, len(step.logits_indices)):
            logits, staged = mixed.run(step.input_ids, step.positions, step.spans,
                                       step.logits_indices, fill(step)), mixed
        else:
            return None
        assert staged.hidden is not None
        return logits, staged.hidden
