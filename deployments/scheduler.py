"""The Scheduler deployment: cluster-level job registry and placement.

Stateful, one replica.  Engine replicas report their load to it; the
ingress asks it where a job goes and tells it when the job ended.  The
iteration-level decisions are not made here but in each engine replica,
between its own forward passes (docs/structures.md, "Processes").

It also owns the application's host KV tier directory (kvstore/directory.py):
created at start, named after the application, and gone with this replica,
so a restart starts clean.  It holds (`host_kv_tokens` // `block_size`) ×
`tensor_parallel_size` × `pipeline_parallel_size` blocks per engine replica
(a split model stores a block as one slice per shard and stage), for the
larger of `num_engine_replicas` and, with `autoscaling.enabled`,
`autoscaling.max_replicas` replicas; each replica may fill its own share
only.  Engines look it up through `kv_directory()`.

Under `policy: conserve` with `offline_pool.enabled` (the default) it holds
the offline pool (scheduler/offline_pool.py): an offline request's `admit`
call waits here, on a future of its own, until the pool hands it to a
replica with room (on a load report, a release or another arrival); then
the call returns that replica, and the ingress goes on as for any request.
A client that goes away cancels the call (Serve cancels a disconnected
request's calls), which takes the request out of the pool.  The pool lives
in this replica: if it restarts, the waiting calls fail (the ingress
answers 503) and the engines' next reports, half a second apart, tell the
new pool what each replica holds.  Until a first report arrives, offline
requests wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

from ray import serve

from api.config import AppConfig
from api.admission_wire import Admission, AdmitRequest
from deployments import STOP_POLL_S
from scheduler.admission import bounded
from scheduler.job import JobClass
from scheduler.offline_pool import OfflineLoad, OfflinePool
from scheduler.placement import Placement

log = logging.getLogger("ray.serve")


# Access logs off: engines report their load twice a second.
@serve.deployment(name="Scheduler", num_replicas=1, max_ongoing_requests=10_000,
                  logging_config={"enable_access_log": False},
                  graceful_shutdown_wait_loop_s=STOP_POLL_S)
class Scheduler:
    def __init__(self, config: dict[str, Any] | None = None,
                 stale_after_s: float = 10.0) -> None:
        self.cfg = AppConfig(**(config or {}))
        self.placement = Placement(stale_after_s=stale_after_s,
                                   block_size=self.cfg.block_size)
        self.jobs: dict[str, dict[str, Any]] = {}
        self.outcomes: dict[str, int] = {}
        self.num_rejected = 0
        # Requests placed again after their replica failed.
        self.num_resumed = 0
        # Offline requests a replica gave back to the pool.
        self.num_moved = 0
        self.pool: OfflinePool | None = None
        if self.cfg.policy == "conserve" and self.cfg.offline_pool.enabled:
            self.pool = OfflinePool(self.cfg.offline_pool, stale_after_s=stale_after_s)
        # Request id -> the future its waiting `admit` call awaits.
        self._pooled: dict[str, asyncio.Future[str | None]] = {}
        self.num_pool_cancelled = 0
        # Set by shutdown_engines: the pool hands nothing out any more.
        self._stopping: str | None = None
        self.app_name = serve.get_replica_context().app_name
        self._kv_ref: Any = None
        self._kv_directory: Any = None
        per_replica = self.cfg.scheduler_config().host_kv_blocks
        if per_replica:
            from kvstore.directory import DirectoryRef, create_directory, directory_name

            # Each shard and stage of a split model stores its slice of a
            # block as an entry of its own (engine/shards.py, ShardTier).
            share = per_replica * self.cfg.tensor_parallel_size \
                * self.cfg.pipeline_parallel_size
            scale = self.cfg.autoscaling
            replicas = max(self.cfg.num_engine_replicas,
                           scale.max_replicas if scale.enabled else 1)
            self._kv_ref = DirectoryRef(
                name=directory_name(self.app_name),
                capacity_blocks=share * replicas, per_owner_blocks=share)
            # Owned by this replica: it goes away with the application.
            self._kv_directory = create_directory(self._kv_ref.name,
                                                  self._kv_ref.capacity_blocks,
                                                  per_owner_blocks=share)

    async def report_load(self, replica_id: str, num_blocks: int, free_blocks: int,
                          queued_tokens: int, num_jobs: int,
                          admission: dict[str, Any] | None = None,
                          offline: dict[str, int] | None = None) -> dict[str, int] | None:
        """A replica's load; `admission` holds its queued work, the bound on
        it and its measured speed (scheduler/admission.py), `offline` its
        figures for the offline pool (`OfflineLoad`).  The answer asks the
        replica to give back waiting offline requests (`give_back`: how
        many) that other replicas have room for."""
        now = time.monotonic()
        self.placement.report(replica_id, num_blocks, free_blocks, queued_tokens,
                              num_jobs, now, **(admission or {}))
        if self.pool is not None and offline is not None:
            self.pool.report(replica_id, OfflineLoad(**offline), free_blocks, num_blocks,
                             (admission or {}).get("tokens_per_s"), now)
            self._hand_out()
            if self._stopping is None and (k := self.pool.to_give_back(replica_id, now)):
                return {"give_back": k}
        return None

    async def ready(self) -> dict[str, int]:
        """How many engine replicas report their load now, of how many the
        application runs.  A replica reports once it has loaded its model
        and started its loop, and stops when it dies; the ingress's /health
        answers 503 while none does."""
        return {"live_engines": len(self.placement.live(time.monotonic())),
                "engines": self.cfg.num_engine_replicas}

    async def admit(self, request_id: str, prompt_tokens: int, max_tokens: int,
                    job_class: str = "online", n: int = 1,
                    priority: int = 0, failed_replica: str | None = None,
                    prefix_keys: list[int] | None = None,
                    route_key: int | None = None,
                    moved_from: str | None = None) -> dict[str, Any]:
        """Where the request runs, or a refusal when every replica's queued
        work is at its bound (the ingress answers 429).  An offline request
        under `policy: conserve` is never refused: the call returns once
        the offline pool hands it to a replica.  `failed_replica` ("" when
        unknown): the request was admitted before and its replica failed
        (deployments/resume.py); that replica is forgotten until it reports
        again, and the request goes to the least loaded other one, past
        admission control and the pool.  `prefix_keys`: the prompt's
        leading blocks (scheduler/prefix_affinity.py), so that it goes
        where they are likely cached unless that replica is busier by more
        than they save; `route_key`: the client's `prompt_cache_key`, which
        counts a replica that got it as holding all of them.  `moved_from`:
        the replica gave the (offline) request back, unstarted or preempted
        with its KV in the host tier; it waits in the pool again."""
        if failed_replica is not None and self._stopping is not None:
            # Every engine is stopping: nowhere to go on.
            return Admission(admitted=False, retry_after_s=1.0,
                             message=self._stopping).model_dump()
        if failed_replica is not None:
            self.placement.forget(failed_replica)
            self.num_resumed += 1
            replica = self.placement.place(request_id, prompt_tokens + n * max_tokens,
                                           time.monotonic(), prefix_keys, route_key)
            self.jobs[request_id] = {"class": job_class, "replica": replica,
                                     "admitted_at": time.time()}
            return Admission(admitted=True, replica=replica).model_dump()
        if moved_from is not None and self.pool is not None:
            self.pool.release(request_id)  # it arrived there, and ended
            self.num_moved += 1
        if (self.pool is not None and job_class == JobClass.OFFLINE.value
                and self._stopping is None):
            replica = await self._from_pool(request_id, prompt_tokens, max_tokens, n, priority)
            self.jobs[request_id] = {"class": job_class, "replica": replica,
                                     "admitted_at": time.time()}
            return Admission(admitted=True, replica=replica).model_dump()
        now = time.monotonic()
        ahead = self._dispatch_ahead(now)
        if self.cfg.admission.enabled and bounded(job_class, self.cfg.policy):
            res = self.placement.admit(request_id, prompt_tokens, max_tokens, n, now,
                                       prefix_keys, route_key)
        else:
            res = None
        if res is not None and not res.admitted:
            self.num_rejected += 1
            return Admission(
                admitted=False, retry_after_s=res.retry_after_s,
                message=("the server is at capacity: its queued work would delay this "
                         f"request past its {self.cfg.admission.ttft_slo_s:g} s TTFT "
                         "objective; retry later")).model_dump()
        replica = res.replica if res is not None else self.placement.place(
            request_id, prompt_tokens + n * max_tokens, now, prefix_keys, route_key)
        self.jobs[request_id] = {"class": job_class, "replica": replica,
                                 "admitted_at": time.time()}
        return Admission(admitted=True, replica=replica, dispatch_ahead=ahead).model_dump()

    def _dispatch_ahead(self, now: float) -> str | None:
        """The only live replica, where it starts a newcomer at once (before
        this request is placed): where the ingress may send its next online
        request before that one's answer (deployments/dispatch_ahead.py)."""
        if not self.cfg.admission.dispatch_ahead:
            return None
        live = self.placement.live(now)
        return live[0].replica_id if len(live) == 1 and live[0].starts_at_once() else None

    async def admit_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`admit` for each of several online requests (`AdmitRequest`
        dumps), answered in order in one call: the ingress sends together
        the admissions that arrive while its previous call is in flight
        (deployments/coalesce.py). An offline request under the offline
        pool is refused here: it would hold up the others while it waits."""
        reqs = [AdmitRequest.model_validate(raw) for raw in requests]
        for req in reqs:
            if self.pool is not None and req.job_class == JobClass.OFFLINE.value:
                raise ValueError(f"request {req.request_id}: an offline request can wait "
                                 "in the offline pool; admit it by `admit`")
        return [await self.admit(**req.model_dump()) for req in reqs]

    async def _from_pool(self, request_id: str, prompt_tokens: int, max_tokens: int,
                         n: int, priority: int) -> str | None:
        """Wait in the offline pool; the replica it hands the request to."""
        assert self.pool is not None
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.pool.add(request_id, prompt_tokens, max_tokens, n, priority, time.monotonic())
        self._pooled[request_id] = fut
        try:
            self._hand_out()
            return await fut
        except asyncio.CancelledError:
            # The client went away: out of the pool, or, if it was just
            # handed out, its hand-out no longer counts against the replica.
            self.pool.cancel(request_id)
            self.num_pool_cancelled += 1
            raise
        finally:
            self._pooled.pop(request_id, None)

    def _hand_out(self) -> None:
        """Resolve the waiting calls of what the pool hands out now."""
        if self.pool is None or self._stopping is not None:
            return
        for request_id, replica in self.pool.assign(time.monotonic()):
            fut = self._pooled.get(request_id)
            if fut is None or fut.done():  # cancelled, its call not yet unwound
                self.pool.cancel(request_id)
            else:
                fut.set_result(replica)

    async def release(self, request_id: str, outcome: str) -> None:
        self.placement.release(request_id)
        info = self.jobs.pop(request_id, None)
        if self._kv_directory is not None and info is not None and (
                outcome != "finished"
                or info["replica"] not in {r.replica_id for r in self.placement.live(
                    time.monotonic())}):
            # Ended early, or its replica died: what a dead replica
            # checkpointed of it and nobody resumed would otherwise stay in
            # the host tier until the application stops (a live replica
            # drops its own jobs' blocks as they end).
            self._kv_directory.drop_request.remote(request_id)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if self.pool is not None:
            self.pool.release(request_id)
            self._hand_out()

    async def release_many(self, releases: list[tuple[str, str]]) -> None:
        """`release` for each (request id, outcome), in one call (the
        ingress coalesces them as it does admissions)."""
        for request_id, outcome in releases:
            await self.release(request_id, outcome)

    async def kv_directory(self) -> dict[str, Any] | None:
        """The application's KV directory as a `kvstore.directory.DirectoryRef`
        dump (engines look the actor up by its name); None: no host tier."""
        return None if self._kv_ref is None else self._kv_ref.model_dump()

    async def shutdown_engines(self, reason: str) -> dict[str, Any]:
        """End every job on every live engine replica with an error carrying
        `reason`; the replicas refuse new jobs from then on.  Called before
        `serve.shutdown()` (app/cli.py), while the HTTP proxy still runs, so
        that open streams end with an error event instead of being cut off.
        Returns, per replica, the number of jobs ended or the call's error."""
        self._stopping = reason
        # The name given in deployments/engine.py (importing it would load torch here).
        engine = serve.get_deployment_handle("Engine", self.app_name)
        ids = [r.replica_id for r in self.placement.live(time.monotonic())]
        # `replica=` routes each call to that replica (deployments/routing.py).
        done = await asyncio.gather(
            *(engine.stop_serving.remote(reason, replica=rid) for rid in ids),
            return_exceptions=True)
        out = {rid: (repr(r) if isinstance(r, BaseException) else r)
               for rid, r in zip(ids, done)}
        self._release_pool()
        log.info("engines shut down (%s): %s", reason, out)
        return out

    def _release_pool(self) -> None:
        """At shutdown, let every waiting offline request go on to an
        engine (any: `replica` None), which, stopped, ends it with the
        shutdown's reason: its client gets the same 503 as the requests that
        were running, while the HTTP proxy still runs."""
        if self.pool is None:
            return
        for request_id in self.pool.drain():
            fut = self._pooled.get(request_id)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _kv_tier_stats(self) -> dict[str, Any] | None:
        if self._kv_directory is None:
            return None
        try:
            st = await self._kv_directory.stats.remote()
        except Exception as e:  # the directory died; say so instead of failing stats
            return {"name": self._kv_ref.name, "error": repr(e)}
        return {"name": self._kv_ref.name, **st}

    async def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "kv_tier": await self._kv_tier_stats(),
            "active_jobs": len(self.jobs),
            "rejected": self.num_rejected,
            "resumed": self.num_resumed,
            "moved": self.num_moved,
            "prefix_placements": self.placement.num_prefix_placements,
            "outcomes": dict(self.outcomes),
            "offline_pool": None if self.pool is None else {
                **self.pool.stats(now), "cancelled": self.num_pool_cancelled},
            "replicas": {
                r.replica_id: {"free_blocks": r.free_blocks, "num_blocks": r.num_blocks,
                               "queued_tokens": r.queued_tokens, "num_jobs": r.num_jobs,
                               "waiting_tokens": r.waiting_tokens,
                               "capacity_tokens": r.capacity_tokens,
                               "tokens_per_s": r.tokens_per_s,
                               "mean_output_len": r.mean_output_len,
                               "prefill": None if r.prefill is None else asdict(r.prefill)}
                for r in self.placement.live(now)
            },
        }
