"""The shards of a split engine replica other than the first (tensor-parallel
shards and pipeline stages): one Ray actor each, in the bundles of the
replica's placement group after its own (app/builder.py), joined to the
replica's process by torch.distributed (gloo on CPU, NCCL on CUDA).

The replica's own `ModelRunner` is global rank 0: it keeps the requests,
samples and drives the others each iteration (engine/shards.py).  Calls from one
handle to an actor run in order, so a `forget` sent between two steps
lands between them.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.pipeline_parallel import PipelineStage
from engine.shards import ShardStep, SwapReport
from engine.tensor_parallel import TensorParallel

# How long the shards may take to meet (model loading comes after).
RENDEZVOUS_S = 300


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ShardWorker:
    """One shard's `ModelRunner` in its own process."""

    def __init__(self, rank: int, shards: int, stages: int, init_method: str, backend: str,
                 runner_kwargs: dict[str, Any]) -> None:
        import torch.distributed as dist

        from engine.pipeline_parallel import layout
        from engine.runner import ModelRunner

        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=shards * stages,
                                timeout=timedelta(seconds=RENDEZVOUS_S))
        tp, pp = layout(rank, shards, stages)
        self.runner = ModelRunner(**runner_kwargs, tensor_parallel=tp, pipeline=pp)
        self.tier: Any = None

    def ready(self) -> int:
        return self.runner.kv_cache.num_blocks

    def set_kv_tier(self, directory: Any, name: str | None, namespace: str | None,
                    owner: str | None) -> None:
        from kvstore.tier import ObjectStoreTier

        self.tier = ObjectStoreTier(directory, name=name, namespace=namespace, owner=owner)
        self.runner.set_kv_tier(self.tier)

    def flush_kv_tier(self) -> None:
        if self.tier is not None:
            self.tier.flush()

    def step(self, step: ShardStep) -> SwapReport:
        return self.runner.execute_shard(step)

    def forget(self, job_id: str) -> None:
        self.runner.forget_shard(job_id)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RayShardGroup:
    """Global ranks 1..size-1 of a model split into `shards` tensor-parallel
    shards × `stages` pipeline stages, as Ray actors; this process becomes
    rank 0.

    `join` returns once every rank is in the process group, with this
    process's shard and stage to build its own runner with; `wait_ready`
    once every other rank has loaded its slice of the model."""

    def __init__(self, shards: int, runner_kwargs: dict[str, Any], *, stages: int = 1,
                 device: str = "cpu", placement_group: PlacementGroup | None = None,
                 bundle_offset: int = 1) -> None:
        self.shards, self.stages = shards, stages
        self.size = size = shards * stages
        if size < 2:
            raise ValueError("a shard group needs at least two shards or stages")
        self.backend = "nccl" if device == "cuda" else "gloo"
        host = ray.util.get_node_ip_address()
        self.init_method = f"tcp://{host}:{_free_port(host)}"
        pg = placement_group if placement_group is not None else get_current_placement_group()
        actor = ray.remote(ShardWorker)
        self.workers = []
        for rank in range(1, size):
            options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
            if device == "cuda":
                options["num_gpus"] = 1
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundle_offset + rank - 1)
            self.workers.append(actor.options(**options).remote(
                rank, shards, stages, self.init_method, self.backend, runner_kwargs))
        self._ready = [w.ready.remote() for w in self.workers]
        self._pending: list[Any] = []

    def join(self) -> tuple[TensorParallel, PipelineStage]:
        """Join the process group as rank 0: blocks until every rank has
        joined, and fails as soon as one fails to start; returns this
        process's shard and stage."""
        import torch.distributed as dist

        from engine.pipeline_parallel import layout

        failure: list[BaseException] = []

        def init() -> None:
            try:
                dist.init_process_group(self.backend, init_method=self.init_method, rank=0,
                                        world_size=self.size,
                                        timeout=timedelta(seconds=RENDEZVOUS_S))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                failure.append(e)

        t = threading.Thread(target=init, name="tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            done, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=0)
            for ref in done:
                ray.get(ref)  # a shard that failed to start raises here
        if failure:
            raise failure[0]
        return layout(0, self.shards, self.stages)

    def wait_ready(self) -> None:
        ray.get(self._ready)

    def set_kv_tier(self, directory: Any, name: str | None = None,
                    namespace: str | None = None, owner: str | None = None) -> None:
        """Every other rank's host tier: the same directory, filling the
        same replica's (`owner`'s) share."""
        ray.get([w.set_kv_tier.remote(directory, name, namespace, owner)
                 for w in self.workers])

    def flush_kv_tier(self) -> None:
        """Wait until every other rank's queued host copies have landed.
        Submitted after the step that queued them (calls from one process
        to an actor run in order), so it waits for those too."""
        ray.get([w.flush_kv_tier.remote() for w in self.workers])

    # ShardGroup -----------------------------------------------------------

    def launch(self, step: ShardStep) -> None:
        if self._pending:  # a step the first shard abandoned (it raised)
            ray.get(self._pending)
        self._pending = [w.step.remote(step) for w in self.workers]

    def finish(self) -> list[SwapReport]:
        pending, self._pending = self._pending, []
        return list(ray.get(pending))

    def forget(self, job_id: str) -> None:
        for w in self.workers:
            w.forget.remote(job_id)

    def close(self) -> None:
        import torch.distributed as dist

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()
