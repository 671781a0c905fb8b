"""The part of `ModelRunner` that drives a model split over processes:
tensor-parallel shards (engine/tensor_parallel.py) and pipeline stages
(engine/pipeline_parallel.py).  Global rank 0's runner launches every other
rank's slice of each iteration (`ShardStep`: block ops and the flattened
batch, engine/shards.py) and combines their swap reports; every other rank
runs `execute_shard`.  A pipeline pass goes stage by stage in micro-batches
(FastServe §4.3).  A runner of one process pays nothing here:
`_launch_shards` returns at once and `_poll_swaps` is its swapper's.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kv_cache import KVCache
from engine.models import CausalLM, ForwardBatch
from engine.pipeline_parallel import PipelineStage, micro_batches
from engine.preemption import ForwardPreempted, PreemptFlag
from engine.prepared import PreparedStep
from engine.shards import ShardGroup, ShardStep, SwapReport, SwapsInFlight
from engine.swapper import BlockSwapper
from engine.tensor_parallel import TensorParallel
from scheduler.plan import Plan


class ShardDriving:
    """Mixed into `ModelRunner`, which sets these attributes."""

    model: CausalLM
    kv_cache: KVCache
    config: Any
    attn: Any
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel
    pp: PipelineStage
    world: int
    rank: int
    swapper: BlockSwapper | None
    shards: ShardGroup | None
    _swaps: SwapsInFlight
    preempt_flag: PreemptFlag

    def _forward_batch(self, prepared: PreparedStep) -> ForwardBatch:
        raise NotImplementedError

    def attach_shards(self, shards: ShardGroup) -> None:
        """Drive `shards` (every shard but this one) from this runner, the
        first shard's: each iteration's block ops and forward pass run on
        all of them (engine/shards.py)."""
        if self.rank != 0 or shards.size != self.world:
            raise ValueError(f"rank {self.rank} of {self.world} cannot drive a group "
                             f"of {shards.size}")
        self.shards = shards

    @property
    def num_swaps_in_flight(self) -> int:
        """Swap-ins and prefetches issued and not yet reported landed or
        failed (on any shard)."""
        own = 0 if self.swapper is None else self.swapper.num_in_flight
        return max(own, self._swaps.pending) if self.shards is not None else own

    def execute_shard(self, step: ShardStep) -> SwapReport:
        """On a shard other than the first: this shard's slice of one
        iteration (block ops, forward pass, logits for the first shard);
        returns the swap-ins landed and failed here."""
        if self.swapper is not None:
            self.swapper.order_after_copies()
            if step.block_ops:
                self.swapper.apply(step.block_ops)
        batch = PreparedStep(step.input_ids, step.positions, step.spans,
                          step.logits_indices, [], [], [], [])
        if step.input_ids and self.pp.enabled:
            with torch.inference_mode():
                self._pipeline_pass(batch)
        elif step.input_ids:
            self.model.preempt = self.preempt_flag if step.preemptible else None
            try:
                with torch.inference_mode():
                    hidden = self.model(self._forward_batch(batch), self.kv_cache)
                    if step.logits_indices:
                        self.model.compute_logits(hidden)
            except ForwardPreempted:
                pass  # the first shard cut the pass at the same layer
            finally:
                self.model.preempt = None
        return self._poll_swaps(step.wait_s)

    def forget_shard(self, job_id: str) -> None:
        """`remove_request`'s part on a shard other than the first."""
        if self.swapper is not None:
            self.swapper.forget(job_id)

    def _launch_shards(self, plan: Plan | None, prepared: PreparedStep | None,
                       wait_s: float = 0.0) -> None:
        if self.shards is None:
            return
        step = ShardStep(wait_s=wait_s)
        if plan is not None:
            step.block_ops = list(plan.block_ops)
            self._swaps.issued(plan.block_ops)
            step.preemptible = plan.preemptible_at_layers
        if prepared is not None:
            step.input_ids, step.positions = prepared.input_ids, prepared.positions
            step.spans, step.logits_indices = prepared.spans, prepared.logits_indices
        self.shards.launch(step)


    def _poll_swaps(self, wait_s: float) -> SwapReport:
        """Swap-ins landed and failed (on every shard); ends the step the
        other shards were launched on."""
        own = ([], []) if self.swapper is None else self.swapper.poll(wait_s)
        if self.shards is None:
            return own
        return self._swaps.combine([own, *self.shards.finish()])


    def _pipeline_pass(self, prepared: PreparedStep) -> torch.Tensor | None:
        """This stage's part of a pass over pipeline stages
        (engine/pipeline_parallel.py): micro-batch by micro-batch, from the
        previous stage's hidden states to the next stage; the logits on
        global rank 0 (None elsewhere)."""
        pp, tp, dev = self.pp, self.tp, self.device
        ids = torch.tensor(prepared.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(prepared.positions, dtype=torch.long, device=dev)
        in_flight: list[tuple[Any, torch.Tensor]] = []
        finals: list[torch.Tensor] = []
        places: list[int] = []
        for mb in micro_batches(prepared.spans, prepared.logits_indices, pp.size):
            batch = ForwardBatch(
                ids[mb.rows], positions[mb.rows], self.attn.build_metadata(mb.spans),
                torch.tensor(mb.logits_rows, dtype=torch.long, device=dev))
            hidden = None if pp.first else pp.recv_prev(
                (mb.rows.stop - mb.rows.start, self.config.hidden_size), self.dtype, dev,
                tp.rank)
            out = self.model(batch, self.kv_cache, hidden)
            if not pp.last:
                in_flight.append((pp.send_next(out, tp.rank), out))
            elif mb.logits_rows:
                finals.append(out)
                places.extend(mb.logits_places)
        for work, _ in in_flight:
            work.wait()  # type: ignore[attr-defined]
        rows = len(prepared.logits_indices)
        logits = None
        if pp.last and rows:
            order = torch.tensor(places, device=dev).argsort()
            logits = self.model.compute_logits(torch.cat(finals)[order])
            if self.rank != 0 and tp.first:
                assert logits is not None
                pp.send_logits(logits)
        if self.rank == 0 and rows and not pp.last:
            logits = pp.recv_logits(rows, self.model.vocab_size, dev)
        return logits if self.rank == 0 else None
