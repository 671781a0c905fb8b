"""Preempting a running forward pass between layers (ConServe §4.3).

A pure-offline batch in offline batching mode may be long (large batches,
large chunks).  When an online request arrives meanwhile, the replica's
loop sets this flag from its own thread; the model checks it at the end of
every `every`-th layer and, if it is set, abandons the pass.  Nothing the
abandoned pass wrote is read: it wrote only the K/V of the plan's new
positions, which no job has computed yet (the scheduler counts them only
once a pass completes), so the next pass that computes them overwrites
them.  Sampling, detokenization and every request's state come after the
forward pass and are not reached.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.tensor_parallel import TensorParallel


class ForwardPreempted(Exception):
    """The forward pass stopped at a safepoint; its partial work is void."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"forward pass preempted after layer {layer}")
        self.layer = layer


class PreemptFlag:
    def __init__(self, every: int = 1) -> None:
        # Layers between checks: a check costs next to nothing on a CPU;
        # with tensor parallelism it would be a barrier (ConServe checks
        # every 8 layers there).
        self.every = max(1, every)
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self, layer: int) -> None:
        """At the end of layer `layer` (0-based): stop the pass if asked."""
        if (layer + 1) % self.every == 0 and self._event.is_set():
            raise ForwardPreempted(layer + 1)


class SharedPreemptFlag(PreemptFlag):
    """The flag of a tensor-parallel model: set on the first shard only, and
    checked by every shard together (one small all-reduce every `every`
    layers, on passes that may be cut only), so that all of them stop at
    the same layer; a shard that stopped alone would leave the others
    waiting in the next collective."""

    def __init__(self, tp: TensorParallel, device: torch.device, every: int = 1) -> None:
        super().__init__(every)
        self.tp = tp
        self.device = device

    def check(self, layer: int) -> None:
        if (layer + 1) % self.every == 0 and self.tp.any_set(self.is_set(), self.device):
            raise ForwardPreempted(layer + 1)
