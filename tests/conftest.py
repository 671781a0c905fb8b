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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of two CPUs for one module (the object-store
    tier, tensor-parallel shards), unless the session runs one already."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    # The integration tests may have started Ray in this session already.
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if owned:
        ray.shutdown()
