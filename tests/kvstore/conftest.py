"""A local Ray cluster for the object-store tier tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # The integration tests may have started Ray in this session already.
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if owned:
        ray.shutdown()
