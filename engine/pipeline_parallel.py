"""Pipeline parallelism: a model's layers split into consecutive stages,
each stage's shards in their own processes (FastServe §4.3).

Stage 0 embeds, the last stage normalises and computes the logits, and each
stage holds only its layers' weights and KV cache.  An iteration's batch is
cut into micro-batches of whole chunks (`micro_batches`): stage s sends its
hidden states for micro-batch m to stage s+1 and goes on with m+1 while
s+1 works on m, so up to `size` micro-batches are in flight; the last stage
sends the logits of the whole batch to the first shard, which samples.
With tensor parallelism as well, global rank = stage × shards + shard, each
stage's shards have a process group of their own, and shard k of a stage
talks to shard k of the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import SeqSpan
from engine.tensor_parallel import TensorParallel


@dataclass(frozen=True, slots=True)
class PipelineStage:
    stage: int = 0
    size: int = 1
    # Tensor-parallel shards per stage.
    shards: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.stage < self.size or self.shards < 1:
            raise ValueError(f"pipeline stage {self.stage} of {self.size} is not a stage")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's layers: consecutive, the first stages one more where
        the count does not divide."""
        if num_layers < self.size:
            raise ValueError(f"pipeline_parallel_size {self.size} exceeds the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, self.size)
        start = self.stage * base + min(self.stage, extra)
        return range(start, start + base + (1 if self.stage < extra else 0))

    # Point to point ---------------------------------------------------

    def send_next(self, x: torch.Tensor, shard: int) -> object:
        """Start sending `x` to the same shard of the next stage."""
        import torch.distributed as dist

        return dist.isend(x.contiguous(), (self.stage + 1) * self.shards + shard)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  shard: int) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, (self.stage - 1) * self.shards + shard)
        return x

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's first shard to the first stage's (global rank 0)."""
        import torch.distributed as dist

        dist.send(logits.contiguous(), 0)

    def recv_logits(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        logits = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        dist.recv(logits, (self.size - 1) * self.shards)
        return logits


SINGLE_STAGE = PipelineStage()


def layout(rank: int, shards: int, stages: int) -> tuple[TensorParallel, PipelineStage]:
    """Global `rank`'s tensor-parallel shard and pipeline stage, once every
    process has joined the default group.  Creates each stage's group of
    shards: every process calls this, with the same arguments but its rank."""
    stage, shard = divmod(rank, shards)
    group = None
    if shards > 1 and stages > 1:
        import torch.distributed as dist

        for s in range(stages):
            g = dist.new_group(list(range(s * shards, (s + 1) * shards)))
            if s == stage:
                group = g
    tp = TensorParallel(shard, shards, group=group, first_global=stage * shards)
    return tp, PipelineStage(stage, stages, shards)


@dataclass(slots=True)
class MicroBatch:
    rows: slice  # of the flattened batch
    spans: list[SeqSpan]
    # Its rows whose logits are wanted, relative to `rows.start`, and their
    # places in the whole batch's logits.
    logits_rows: list[int]
    logits_places: list[int]


def micro_batches(spans: Sequence[SeqSpan], logits_indices: Sequence[int],
                  count: int) -> list[MicroBatch]:
    """Cut a batch into at most `count` micro-batches of whole chunks, of
    about equal tokens, in batch order."""
    total = sum(s.num_tokens for s in spans)
    target = max(1, -(-total // max(1, count)))
    groups: list[list[SeqSpan]] = [[]]
    filled = 0
    for span in spans:
        if groups[-1] and filled >= target and len(groups) < count:
            groups.append([])
            filled = 0
        groups[-1].append(span)
        filled += span.num_tokens
    out: list[MicroBatch] = []
    start = 0
    for group in groups:
        end = start + sum(s.num_tokens for s in group)
        rows, places = [], []
        for place, row in enumerate(logits_indices):
            if start <= row < end:
                rows.append(row - start)
                places.append(place)
        out.append(MicroBatch(slice(start, end), group, rows, places))
        start = end
    return out
