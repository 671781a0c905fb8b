"""Started offline requests move between replicas of a split model, live:
test_conserve_pool.py's move scenario on two engine replicas whose model is
split into two pipeline stages (15 layers each; the second stage an actor
in the replica's placement group).  Each stage checkpoints its own slice of
every block to the application's tier; a replica giving a started request
back waits until both stages' copies have landed, and the replica taking it
finds the blocks every stage stored (engine/shards.py), fetches them and
recomputes only the rest.  Every answer is the unsplit FCFS application's
(float32).

Named to run right after test_conserve_pool.py, whose application is gone
by then: two replicas of two quarter-CPU bundles each fit where its two
1-CPU engines were."""

from __future__ import annotations

import pytest

from tests.integration.conftest import _deploy
from tests.integration.test_conserve_pool import POOL_CONFIG, check_moves

# In the long run (-m slow): the default run keeps the move scenario on an
# unsplit model (test_conserve_pool.py) and resumes on split replicas
# (tests/engine/test_tensor_parallel.py and test_pipeline_parallel.py; live,
# test_replica_death.py's `checkpoints-pp`).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "pool-pp"
SPLIT_CONFIG = {
    **POOL_CONFIG,
    "pipeline_parallel_size": 2,
    "engine_num_cpus": 0.25,
    "num_threads": 1,
}


@pytest.fixture(scope="module")
def split_pool(server):
    from ray import serve

    yield _deploy(server, APP, SPLIT_CONFIG)
    serve.delete(APP)


def test_a_started_offline_request_moves_between_replicas_of_a_split_model(server, split_pool):
    from ray import serve

    check_moves(server, split_pool, serve.get_deployment_handle("Scheduler", app_name=APP), APP)
