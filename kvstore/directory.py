"""The KV block directory: the Ray actor that owns an application's host KV blocks.

Blocks are stored in Ray's object store as objects put by this actor, so
this actor, not the engine replica that offloaded them, is their owner: a
block outlives the replica that wrote it (a replica killed mid-generation
leaves its jobs' swapped KV fetchable by another replica).  Blocks are
addressed by (job id, block index); the directory counts blocks against a
capacity and refuses a put that would exceed it.

One directory per Serve application.  The application's Scheduler replica
creates it at start (`create_directory`), named after the application
(`directory_name`), and owns it, so:

- it is sized by that application's configuration, counted in blocks (the
  scheduler does not load the model, so it cannot know a block's bytes;
  the engines of one application share one block shape): per engine
  replica (`host_kv_tokens` // `block_size`) × `tensor_parallel_size` ×
  `pipeline_parallel_size` (a split model's processes store one entry per
  slice of a block), for the larger of `num_engine_replicas` and, with
  `autoscaling.enabled`, `autoscaling.max_replicas` replicas; a replica
  that names itself when it stores (`owner`) may fill its per-replica
  share only, not the whole: one replica cannot fill the tier its peers
  need;
- it goes away with the application (`serve shutdown`, `serve.delete`,
  Ctrl-C of `serve run`): Ray destroys an actor when its owner dies, so
  the next start gets a fresh, empty directory with its own capacity;
- two applications on one cluster never share one.

Engines find it by name through the scheduler (`DirectoryRef`).  An engine
without a scheduler (tests, a bare engine) creates an unnamed directory of
its own.

Calls from one engine reach the actor in submission order (Ray orders the
tasks of one caller to one actor), so a fetch issued after an offload of
the same job always sees it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field

from kvstore.held import leading_blocks

log = logging.getLogger(__name__)

DIRECTORY_NAMESPACE = "preempt-serve"


def directory_name(app_name: str) -> str:
    """The directory actor's name for a Serve application."""
    return f"kv-directory:{app_name}"


class DirectoryRef(BaseModel):
    """How an engine replica finds its application's directory (sent by the
    scheduler; an actor handle is not sent, so the reply is plain data)."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str = DIRECTORY_NAMESPACE
    capacity_blocks: int = Field(ge=0)
    # Each engine replica's share (None: the whole capacity is shared).
    per_owner_blocks: int | None = Field(None, ge=0)


@ray.remote(num_cpus=0, max_restarts=0)
class KVDirectory:
    def __init__(self, capacity_blocks: int, per_owner_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.per_owner_blocks = per_owner_blocks
        self.used_blocks = 0
        self.used_bytes = 0
        # job -> block index -> (ref, nbytes)
        self.blocks: dict[str, dict[int, tuple[ray.ObjectRef, int]]] = {}
        # Who stored each job's blocks, and how many each owner holds.
        self.owner_of: dict[str, str] = {}
        self.owner_used: dict[str, int] = {}
        # Bytes of one block as the engines send it; None until the first put.
        self.block_bytes: int | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0
        # Jobs dropped by `drop_request` (their writer had died).
        self.dropped_orphans = 0

    def put(self, job_id: str, blocks: dict[int, Any], owner: str | None = None) -> bool:
        """Store `blocks` (index -> array) for `owner` (an engine replica);
        all or nothing.  A block already held for the job is replaced and
        does not count twice; a job's blocks count against whoever stored
        it first until it is dropped."""
        sizes = {i: int(getattr(a, "nbytes", 0)) for i, a in blocks.items()}
        old = self.blocks.get(job_id, {})
        new_blocks = sum(1 for i in sizes if i not in old)
        owner = self.owner_of.get(job_id, owner)
        over_share = (owner is not None and self.per_owner_blocks is not None
                      and self.owner_used.get(owner, 0) + new_blocks > self.per_owner_blocks)
        if over_share or self.used_blocks + new_blocks > self.capacity_blocks:
            self.rejected += 1
            return False
        if owner is not None:
            self.owner_of[job_id] = owner
            self.owner_used[owner] = self.owner_used.get(owner, 0) + new_blocks
        entry = self.blocks.setdefault(job_id, {})
        for i, a in blocks.items():
            if i in entry:
                self.used_bytes -= entry[i][1]
            entry[i] = (ray.put(a), sizes[i])
        self.used_blocks += new_blocks
        self.used_bytes += sum(sizes.values())
        self.bytes_in += sum(sizes.values())
        if sizes and self.block_bytes is None:
            self.block_bytes = max(sizes.values())
        return True

    def get_refs(self, job_id: str, indices: list[int]) -> list[list[ray.ObjectRef]] | None:
        """Refs of the blocks, each wrapped in a list so Ray passes the ref
        itself back instead of resolving it; None if any block is missing."""
        entry = self.blocks.get(job_id)
        if entry is None or any(i not in entry for i in indices):
            return None
        self.bytes_out += sum(entry[i][1] for i in indices)
        return [[entry[i][0]] for i in indices]

    def held(self, job_id: str) -> int:
        """How many of the job's blocks, from block 0 on without a gap, are
        stored: what a replica resuming the job can fetch."""
        return leading_blocks(self.blocks.get(job_id, {}))

    def drop(self, job_id: str) -> int:
        """Forget the job's blocks; returns the bytes freed."""
        entry = self.blocks.pop(job_id, {})
        freed = sum(n for _, n in entry.values())
        owner = self.owner_of.pop(job_id, None)
        if owner is not None:
            self.owner_used[owner] -= len(entry)
            if not self.owner_used[owner]:
                del self.owner_used[owner]
        self.used_blocks -= len(entry)
        self.used_bytes -= freed
        return freed

    def drop_request(self, request_id: str) -> int:
        """Forget the blocks of every job of one client request (its
        prompts `-i`, choices `#i` and shards `#shardRofW`, deployments/
        engine_loop.py and engine/shards.py); returns the bytes freed.  For
        the checkpoints a dead replica left of a request nobody resumed."""
        ours = [j for j in self.blocks if j == request_id
                or j.startswith((request_id + "-", request_id + "#"))]
        freed = sum(self.drop(j) for j in ours)
        self.dropped_orphans += len(ours)
        return freed

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "per_owner_blocks": self.per_owner_blocks,
            # Blocks held by each engine replica that stored any.
            "owners": dict(self.owner_used),
            # Known once an engine has stored a block.
            "capacity_bytes": (None if self.block_bytes is None
                               else self.capacity_blocks * self.block_bytes),
            "block_bytes": self.block_bytes,
            "used_blocks": self.used_blocks,
            "used_bytes": self.used_bytes,
            "jobs": len(self.blocks),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "rejected": self.rejected,
            "dropped_orphans": self.dropped_orphans,
        }


def create_directory(name: str, capacity_blocks: int, *,
                     per_owner_blocks: int | None = None,
                     namespace: str = DIRECTORY_NAMESPACE,
                     replace_timeout_s: float = 30.0) -> Any:
    """Create the named directory, owned by the calling worker.

    Called from the Scheduler replica, the directory lives exactly as long
    as that replica.  A directory already registered under the name is
    never reused, since its capacity and blocks belong to another run: it
    is killed and replaced.  That happens when a previous scheduler replica
    of the application is still being torn down, or when an earlier
    version of this code left a detached directory behind.
    """
    deadline = time.monotonic() + replace_timeout_s
    warned = False
    while True:
        try:
            stale = ray.get_actor(name, namespace=namespace)
        except ValueError:  # no actor holds the name
            stale = None
        if stale is None:
            try:
                return KVDirectory.options(name=name, namespace=namespace).remote(
                    capacity_blocks, per_owner_blocks)
            except ValueError:  # taken between the lookup and the creation
                pass
        else:
            if not warned:
                log.warning("replacing a stale KV directory %r left by an earlier run", name)
                warned = True
            ray.kill(stale, no_restart=True)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the KV directory name {name!r} is still taken after "
                f"{replace_timeout_s:g} s")
        # The name is released once the GCS sees the old actor dead.
        time.sleep(0.1)
