"""Where an engine replica's process runs: the cores `engine_cpu_ids`
names, or with "auto" the least busy ones for a lone CPU replica."""

from __future__ import annotations

import logging

from api.config import AppConfig

log = logging.getLogger("ray.serve")


def pin_replica(cfg: AppConfig) -> None:
    """Pin this replica's process to `engine_cpu_ids` (engine/threads.py).

    A listed set that cannot be had stops the replica with the field named;
    "auto" pins a lone CPU replica to its `threads` least busy cores and
    leaves the replica unpinned wherever that cannot be done (several
    replicas or shards could pick the same cores; cuda; no choice of
    cores)."""
    from engine.threads import idlest_cores, pin_process

    cores = cfg.engine_cpu_ids
    auto = cores == "auto"
    if auto:
        scale = cfg.autoscaling
        lone_cpu = (cfg.device == "cpu" and cfg.num_engine_replicas == 1
                    and not (scale.enabled and scale.max_replicas > 1)
                    and cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1)
        cores = idlest_cores(cfg.threads) if lone_cpu else None
    if cores is None:
        return
    try:
        pinned = pin_process(cores)
    except ValueError as e:
        if auto:
            log.warning("engine_cpu_ids auto: not pinned (%s)", e)
            return
        raise ValueError(f"engine_cpu_ids: {e}") from None
    log.info("engine replica pinned to CPU cores %s", sorted(pinned))
