"""The Predictor deployment: response-length predictions, batched and autoscaled.

EconoServe §3.3.2 runs the RL predictor beside the inference servers and asks
it "concurrently during [a request's] waiting and PT processing", so its
latency stays off the critical path.  The ingress therefore fires
`request_prediction(...)` when a request arrives and attaches the answer to the
job whenever it lands; a prediction that is missing (not back yet, replica
down, error) means "unknown" (`Job.predicted_output_len = None`).

Wiring only: the model lives in predictor/service.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

log = logging.getLogger("ray.serve")

MAX_BATCH_SIZE = 16
BATCH_WAIT_TIMEOUT_S = 0.005  # a few ms: ~1 % of a batch-16 forward on a CPU


@serve.deployment(
    name="Predictor",
    max_ongoing_requests=64,
    # One CPU thread per replica (two OpenMP threads per process on a 2-core
    # node slow everything 10-25x); more load -> more replicas.
    ray_actor_options={"num_cpus": 1},
    autoscaling_config={
        "min_replicas": 1,
        "max_replicas": 4,
        # A full batch in flight plus the next one forming.
        "target_ongoing_requests": 2 * MAX_BATCH_SIZE,
        "upscale_delay_s": 5,
        "downscale_delay_s": 60,
    },
)
class Predictor:
    def __init__(
        self,
        adapter_dir: str | None = None,
        padding_ratio: float = 0.15,
        backbone: str | None = None,
        num_threads: int = 1,
        device: str = "cpu",
    ) -> None:
        from predictor.service import PredictorService

        self.service = PredictorService(
            adapter_dir,
            backbone=backbone,
            padding_ratio=padding_ratio,
            max_batch_size=MAX_BATCH_SIZE,
            num_threads=num_threads,
            device=device,
        )

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
    async def _predict_batch(self, prompts: list[str]) -> list[dict[str, int]]:
        # The forward pass runs in a worker thread so the replica's event loop
        # keeps accepting (and batching) requests meanwhile.
        return await asyncio.get_running_loop().run_in_executor(
            None, self.service.predict_dicts, prompts
        )

    async def predict(self, prompt: str) -> dict[str, int]:
        """{"predicted_len": RL in tokens, "allocation": RL padded by the ratio}."""
        return await self._predict_batch(prompt)

    async def info(self) -> dict[str, Any]:
        return self.service.info()


def request_prediction(handle: Any, prompt: str) -> "asyncio.Task[dict[str, int] | None]":
    """Start a prediction without waiting for it (call from the ingress's loop).

    The task resolves to the prediction dict, or None when the predictor
    fails: callers treat None as "unknown length" and never block on it.
    """

    async def _run() -> dict[str, int] | None:
        try:
            return await handle.predict.remote(prompt)
        except Exception as exc:  # a missing prediction is "unknown", not an error
            log.warning("length prediction failed: %s", exc)
            return None

    return asyncio.get_running_loop().create_task(_run())


def prediction_if_ready(task: "asyncio.Task[dict[str, int] | None] | None") -> dict[str, int] | None:
    """The prediction if it has already landed, else None ("unknown")."""
    if task is None or not task.done() or task.cancelled():
        return None
    return task.result()
