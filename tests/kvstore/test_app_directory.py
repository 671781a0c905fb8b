"""One KV directory per Serve application, created and owned by its Scheduler.

Only the Scheduler deployment runs here (no model): it is what creates the
directory, sizes it from the application's configuration and takes it
down with the application.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvstore.directory import DIRECTORY_NAMESPACE, DirectoryRef, KVDirectory, directory_name
from kvstore.tier import ObjectStoreTier


def config(host_kv_tokens: int, replicas: int) -> dict[str, Any]:
    return {"host_kv_tokens": host_kv_tokens, "block_size": 16,
            "num_engine_replicas": replicas}


@pytest.fixture(scope="module")
def serve_instance(ray_cluster):
    from ray import serve

    # The integration tests may have started Serve in this session already.
    owned = _serve_is_down()
    serve.start(proxy_location="Disabled")
    apps: list[str] = []
    yield serve, apps
    for name in apps:
        serve.delete(name)
    if owned:
        serve.shutdown()


def _serve_is_down() -> bool:
    from ray import serve

    try:
        serve.status()
    except Exception:
        return True
    return False


def run_scheduler(serve_apps, name: str, cfg: dict[str, Any]) -> Any:  # type: ignore[no-untyped-def]
    serve, apps = serve_apps
    from deployments.scheduler import Scheduler

    if name not in apps:
        apps.append(name)
    app = Scheduler.options(ray_actor_options={"num_cpus": 0}).bind(cfg)
    return serve.run(app, name=name, route_prefix=None)


def kv_tier(handle: Any) -> dict[str, Any]:
    return handle.stats.remote().result(timeout_s=60)["kv_tier"]


def name_is_free(ray: Any, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=DIRECTORY_NAMESPACE)
    except ValueError:
        return True
    return False


def wait_until(cond, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def offload_one_block(ray: Any, handle: Any) -> ObjectStoreTier:
    """Store a block as an engine replica would: found through the scheduler."""
    ref = DirectoryRef.model_validate(handle.kv_directory.remote().result(timeout_s=60))
    tier = ObjectStoreTier(ray.get_actor(ref.name, namespace=ref.namespace), name=ref.name)
    assert tier.offload("job", [0], torch.zeros(1, 2, 8)).result()
    return tier


def test_two_applications_get_their_own_directories_sized_per_replica(ray_cluster, serve_instance):
    ray = ray_cluster
    a = run_scheduler(serve_instance, "app-a", config(host_kv_tokens=1024, replicas=3))
    b = run_scheduler(serve_instance, "app-b", config(host_kv_tokens=4096, replicas=1))

    ta, tb = kv_tier(a), kv_tier(b)
    # host_kv_tokens / block_size per engine replica, times the replicas.
    assert ta["name"] == directory_name("app-a") and ta["capacity_blocks"] == 1024 // 16 * 3
    assert tb["name"] == directory_name("app-b") and tb["capacity_blocks"] == 4096 // 16
    ref = DirectoryRef.model_validate(a.kv_directory.remote().result())
    # Each replica's share: its own host_kv_tokens.
    assert (ref.capacity_blocks, ref.per_owner_blocks) == (192, 64)
    assert ta["per_owner_blocks"] == 64 and tb["per_owner_blocks"] == 256

    offload_one_block(ray, a)
    ta, tb = kv_tier(a), kv_tier(b)
    assert (ta["used_blocks"], ta["jobs"]) == (1, 1) and ta["used_bytes"] > 0
    assert (tb["used_blocks"], tb["jobs"]) == (0, 0)


def test_an_application_without_a_host_tier_has_no_directory(serve_instance):
    h = run_scheduler(serve_instance, "app-none", config(host_kv_tokens=0, replicas=2))
    assert kv_tier(h) is None
    assert h.kv_directory.remote().result() is None


def test_a_restart_starts_clean(ray_cluster, serve_instance):
    ray = ray_cluster
    serve, _ = serve_instance
    first = run_scheduler(serve_instance, "app-r", config(host_kv_tokens=1024, replicas=1))
    offload_one_block(ray, first)
    old = ray.get_actor(directory_name("app-r"), namespace=DIRECTORY_NAMESPACE)
    assert kv_tier(first)["used_blocks"] == 1

    serve.delete("app-r")
    # The directory went with the scheduler replica that owned it.
    wait_until(lambda: name_is_free(ray, directory_name("app-r")))

    second = run_scheduler(serve_instance, "app-r", config(host_kv_tokens=512, replicas=2))
    st = kv_tier(second)
    assert st["capacity_blocks"] == 512 // 16 * 2
    assert (st["used_blocks"], st["used_bytes"], st["jobs"], st["bytes_in"]) == (0, 0, 0, 0)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.stats.remote())


def test_a_stale_directory_of_the_same_name_is_replaced_not_inherited(ray_cluster, serve_instance):
    ray = ray_cluster
    # What a crashed run of an older version left behind: a detached
    # directory under the name, with its own capacity and blocks.
    stale = KVDirectory.options(name=directory_name("app-s"), namespace=DIRECTORY_NAMESPACE,
                                lifetime="detached").remote(7)
    assert ray.get(stale.put.remote("old-job", {0: torch.zeros(4).numpy()}))

    h = run_scheduler(serve_instance, "app-s", config(host_kv_tokens=2048, replicas=1))

    st = kv_tier(h)
    assert st["capacity_blocks"] == 2048 // 16
    assert st["used_blocks"] == 0 and st["jobs"] == 0
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stale.stats.remote())


def test_a_released_requests_orphaned_checkpoints_are_dropped(ray_cluster, serve_instance):
    """Blocks a replica stored for a request and could not drop itself (it
    died) go when the request ends: every job of it (prompts `-i`, choices
    `#i`, shards `#shardRofW`), nothing of another request, and nothing of a
    request that finished on a live replica (which drops its own)."""
    ray = ray_cluster
    h = run_scheduler(serve_instance, "app-o", config(host_kv_tokens=1024, replicas=2))
    ref = DirectoryRef.model_validate(h.kv_directory.remote().result(timeout_s=60))
    tier = ObjectStoreTier(ray.get_actor(ref.name, namespace=ref.namespace), name=ref.name)
    jobs = ["cmpl-a", "cmpl-a#1", "cmpl-b-0#shard1of2", "cmpl-b-1", "cmpl-c", "cmpl-ab"]
    for job in jobs:
        assert tier.offload(job, [0], torch.zeros(1, 2, 8)).result()
    h.report_load.remote("r0", 64, 64, 0, 0).result(timeout_s=60)
    for rid in ("cmpl-a", "cmpl-b", "cmpl-c"):
        assert h.admit.remote(rid, 10, 4).result(timeout_s=60)["replica"] == "r0"
    # Finished on a replica that is alive: its replica drops what it stored.
    h.release.remote("cmpl-c", "finished").result(timeout_s=60)
    # Ended early: nobody will resume it.
    h.release.remote("cmpl-a", "aborted").result(timeout_s=60)
    wait_until(lambda: kv_tier(h)["jobs"] == 4)
    # Its replica died: the ingress places it again (nowhere is live now),
    # and it finishes there.
    h.admit.remote("cmpl-b", 10, 4, failed_replica="r0").result(timeout_s=60)
    h.release.remote("cmpl-b", "finished").result(timeout_s=60)
    wait_until(lambda: kv_tier(h)["jobs"] == 2)
    st = kv_tier(h)
    assert st["dropped_orphans"] == 4 and st["used_blocks"] == 2
