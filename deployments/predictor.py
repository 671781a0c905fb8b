"""The Predictor deployment: response-length predictions, batched and autoscaled.

EconoServe §3.3.2 runs the RL predictor beside the inference servers and asks
it "concurrently during [a request's] waiting and PT processing", so its
latency stays off the critical path.  The ingress therefore fires
`request_prediction(...)` once admission has answered and the request's engine
stream is open (an offline request under `policy: conserve` after its wait in
the offline pool), and attaches the answer to the job whenever it lands; a
prediction that is missing (not back yet, replica down, error) means
"unknown" (`Job.predicted_output_len = None`).

Wiring only: the model lives in predictor/service.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from deployments import STOP_POLL_S

log = logging.getLogger("ray.serve")

MAX_BATCH_SIZE = 16
BATCH_WAIT_TIMEOUT_S = 0.005  # a few ms: ~1 % of a batch-16 forward on a CPU


@serve.deployment(
    name="Predictor",
    max_ongoing_requests=64,
    graceful_shutdown_wait_loop_s=STOP_POLL_S,
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
    """`adapter_dir` loads at start; with `load=False` the adapter comes from
    Serve's `user_config` instead (`reconfigure`), so that a new adapter is
    swapped in without restarting a replica or dropping a request."""

    def __init__(
        self,
        adapter_dir: str | None = None,
        padding_ratio: float = 0.15,
        backbone: str | None = None,
        num_threads: int = 1,
        device: str = "cpu",
        load: bool = True,
    ) -> None:
        self._options = {"backbone": backbone, "num_threads": num_threads, "device": device}
        self.padding_ratio = padding_ratio
        self.adapter_dir = adapter_dir
        self.service: Any = self._load(adapter_dir) if load else None
        self.num_swaps = 0

    def _load(self, adapter_dir: str | None) -> Any:
        from predictor.service import PredictorService

        return PredictorService(adapter_dir, padding_ratio=self.padding_ratio,
                                max_batch_size=MAX_BATCH_SIZE, **self._options)

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's lightweight update: `{"adapter": folder or None,
        "padding_ratio": r}`.  A new adapter loads in a worker thread while
        this one keeps predicting, then replaces it; batches already started
        finish on the old one."""
        adapter = config.get("adapter")
        ratio = float(config.get("padding_ratio", self.padding_ratio))
        if self.service is None or adapter != self.adapter_dir:
            self.padding_ratio = ratio
            new = await asyncio.get_running_loop().run_in_executor(None, self._load, adapter)
            swapped = self.service is not None
            self.service, self.adapter_dir = new, adapter
            if swapped:
                self.num_swaps += 1
                log.info("predictor adapter swapped to %s", adapter or "the shipped one")
        elif ratio != self.padding_ratio:
            self.padding_ratio = self.service.padding_ratio = ratio

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
    async def _predict_batch(self, prompts: list[str]) -> list[dict[str, int]]:
        # The forward pass runs in a worker thread so the replica's event loop
        # keeps accepting (and batching) requests meanwhile.
        # The service is read once: a swap meanwhile leaves this batch on
        # the adapter it started with.
        return await asyncio.get_running_loop().run_in_executor(
            None, self.service.predict_dicts, prompts
        )

    async def predict(self, prompt: str) -> dict[str, int]:
        """{"predicted_len": RL in tokens, "allocation": RL padded by the ratio}."""
        return await self._predict_batch(prompt)

    async def info(self) -> dict[str, Any]:
        return {**self.service.info(), "swaps": self.num_swaps}


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
