"""Megatron-style tensor parallelism: which slice of the model a shard holds,
and the collectives between shards.

A model of `size` shards splits every attention layer by heads and every
MLP by its inner width (Megatron-LM §3; FastServe §4.3 distributes a model
the same way): q/k/v and the MLP's first matrices by output rows (column
parallel), the attention output and the MLP's last matrix by input columns
(row parallel), whose partial products one all-reduce sums; the embedding
and the lm_head by vocabulary rows (vocab parallel).  Norms, biases of
row-parallel layers and position tables stay whole on every shard.  Each
shard's KV cache holds its own heads, so each moves its own slice of every
block.

The collectives run on torch.distributed (gloo on CPU, NCCL on CUDA): on
the default process group when the model is not also split into pipeline
stages, else on the group of the stage's shards
(engine/pipeline_parallel.py).  One model per process.  With `size == 1`
every collective is a no-op and nothing is sliced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # The shards' process group (None: the default group) and the global
    # rank of its first shard.
    group: Any = None
    first_global: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a shard")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def first(self) -> bool:
        """The shard that samples (the engine replica's own process)."""
        return self.rank == 0

    def split(self, n: int, what: str) -> int:
        """This shard's part of `n` heads (or columns) that must divide evenly."""
        if n % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} does not divide the model's {n} {what}")
        return n // self.size

    def vocab_part(self, vocab: int) -> tuple[int, int]:
        """(first id, rows) of this shard's vocabulary slice: equal slices,
        the last one padded with zero rows past the vocabulary."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows

    # Collectives --------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the shards, in place."""
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embedding lookup on a vocab-parallel `table`: each shard looks up
        the ids in its slice, zeros the others, and the sum is every row."""
        if not self.enabled:
            return torch.nn.functional.embedding(ids, table)
        start = self.rank * table.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= table.shape[0])
        x = torch.nn.functional.embedding(local.masked_fill(outside, 0), table)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """The first shard's `[rows, vocab]` logits from every shard's
        `[rows, vocab part]`; None on the other shards."""
        # (dist.gather's `dst` is a global rank, also within a group.)
        if not self.enabled:
            return local
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.first else None
        dist.gather(local, parts, dst=self.first_global, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab]

    def any_set(self, flag: bool, device: torch.device) -> bool:
        """Whether any shard's `flag` is set (all shards call it together)."""
        if not self.enabled:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


SINGLE = TensorParallel()


def load_slice(dest: torch.Tensor, full: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This shard's slice of checkpoint tensor `full` along `dim`, shaped as
    `dest`: slice `rank` of `dest.shape[dim]`, zero-padded where it runs past
    the end (the vocabulary's last slice)."""
    local = dest.shape[dim]
    start = tp.rank * local
    take = max(0, min(local, full.shape[dim] - start))
    part = full.narrow(dim, min(start, full.shape[dim]), take)
    if take == local:
        return part
    padded = torch.zeros(dest.shape, dtype=full.dtype, device=full.device)
    padded.narrow(dim, 0, take).copy_(part)
    return padded


def check_shards(model_path: str, size: int, max_model_len: int, stages: int = 1) -> None:
    """Raise ValueError naming `tensor_parallel_size` (or
    `pipeline_parallel_size`) where the model at `model_path` cannot be
    split into `size` shards (and `stages` stages): builds the first shard's
    model on the meta device (no weights, no memory)."""
    from transformers import AutoConfig

    from engine.models import model_class
    from engine.pipeline_parallel import PipelineStage

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    model_class(config.model_type)(config, torch.float32, torch.device("meta"),
                                   max_model_len, tp=TensorParallel(0, size),
                                   pp=PipelineStage(0, stages, size))
