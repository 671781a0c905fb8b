"""An engine replica whose model is split over three tensor-parallel shards
(SmolLM2's 9 heads and 3 key/value heads split by three) of each of two
pipeline stages (15 layers each), live: the other five processes run as
actors in the replica's placement group, MLFQ swaps through the
object-store tier (each one its own slice of each block), and greedy
outputs are those of the whole model on the default application
(float32)."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import MLFQ_CONFIG, PROMPTS, _deploy, _engine_handle, \
    post_all, reference_texts, wait_engine_idle
from tests.integration.test_mlfq_swap import body

pytestmark = pytest.mark.integration

TP_CONFIG = {
    **MLFQ_CONFIG,
    "tensor_parallel_size": 3,
    "pipeline_parallel_size": 2,
    # Six bundles of a quarter CPU: beside the other applications' engines.
    "engine_num_cpus": 0.25,
    "num_threads": 1,
    "predictor": {"enabled": False},
    # Half MLFQ_CONFIG's blocks for answers of half its length: 16 device
    # blocks for 8 jobs of ~3 blocks each still forces swaps, in half the
    # passes of six processes on two cores.
    "kv_cache_tokens": 256,
    "max_model_len": 256,
}
TOKENS = 32


@pytest.fixture(scope="module")
def tp_server(server):
    from ray import serve

    yield _deploy(server, "tp", TP_CONFIG)
    serve.delete("tp")


# In the long run (-m slow): six processes on two cores.  The default run
# keeps the shards' and stages' parity with gloo (tests/engine/test_tp_pp.py
# and its neighbours) and a live split model (test_replica_death.py's
# `checkpoints-pp`).
@pytest.mark.slow
def test_two_stages_of_three_shards_swap_and_answer_as_the_whole_model(server, tp_server):
    engine = _engine_handle("tp")
    concurrent = asyncio.run(post_all(tp_server, [body(p, TOKENS) for p in PROMPTS]))
    stats = wait_engine_idle(engine, timeout=60)
    assert stats["swap"]["swap_outs"] > 0, f"no swap happened: {stats['swap']}"
    assert (stats["swap"]["blocks_in"] + stats["swap"]["blocks_kept"]
            == stats["swap"]["blocks_out"])
    assert stats["swap"]["recompute_fallbacks"] == 0
    refs = reference_texts(server, [body(p, TOKENS) for p in PROMPTS])
    for p, got, ref in zip(PROMPTS, concurrent, refs):
        assert got["choices"][0]["text"] == ref, p
    assert stats["swap"]["host_used_blocks"] == 0
    # The application's directory counts each shard's slice of a block.
    import ray

    from kvstore.directory import DIRECTORY_NAMESPACE, directory_name

    directory = ray.get_actor(directory_name("tp"), namespace=DIRECTORY_NAMESPACE)
    tier = ray.get(directory.stats.remote())
    assert tier["capacity_blocks"] == 6 * TP_CONFIG["host_kv_tokens"] // 16
    assert tier["bytes_in"] > 0


def test_a_model_that_does_not_split_fails_at_build_naming_the_field():
    from app.builder import build_app

    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's "
                                         "9 attention heads"):
        build_app({**TP_CONFIG, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds the model's 30 "
                                         "layers"):
        build_app({**TP_CONFIG, "tensor_parallel_size": 1, "pipeline_parallel_size": 31})
