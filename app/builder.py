"""The application builder named in `serve_config.yaml` (`app.builder:build_app`).

Validates the config (a bad value fails `serve run` naming the field),
converts the embedded model once in the driver so replicas do not race to
do it, and wires Ingress → Scheduler → Engine (docs/structures.md, "Processes").
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from api.config import AppConfig

log = logging.getLogger("ray.serve")


def engine_bundles(cfg: AppConfig) -> list[dict[str, float]]:
    """One bundle per shard of the model (TP×PP): a GPU each on cuda, the
    engine's CPUs each on cpu.  The replica runs in the first; the other
    shards' processes (deployments/shard_workers.py) in the others."""
    n = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if cfg.device == "cuda":
        return [{"CPU": 1.0, "GPU": 1.0} for _ in range(n)]
    return [{"CPU": cfg.engine_num_cpus} for _ in range(n)]


# How long an engine replica being let go may take to finish its requests.
ENGINE_DRAIN_S = 300.0


def engine_scaling(cfg: AppConfig) -> dict[str, Any]:
    """A fixed `num_engine_replicas`, or Serve autoscaling from there between
    the bounds, by the engines' own load reports (deployments/autoscaling.py)."""
    scale = cfg.autoscaling
    if not scale.enabled:
        return {"num_replicas": cfg.num_engine_replicas}
    return {
        # A replica let go finishes its requests first (then its __del__
        # ends what is left with an error event).
        "graceful_shutdown_timeout_s": ENGINE_DRAIN_S,
        "autoscaling_config": {
        "min_replicas": scale.min_replicas,
        "max_replicas": scale.max_replicas,
        "initial_replicas": cfg.num_engine_replicas,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        # The policy keeps its own delays (scheduler/autoscale.py).
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {"policy_function": "deployments.autoscaling:EnginePolicy",
                   "policy_kwargs": scale.model_dump()},
    }}


def engine_actor_options(cfg: AppConfig) -> dict[str, float]:
    """What the Engine replica actor itself asks of its (first) bundle.

    On cpu, nothing: the bundle's CPUs are the forward pass's, and Ray pins
    OMP threads to them.  On cuda, the bundle's GPU: Ray makes a GPU visible
    to an actor (CUDA_VISIBLE_DEVICES) only when the actor requests it, so a
    replica asking for none could not use the GPU its bundle reserves."""
    if cfg.device == "cuda":
        return {"num_cpus": 0, "num_gpus": 1.0}
    return {"num_cpus": 0}


def build_app(args: dict[str, Any] | None = None) -> Application:
    from deployments.engine import Engine
    from deployments.ingress import Ingress
    from deployments.scheduler import Scheduler
    from engine.model_source import resolve_model

    cfg = AppConfig(**(args or {}))
    for advice in cfg.advice():
        log.warning(advice)
    model_path = resolve_model(cfg.model)
    if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
        from engine.tensor_parallel import check_shards

        # Here rather than in every shard's process at start.
        check_shards(str(model_path), cfg.tensor_parallel_size,
                     cfg.scheduler_config().max_model_len, cfg.pipeline_parallel_size)
    config = cfg.model_dump()

    scheduler = Scheduler.options(ray_actor_options={"num_cpus": 0.05}).bind(config)
    engine = Engine.options(
        **engine_scaling(cfg),
        ray_actor_options=engine_actor_options(cfg),
        placement_group_bundles=engine_bundles(cfg),
        placement_group_strategy="STRICT_PACK",
        # A new length head is swapped in by `reconfigure` (no restart).
        user_config={"engine_head": cfg.predictor.engine_head},
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.routing:PlacementRouter"),
    ).bind(config, scheduler)
    predictor = None
    if cfg.predictor.enabled:
        from deployments.predictor import Predictor

        # The adapter and padding go in `user_config`: changing them in the
        # config reloads the adapter in the running replicas (`reconfigure`)
        # instead of replacing them.
        predictor = Predictor.options(
            ray_actor_options={"num_cpus": cfg.predictor.num_cpus, "num_gpus": cfg.predictor.num_gpus},
            user_config={"adapter": cfg.predictor.adapter,
                         "padding_ratio": cfg.predictor.padding_ratio},
        ).bind(device=cfg.predictor.device, load=False)
    return Ingress.options(ray_actor_options={"num_cpus": 0.05}).bind(
        config, scheduler, engine, predictor)
