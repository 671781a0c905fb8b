"""The KV block directory: a detached Ray actor that owns host KV blocks.

Blocks are stored in Ray's object store as objects put by this actor, so
this actor, not the engine replica that offloaded them, is their owner: a
block outlives the replica that wrote it (a replica killed mid-generation
leaves its jobs' swapped KV fetchable by another replica).  Blocks are
addressed by (job id, block index); the directory counts bytes against a
host capacity and refuses a put that would exceed it.

Calls from one engine reach the actor in submission order (Ray orders the
tasks of one caller to one actor), so a fetch issued after an offload of
the same job always sees it.
"""

from __future__ import annotations

from typing import Any

import ray

DIRECTORY_NAME = "kv-directory"
DIRECTORY_NAMESPACE = "preempt-serve"


@ray.remote(num_cpus=0, max_restarts=0)
class KVDirectory:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        # job -> block index -> (ref, nbytes)
        self.blocks: dict[str, dict[int, tuple[ray.ObjectRef, int]]] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0

    def put(self, job_id: str, blocks: dict[int, Any]) -> bool:
        """Store `blocks` (index -> array); all or nothing."""
        sizes = {i: int(getattr(a, "nbytes", 0)) for i, a in blocks.items()}
        old = self.blocks.get(job_id, {})
        delta = sum(sizes.values()) - sum(old[i][1] for i in sizes if i in old)
        if self.used + delta > self.capacity:
            self.rejected += 1
            return False
        entry = self.blocks.setdefault(job_id, {})
        for i, a in blocks.items():
            entry[i] = (ray.put(a), sizes[i])
        self.used += delta
        self.bytes_in += sum(sizes.values())
        return True

    def get_refs(self, job_id: str, indices: list[int]) -> list[list[ray.ObjectRef]] | None:
        """Refs of the blocks, each wrapped in a list so Ray passes the ref
        itself back instead of resolving it; None if any block is missing."""
        entry = self.blocks.get(job_id)
        if entry is None or any(i not in entry for i in indices):
            return None
        self.bytes_out += sum(entry[i][1] for i in indices)
        return [[entry[i][0]] for i in indices]

    def drop(self, job_id: str) -> int:
        entry = self.blocks.pop(job_id, {})
        freed = sum(n for _, n in entry.values())
        self.used -= freed
        return freed

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "jobs": len(self.blocks),
            "blocks": sum(len(e) for e in self.blocks.values()),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "rejected": self.rejected,
        }


def get_or_create_directory(capacity_bytes: int) -> Any:
    """The cluster's directory actor, created detached on first use."""
    return KVDirectory.options(
        name=DIRECTORY_NAME,
        namespace=DIRECTORY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote(capacity_bytes)
