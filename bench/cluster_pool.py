"""The Scheduler deployment's offline pool in the cluster simulator
(bench/cluster_sim.py): under `policy: conserve`, offline requests wait in
`scheduler.offline_pool.OfflinePool` and are handed to replicas with room on
their load reports and on every request's end, as deployments/scheduler.py
does; a replica serving online work gives back what it holds unstarted when
the pool asks (`offline_pool.move_queued`), and, with a host tier the
replicas share (`ClusterOptions.shared_host_tier`), the started ones the
server would move too (`movable_offline`, at most an iteration's prefill
to recompute): their next replica adopts the blocks they had in the tier
and recomputes the rest.

Live, a hand-out reaches its replica after a Serve call and a give-back
after the replica's next drain of its inbox; here both land at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.workload import RequestSpec
from scheduler.config import OfflinePoolConfig
from scheduler.job import JobClass
from scheduler.offline_pool import OfflinePool, movable_offline, offline_load, \
    recompute_bound
from scheduler.swap import SwapManager


class SimPool:
    def __init__(self, config: OfflinePoolConfig,
                 place: Callable[[RequestSpec, Any, float], None],
                 shared_host_tier: bool = True) -> None:
        # Never stale, never lost: every replica reports on time here.
        self.pool = OfflinePool(config, stale_after_s=float("inf"),
                                lost_after_s=float("inf"))
        # (spec, the replica it goes to, now) -> the job added there.
        self._place = place
        self.specs: dict[str, RequestSpec] = {}
        self.replicas: dict[str, Any] = {}
        # Per replica: offline requests it accepted (the pool's proof of
        # arrival, `OfflineLoad.accepted`).
        self.accepted: dict[str, int] = {}
        # Per replica: offline jobs that sampled their first token.
        self.started: dict[str, int] = {}
        self.shared_host_tier = shared_host_tier
        # Started requests given back: their blocks in the host tier.
        self.carried: dict[str, int] = {}
        self.num_moved = 0
        self.num_moved_started = 0

    def __len__(self) -> int:
        return len(self.pool)

    def add(self, r: RequestSpec, now: float) -> None:
        self.specs[r.request_id] = r
        self.pool.add(r.request_id, r.prompt_tokens, r.max_tokens or r.output_tokens, 1,
                      r.priority, now)
        self.hand_out(now)

    def hand_out(self, now: float) -> None:
        for rid, name in self.pool.assign(now):
            rep = self.replicas[name]
            self.accepted[name] = self.accepted.get(name, 0) + 1
            self._place(self.specs[rid], rep, now)

    def report(self, rep: Any, now: float) -> None:
        """The replica's figures for the pool; then the pool's hand-outs and
        its request to give back."""
        self.replicas[rep.name] = rep
        core = rep.core
        cfg = core.config
        load = offline_load(
            list(core.jobs.values()), core.batch, rep.mean_output.value,
            batch_limit=cfg.conserve.offline_max_batch_size or cfg.max_batch_size,
            free_blocks=core.blocks.num_free, block_size=cfg.block_size,
            accepted=self.accepted.get(rep.name, 0), started=self.started.get(rep.name, 0))
        self.pool.report(rep.name, load, core.blocks.num_free, cfg.num_blocks, None, now)
        self.hand_out(now)
        count = self.pool.to_give_back(rep.name, now)
        if count:
            self.give_back(rep, count, now)

    def give_back(self, rep: Any, count: int, now: float) -> None:
        core = rep.core
        offline = {jid: [jid] for jid, j in core.jobs.items() if j.job_class is JobClass.OFFLINE}
        limit = recompute_bound(core.config) if self.shared_host_tier else None
        for rid in movable_offline(offline, core.jobs, core.batch, count, limit):
            started = bool(core.jobs[rid].output_token_ids)
            if started:
                self.carried[rid] = SwapManager.host_blocks(core.jobs[rid])
                self.num_moved_started += 1
            core.abort(rid, keep_host=started)
            self.pool.release(rid)
            r = self.specs[rid]
            self.pool.add(rid, r.prompt_tokens, r.max_tokens or r.output_tokens, 1,
                          r.priority, now)
            self.num_moved += 1
        self.hand_out(now)

    def first_token(self, name: str) -> None:
        self.started[name] = self.started.get(name, 0) + 1

    def finished(self, request_id: str, now: float) -> None:
        """An offline request ended on its replica: its room opens."""
        self.pool.release(request_id)
        self.hand_out(now)

    def forget(self, name: str) -> None:
        """A replica let go: no more hand-outs to it."""
        self.pool.forget(name)
        self.replicas.pop(name, None)
