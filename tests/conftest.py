"""Suite-wide set-up, before any test module imports Triton."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# Without a GPU, the Triton kernels (engine.attention_triton) run under
# Triton's interpreter on CPU tensors.  Triton reads the switch when a kernel
# is defined, so it must be set before the first import of triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """This test session's local Ray cluster, started on first need (each
    start costs several seconds), shared by every module after and shut
    down when the session ends: six logical CPUs, since the integration
    applications hold up to three 1-CPU engine bundles at once, and a split
    one of six quarter-CPU bundles (the forward passes are pinned to one
    thread each, so logical CPUs may exceed the two physical cores)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_session: Any) -> Any:
    """Ray for a module's actors (the object-store tier, tensor-parallel
    shards): the session's cluster."""
    return ray_session
