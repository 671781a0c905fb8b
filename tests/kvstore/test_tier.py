"""The host KV tier: local and on Ray's object store."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.tier import LocalHostTier, ObjectStoreTier


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


def test_pending_blocks_count_the_copies_not_stored_yet():
    import threading

    tier = LocalHostTier(capacity_bytes=10**6)
    release = threading.Event()
    first = tier.offload("a", [0, 1, 2], blocks(3), ready=release.wait)  # held on the thread
    second = tier.offload("b", [0, 1], blocks(2, seed=1))
    assert tier.pending_blocks == 5
    release.set()
    assert first.result() and second.result()
    assert tier.pending_blocks == 0
    # A refused offload is no longer pending either.
    full = LocalHostTier(capacity_bytes=1)
    assert not full.offload("c", [0], blocks(1)).result()
    assert full.pending_blocks == 0


def test_local_tier_refuses_past_capacity():
    data = blocks(4)
    tier = LocalHostTier(capacity_bytes=data.numel() * 2 - 1)
    assert not tier.offload("j", [0, 1, 2, 3], data).result()
    assert tier.used == 0 and tier.stats.offload_failures == 1


def test_object_store_blocks_survive_the_writer(ray_cluster):
    ray = ray_cluster
    from kvstore.directory import DIRECTORY_NAMESPACE, KVDirectory

    directory = KVDirectory.options(name="kv-directory-test", lifetime="detached",
                                    namespace=DIRECTORY_NAMESPACE).remote(100)

    @ray.remote(num_cpus=0)
    class Writer:
        def write(self, directory, seed: int) -> int:
            import torch

            from kvstore.tier import ObjectStoreTier

            t = ObjectStoreTier(directory)
            g = torch.Generator().manual_seed(seed)
            data = torch.randn(5, 2, 3, 4, 2, 8, generator=g).to(torch.bfloat16)
            assert t.offload("job-a", list(range(5)), data).result()
            return t.stats.bytes_offloaded

    w = Writer.remote()
    written = ray.get(w.write.remote(directory, 7))
    ray.kill(w)  # the replica that offloaded the blocks dies

    reader = ObjectStoreTier(directory)
    # What a replica resuming the job finds (`survival.checkpoint`).
    assert reader.held("job-a") == 5 and reader.held("job-b") == 0
    got = reader.fetch("job-a", list(range(5))).result()
    assert got is not None and torch.equal(got, blocks(5, seed=7))
    assert reader.stats.bytes_fetched == written
    stats = ray.get(directory.stats.remote())
    assert stats["used_bytes"] == written and stats["bytes_out"] == written
    assert stats["used_blocks"] == 5 and stats["jobs"] == 1
    assert stats["capacity_bytes"] == 100 * stats["block_bytes"] == 100 * written // 5
    reader.drop("job-a")
    reader.flush()
    after = ray.get(directory.stats.remote())
    assert after["used_bytes"] == after["used_blocks"] == after["jobs"] == 0
    ray.kill(directory)


def test_object_store_capacity_is_counted_in_blocks(ray_cluster):
    ray = ray_cluster
    from kvstore.directory import KVDirectory

    small = KVDirectory.remote(3)
    tier = ObjectStoreTier(small)
    assert not tier.offload("big", [0, 1, 2, 3], blocks(4)).result()
    assert tier.stats.offload_failures == 1
    assert tier.fetch("big", [0]).result() is None
    assert tier.offload("a", [0, 1], blocks(2)).result()
    # Rewriting a block the job already has takes no new room.
    assert tier.offload("a", [1], blocks(1, seed=3)).result()
    assert tier.offload("b", [0], blocks(1)).result()
    assert not tier.offload("c", [0], blocks(1)).result()
    st = ray.get(small.stats.remote())
    assert st["used_blocks"] == 3 and st["rejected"] == 2
    assert st["used_bytes"] == 3 * blocks(1).numel() * 2
    assert torch.equal(tier.fetch("a", [1]).result(), blocks(1, seed=3))


def test_each_replica_fills_only_its_share(ray_cluster):
    """Two engine replicas on one directory of 2 × 3 blocks: neither can
    take the other's share; a job counts against the replica that stored it
    until it is dropped, also when another replica reads or rewrites it."""
    ray = ray_cluster
    from kvstore.directory import KVDirectory

    shared = KVDirectory.remote(6, 3)
    a = ObjectStoreTier(shared, owner="replica-a")
    b = ObjectStoreTier(shared, owner="replica-b")
    assert a.offload("a1", [0, 1, 2], blocks(3)).result()
    assert not a.offload("a2", [0], blocks(1)).result()  # a's share is full
    assert b.offload("b1", [0, 1], blocks(2)).result()  # b's is not
    # b extends a's job (it resumed there): a's share counts it, and is full.
    assert not b.offload("a1", [3], blocks(1)).result()
    assert torch.equal(b.fetch("a1", [2]).result(), blocks(3)[2:])
    st = ray.get(shared.stats.remote())
    assert st["owners"] == {"replica-a": 3, "replica-b": 2} and st["per_owner_blocks"] == 3
    a.drop("a1")
    a.flush()
    assert a.offload("a2", [0, 1, 2], blocks(3)).result()
    b.drop("b1")
    b.flush()
    deadline = time.monotonic() + 30  # the drop is sent, not awaited
    while ray.get(shared.stats.remote())["owners"] != {"replica-a": 3}:
        assert time.monotonic() < deadline, ray.get(shared.stats.remote())
        time.sleep(0.05)
    assert ray.get(shared.stats.remote())["used_blocks"] == 3
    ray.kill(shared)


def test_a_dead_directory_is_a_refused_offload_and_a_lost_fetch(ray_cluster):
    ray = ray_cluster
    from kvstore.directory import KVDirectory

    directory = KVDirectory.remote(10)
    tier = ObjectStoreTier(directory)
    assert tier.offload("j", [0], blocks(1)).result()
    ray.kill(directory)
    # ray.kill only asks: a call made just after it may still be served.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(directory.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the killed directory kept answering")
    # No exception escapes the copy thread; the scheduler sees a refusal
    # and a lost fetch, which it already handles.
    assert tier.offload("j", [1], blocks(1)).result() is False
    assert tier.fetch("j", [0]).result() is None
    assert [got for jid, got in tier.landed()] == [None]
    tier.drop("j")
    tier.close()


def test_a_named_tier_follows_a_replaced_directory(ray_cluster):
    ray = ray_cluster
    from kvstore.directory import create_directory

    first = create_directory("kv-directory-follow", 10)
    tier = ObjectStoreTier(first, name="kv-directory-follow")
    assert tier.offload("j", [0], blocks(1)).result()
    ray.kill(first)
    second = create_directory("kv-directory-follow", 10)
    # The old blocks went with the old directory; new ones go to the new one.
    assert tier.fetch("j", [0]).result() is None
    assert tier.offload("k", [0], blocks(1)).result()
    assert ray.get(second.stats.remote())["used_blocks"] == 1
    ray.kill(second)


def test_an_offload_waits_for_its_copy_to_be_ready() -> None:
    """A checkpoint copied on a side stream: the tier stores the blocks
    only after `ready` returns, and stores what they hold by then."""
    import threading

    tier = LocalHostTier(capacity_bytes=10**6)
    data = torch.zeros(2, 3, 4)
    filled = threading.Event()

    def ready() -> None:
        assert filled.wait(5)

    fut = tier.offload("j", [0, 1], data, ready=ready)
    data.copy_(torch.ones(2, 3, 4))  # the copy lands after offload returned
    filled.set()
    assert fut.result()
    got = tier.fetch("j", [0, 1]).result()
    assert got is not None and torch.equal(got, torch.ones(2, 3, 4))


def test_held_counts_the_leading_blocks_without_a_gap() -> None:
    tier = LocalHostTier(capacity_bytes=10**6)
    data = blocks(4, seed=1)
    assert tier.held("j") == 0
    tier.offload("j", [0, 1, 3], data[:3])
    assert tier.held("j") == 2  # block 2 missing: only 0 and 1 are usable
    tier.offload("j", [2], data[3:])
    assert tier.held("j") == 4
    tier.drop("j")
    assert tier.held("j") == 0


class _GatedTier(LocalHostTier):
    """A local tier whose stores wait for `gate`: a store that takes long."""

    def __init__(self) -> None:
        import threading

        super().__init__(capacity_bytes=10**6)
        self.gate = threading.Event()

    def _put(self, job_id, blocks):  # type: ignore[no-untyped-def]
        assert self.gate.wait(10)
        return super()._put(job_id, blocks)


def test_a_fetch_does_not_wait_for_a_slow_store() -> None:
    """Swapped out and back in before the store ended: the fetch reads the
    copy the tier was handed; another job's fetch is not queued behind the
    store either."""
    tier = _GatedTier()
    tier.gate.set()
    assert tier.offload("done", [0, 1], blocks(2, seed=1)).result()
    tier.gate.clear()
    stored = tier.offload("slow", [0, 1, 2], blocks(3, seed=2))
    got = tier.fetch("slow", [0, 1, 2]).result(timeout=5)
    assert torch.equal(got, blocks(3, seed=2)) and not stored.done()
    assert torch.equal(tier.fetch("done", [1]).result(timeout=5), blocks(2, seed=1)[1:])
    assert tier.stats.blocks_fetched_unstored == 3 and tier.pending_blocks == 3
    tier.gate.set()
    assert stored.result() and tier.pending_blocks == 0
    # Stored now: read from the store, as before.
    assert torch.equal(tier.fetch("slow", [2]).result(), blocks(3, seed=2)[2:])
    assert tier.stats.blocks_fetched_unstored == 3


def test_a_fetch_joins_stored_and_unstored_blocks_in_order() -> None:
    """Incremental checkpoints: blocks 0 and 1 stored, block 2's store and a
    rewrite of block 1 still queued; the fetch sees the newest of each."""
    tier = _GatedTier()
    tier.gate.set()
    first = blocks(2, seed=3)
    assert tier.offload("j", [0, 1], first).result()
    tier.gate.clear()
    later = blocks(2, seed=4)
    tier.offload("j", [2], later[:1])
    tier.offload("j", [1], later[1:])
    got = tier.fetch("j", [0, 1, 2]).result(timeout=5)
    assert torch.equal(got, torch.stack([first[0], later[1], later[0]]))
    tier.gate.set()
    tier.flush()
    assert torch.equal(tier.fetch("j", [0, 1, 2]).result(), got)


def test_a_store_of_a_dropped_job_is_skipped() -> None:
    tier = _GatedTier()
    held_up = tier.offload("a", [0], blocks(1))  # keeps the writer busy
    skipped = tier.offload("b", [0, 1], blocks(2))
    tier.drop("b")  # before its store began
    # The dropped copy is gone for a fetch issued after the drop.
    assert tier.fetch("b", [0, 1]).result(timeout=5) is None
    tier.gate.set()
    assert held_up.result() and skipped.result()
    tier.flush()
    assert tier.stats.offloads_skipped == 1 and tier.stats.offloads == 1
    assert tier.used == blocks(1).numel() * 2 and tier.pending_blocks == 0
    # The job offloaded again is stored again.
    assert tier.offload("b", [0], blocks(1, seed=5)).result()
    assert torch.equal(tier.fetch("b", [0]).result(), blocks(1, seed=5))


def test_a_fetch_of_an_unstored_copy_waits_for_its_device_copy() -> None:
    """The copy a fetch reads may still be filled by a side-stream copy
    (`ready`): the fetch waits for it, as the store does."""
    import threading

    tier = LocalHostTier(capacity_bytes=10**6)
    data = torch.zeros(2, 3, 4)
    filled = threading.Event()
    tier.offload("j", [0, 1], data, ready=lambda: filled.wait(5))
    fut = tier.fetch("j", [0, 1])
    data.copy_(torch.ones(2, 3, 4))
    filled.set()
    assert torch.equal(fut.result(), torch.ones(2, 3, 4))


def test_the_directory_actor_never_imports_torch(ray_cluster):
    """Unpickling a block in the directory must not import torch: on a
    loaded 2-core host that import held the first put, and every swap-in
    queued behind it, for seconds."""
    ray = ray_cluster
    from kvstore.directory import KVDirectory

    @ray.remote(num_cpus=0)
    class Probe(KVDirectory.__ray_actor_class__):  # type: ignore[name-defined]
        def modules(self) -> list[str]:
            import sys

            return [m for m in ("torch", "numpy") if m in sys.modules]

    directory = Probe.remote(10)
    tier = ObjectStoreTier(directory)
    assert tier.offload("j", [0, 1], blocks(2)).result()
    assert torch.equal(tier.fetch("j", [0, 1]).result(), blocks(2))
    assert "torch" not in ray.get(directory.modules.remote())
    ray.kill(directory)
