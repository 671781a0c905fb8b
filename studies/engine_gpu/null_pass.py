"""The serving loop's host path alone: the model's pass and sampling taken out.

On a GPU whose step is short (a 1B shape decodes 128 rows in 1.3–1.5 ms from a graph),
the replica's loop is bound by its host work: planning, staging, completion, swaps' books,
text decoding and delivery.  That work is Python and runs the same on any CPU, so it can
be measured, and changed, without a GPU: `strip_pass` leaves a `ModelRunner` doing
everything but the pass and the sampling, whose places take a constant and random ids.
What the study then reports as `loop_s` is the host path of the plans the policy makes
(staging the inputs, block copies for swaps and the tier's books included; on a CPU those
copies are real, on a GPU they are queued on a side stream).  A policy whose choices follow
measured time (the MLFQ) makes other plans than with a model, whose iterations last longer.

`emulate_device` gives the stripped passes a device's time back: each launched plan holds an
emulated device for what a cost model (say, one an H200 run measured) gives its chunks,
queued behind the plan before it as a CUDA stream queues passes, and collecting it waits until
then.  The host's work then overlaps the device's as it does on the GPU (with
`async_scheduling`, the next plan is made while a pass runs), and a policy that follows
measured time sees iterations of the GPU's length.  A swap-out's copy is ready for the host
tier only once the passes queued before it have ended, as on a GPU, where the side stream's
copy waits for the compute stream (`engine/swapper.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.runner import ModelRunner
from scheduler.cost import LinearCost
from scheduler.plan import Plan

# Sampled ids start past the tokenizer's special tokens, so that every one decodes to text.
_FIRST_ID = 256


def strip_pass(runner: ModelRunner, seed: int = 0) -> None:
    """From now on `runner` computes nothing: a pass that wants logits gets a column of
    zeros, and sampling draws ids uniformly from the vocabulary (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size

    def logits(plan: Any, prepared: Any, pending: Any = None) -> torch.Tensor | None:
        n = len(prepared.logits_indices)
        return torch.zeros(n, 1) if n else None

    def sample(logits: torch.Tensor, requests: Sequence[Any], exact: Any = None) -> torch.Tensor:
        return torch.randint(_FIRST_ID, vocab, (len(requests),), generator=gen)

    def greedy(logits: torch.Tensor, exact: Any = None) -> torch.Tensor:
        return torch.randint(_FIRST_ID, vocab, (logits.shape[0],), generator=gen)

    # Instance attributes: the runner's own calls find them before its class's methods.
    runner._logits = logits  # type: ignore[method-assign]
    runner.sampler.sample_tensor = sample  # type: ignore[method-assign]
    runner.sampler.greedy_tensor = greedy  # type: ignore[method-assign]


def device_time(cost: LinearCost, plan: Plan) -> float:
    """Seconds `cost` gives `plan`'s pass (0 for a plan with no chunks)."""
    if not plan.chunks:
        return 0.0
    decodes = sum(1 for c in plan.chunks if c.is_decode)
    prefill = sum(c.num_tokens for c in plan.chunks if not c.is_decode)
    return cost.batch_time(decodes, 0, prefill, 0)


def emulate_device(runner: ModelRunner, cost: LinearCost) -> list[float]:
    """From now on each pass `runner` launches keeps an emulated device busy for
    `device_time(cost, plan)`, starting when the launch returns or when the pass
    before it ends, whichever is later; `collect` waits for its end.  Returns
    the list of those device times, one per launched plan, as they are given."""
    launch, collect = runner.launch, runner.collect
    busy: list[float] = []
    free_at = 0.0
    due: dict[int, float] = {}

    def timed_launch(plan: Plan) -> Any:
        nonlocal free_at
        pending = launch(plan)
        busy.append(device_time(cost, plan))
        free_at = max(time.perf_counter(), free_at) + busy[-1]
        due[id(pending)] = free_at
        return pending

    def timed_collect(pending: Any) -> Any:
        wait = due.pop(id(pending), 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return collect(pending)

    runner.launch = timed_launch  # type: ignore[method-assign]
    runner.collect = timed_collect  # type: ignore[method-assign]
    if runner.swapper is not None:
        tier = runner.swapper.tier
        offload = tier.offload

        def offload_after_passes(job_id: str, indices: list[int], blocks: torch.Tensor,
                                 ready: Callable[[], None] | None = None) -> Any:
            until = free_at  # the end of the passes launched before this plan's

            def copied() -> None:
                if ready is not None:
                    ready()
                wait = until - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)

            return offload(job_id, indices, blocks, ready=copied)

        tier.offload = offload_after_passes  # type: ignore[method-assign]
    return busy
