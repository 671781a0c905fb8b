"""The host KV tier: local and on Ray's object store."""

from __future__ import annotations

import os

import pytest
import torch

from kvstore.tier import LocalHostTier, ObjectStoreTier

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def blocks(n: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 3, 4, 2, 8, generator=g).to(dtype)


def test_local_tier_roundtrip_and_byte_accounting():
    tier = LocalHostTier(capacity_bytes=10**6)
    data = blocks(3)
    assert tier.offload("j", [0, 1, 2], data).result()
    got = tier.fetch("j", [0, 1, 2]).result()
    assert torch.equal(got, data)
    assert tier.stats.bytes_fetched == tier.stats.bytes_offloaded == data.numel() * 2
    assert [jid for jid, _ in tier.landed()] == ["j"]
    tier.drop("j")
    tier.flush()
    assert tier.used == 0
    assert tier.fetch("j", [0]).result() is None
    assert tier.stats.fetch_failures == 1


def test_local_tier_refuses_past_capacity():
    data = blocks(4)
    tier = LocalHostTier(capacity_bytes=data.numel() * 2 - 1)
    assert not tier.offload("j", [0, 1, 2, 3], data).result()
    assert tier.used == 0 and tier.stats.offload_failures == 1


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


def test_object_store_blocks_survive_the_writer(ray_cluster):
    ray = ray_cluster
    from kvstore.directory import DIRECTORY_NAMESPACE, KVDirectory

    directory = KVDirectory.options(name="kv-directory-test", lifetime="detached",
                                    namespace=DIRECTORY_NAMESPACE).remote(10**8)

    @ray.remote(num_cpus=0)
    class Writer:
        def write(self, directory, seed: int) -> int:
            import torch

            from kvstore.tier import ObjectStoreTier

            t = ObjectStoreTier(10**8, directory=directory)
            g = torch.Generator().manual_seed(seed)
            data = torch.randn(5, 2, 3, 4, 2, 8, generator=g).to(torch.bfloat16)
            assert t.offload("job-a", list(range(5)), data).result()
            return t.stats.bytes_offloaded

    w = Writer.remote()
    written = ray.get(w.write.remote(directory, 7))
    ray.kill(w)  # the replica that offloaded the blocks dies

    reader = ObjectStoreTier(10**8, directory=directory)
    got = reader.fetch("job-a", list(range(5))).result()
    assert got is not None and torch.equal(got, blocks(5, seed=7))
    assert reader.stats.bytes_fetched == written
    stats = ray.get(directory.stats.remote())
    assert stats["used_bytes"] == written and stats["bytes_out"] == written
    reader.drop("job-a")
    reader.flush()
    assert ray.get(directory.stats.remote())["used_bytes"] == 0
    ray.kill(directory)


def test_object_store_capacity_refusal(ray_cluster):
    from kvstore.directory import KVDirectory

    small = KVDirectory.remote(100)
    tier = ObjectStoreTier(100, directory=small)
    assert not tier.offload("big", [0, 1], blocks(2)).result()
    assert tier.stats.offload_failures == 1
    assert tier.fetch("big", [0]).result() is None
