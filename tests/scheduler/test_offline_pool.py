"""The cluster-level offline pool on a fake clock: where offline work goes,
when it waits, and that nothing is left behind."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.config import OfflinePoolConfig
from scheduler.job import Job, JobClass
from scheduler.offline_pool import OfflineLoad, OfflinePool, offline_load

IDLE = OfflineLoad(free_slots=4)


def pool(queue_jobs: int = 2) -> OfflinePool:
    return OfflinePool(OfflinePoolConfig(replica_queue_jobs=queue_jobs), stale_after_s=5.0,
                       lost_after_s=5.0)


def report(p: OfflinePool, rid: str, load: OfflineLoad, now: float, free_blocks: int = 100,
           tps: float | None = 100.0) -> None:
    p.report(rid, load, free_blocks=free_blocks, num_blocks=100, tokens_per_s=tps, now=now)


def add(p: OfflinePool, *rids: str, now: float = 0.0, priority: int = 0, n: int = 1) -> None:
    for rid in rids:
        p.add(rid, prompt_tokens=20, max_tokens=40, n=n, priority=priority, now=now)


def test_offline_work_goes_to_the_idle_replica_not_the_one_busy_with_online_work():
    p = pool(queue_jobs=2)
    # "busy": online work of 20 s at its speed, no free slot (co-serving).
    report(p, "busy", OfflineLoad(online_tokens=2000), now=0.0)
    report(p, "idle", IDLE, now=0.0)
    add(p, *(f"r{i}" for i in range(10)))
    got = p.assign(now=0.1)
    # The idle replica fills its 4 free slots and its queue of 2 first; only
    # then does the busy one get its queue's worth, to fill the budget its
    # online work leaves (ConServe §4.5); the rest waits in the pool.
    assert [r for _, r in got] == ["idle"] * 6 + ["busy"] * 2
    assert [rid for rid, _ in got] == [f"r{i}" for i in range(8)]
    assert len(p) == 2 and p.room("idle") == 0 and p.room("busy") == 0
    s = p.stats(now=0.1)
    assert s["waiting"] == 2 and s["handed_out"] == 8
    assert s["replicas"]["idle"]["pending_jobs"] == 6
    assert s["replicas"]["busy"]["assigned_jobs"] == 2


def test_spare_capacity_is_work_over_speed_then_free_blocks():
    p = pool(queue_jobs=1)
    # Same queued work; "fast" computes it in a tenth of the time.
    report(p, "slow", OfflineLoad(online_tokens=500), now=0.0, tps=100.0)
    report(p, "fast", OfflineLoad(online_tokens=500), now=0.0, tps=1000.0)
    add(p, "a")
    assert p.assign(now=0.0) == [("a", "fast")]
    q = pool(queue_jobs=1)
    report(q, "full", IDLE, now=0.0, free_blocks=10)
    report(q, "empty", IDLE, now=0.0, free_blocks=90)
    add(q, "a", "b")
    # Equal (no) work: the most free KV blocks first; then "empty" has
    # the handed-out request's work and "full" none.
    assert q.assign(now=0.0) == [("a", "empty"), ("b", "full")]


def test_a_replica_with_a_full_offline_queue_gets_nothing_until_it_drains():
    p = pool(queue_jobs=2)
    report(p, "a", OfflineLoad(queued_jobs=2, running_jobs=4), now=0.0)
    add(p, "x", "y")
    assert p.assign(now=0.1) == []
    # Reports that still show a full queue change nothing.
    report(p, "a", OfflineLoad(queued_jobs=3, running_jobs=4), now=0.5)
    assert p.assign(now=0.5) == []
    # One queued job went into the batch: room for one.
    report(p, "a", OfflineLoad(queued_jobs=1, running_jobs=4), now=1.0)
    assert p.assign(now=1.0) == [("x", "a")]
    assert p.assign(now=1.1) == []
    report(p, "a", OfflineLoad(queued_jobs=0, running_jobs=4, accepted=1), now=2.0)
    assert p.assign(now=2.0) == [("y", "a")]


def test_a_hand_out_counts_until_the_replicas_count_shows_it_arrived():
    p = pool(queue_jobs=1)
    report(p, "a", OfflineLoad(), now=0.0)
    add(p, "x", "y")
    assert p.assign(now=0.0) == [("x", "a")]
    # Reports sent before "x" reached the replica, however late: "x" still
    # counts, so its place is not given twice.
    for t in (0.2, 5.0):
        report(p, "a", OfflineLoad(), now=t)
        assert p.assign(now=t) == []
    # The replica accepted it: in its own figures now, counted once.
    report(p, "a", OfflineLoad(queued_jobs=1, accepted=1), now=5.1)
    assert p.assign(now=5.1) == []
    report(p, "a", OfflineLoad(running_jobs=1, accepted=1), now=5.2)
    assert p.assign(now=5.2) == [("y", "a")]
    # "y" never arrives (its client went away between the two calls and its
    # admit had returned): after lost_after_s it no longer counts.
    add(p, "z")
    report(p, "a", OfflineLoad(running_jobs=1, accepted=1), now=10.0)
    assert p.assign(now=10.0) == []
    report(p, "a", OfflineLoad(running_jobs=1, accepted=1), now=15.3)
    assert p.assign(now=15.3) == [("z", "a")]


def test_an_arrival_already_released_settles_no_other_hand_out():
    p = pool(queue_jobs=1)
    report(p, "a", OfflineLoad(), now=0.0)
    add(p, "w", "v", "u")
    assert p.assign(now=0.0) == [("w", "a")]
    # "w" arrives and ends before any report counts it.
    p.release("w")
    assert p.assign(now=0.1) == [("v", "a")]
    # The next report counts w's arrival, not v's: v, on its way, counts.
    report(p, "a", OfflineLoad(accepted=1), now=0.5)
    assert p.assign(now=0.5) == []
    report(p, "a", OfflineLoad(queued_jobs=1, accepted=2), now=1.0)
    assert p.assign(now=1.0) == []
    report(p, "a", OfflineLoad(accepted=2), now=2.0)
    assert p.assign(now=2.0) == [("u", "a")]


def test_cancellation_of_waiting_and_handed_out_requests_leaves_nothing_behind():
    p = pool(queue_jobs=1)
    add(p, "a", "b", "c")
    assert p.cancel("b") == "waiting"
    assert "b" not in p and len(p) == 2
    report(p, "r", OfflineLoad(), now=0.0)
    assert p.assign(now=0.0) == [("a", "r")]
    # "a"'s client went away before it was sent on: its place is back.
    assert p.cancel("a") == "handed_out"
    assert p.assign(now=0.1) == [("c", "r")]
    report(p, "r", OfflineLoad(running_jobs=1, accepted=1), now=0.5)
    p.release("c")  # it ended
    assert p.cancel("c") is None and p.cancel("never") is None
    p.release("never")
    assert len(p) == 0 and not p.handed and not p._queues and not p._levels
    assert not p._owed
    assert p.stats(now=0.6)["waiting"] == 0
    # A cancelled id may come back (a retry with the same id).
    add(p, "b")
    report(p, "r", OfflineLoad(accepted=1), now=0.7)
    assert p.assign(now=0.7) == [("b", "r")]
    with pytest.raises(ValueError):
        add(p, "b")


def test_lower_priority_value_first_fifo_within_one():
    p = pool(queue_jobs=10)
    add(p, "late-low", priority=5)
    add(p, "first", priority=0)
    add(p, "second", priority=0)
    add(p, "urgent", priority=-1)
    report(p, "r", OfflineLoad(), now=0.0)
    assert [rid for rid, _ in p.assign(now=0.0)] == ["urgent", "first", "second", "late-low"]


def test_nothing_starves_when_every_replica_is_busy():
    p = pool(queue_jobs=1)
    busy = OfflineLoad(online_tokens=1000, queued_jobs=1)
    report(p, "a", busy, now=0.0)
    report(p, "b", busy, now=0.0)
    add(p, "big", n=8, now=0.0)
    add(p, "small", now=0.0)
    for t in (0.5, 1.0, 1.5):
        report(p, "a", busy, now=t)
        report(p, "b", busy, now=t)
        assert p.assign(now=t) == []
    assert p.stats(now=1.5)["oldest_wait_s"] == 1.5
    # Capacity appears on "b": the head goes first, whatever its size (a
    # replica with room takes it whole), and the rest follows in order.
    report(p, "b", OfflineLoad(online_tokens=1000), now=2.0)
    assert p.assign(now=2.0) == [("big", "b")]
    report(p, "b", OfflineLoad(accepted=1), now=3.0)
    assert p.assign(now=3.0) == [("small", "b")]
    assert len(p) == 0


def test_requests_wait_for_a_first_report_and_stale_replicas_get_nothing():
    p = pool()
    add(p, "x")
    assert p.assign(now=0.0) == []  # no replica has reported yet
    report(p, "old", IDLE, now=0.0)
    assert p.assign(now=6.0) == []  # silent for longer than stale_after_s
    assert p.stats(now=6.0)["replicas"] == {}
    report(p, "new", IDLE, now=6.0)
    assert p.assign(now=6.0) == [("x", "new")]


def test_drain_empties_the_pool_in_order():
    p = pool()
    add(p, "b", priority=1)
    add(p, "a")
    assert p.drain() == ["a", "b"]
    assert len(p) == 0 and p.assign(now=0.0) == []


def _job(jid: str, cls: JobClass, prompt: int = 10, max_tokens: int = 100) -> Job:
    return Job(jid, [1] * prompt, max_tokens=max_tokens, arrival_time=0.0, job_class=cls)


def test_offline_load_counts_by_class_and_batch():
    on = _job("on", JobClass.ONLINE)
    run = _job("run", JobClass.OFFLINE)
    wait = _job("wait", JobClass.OFFLINE, prompt=30)
    load = offline_load([on, run, wait], batch={"on", "run"}, mean_output_len=50,
                        batch_limit=8, free_blocks=100, block_size=16,
                        inbox_jobs=2, inbox_tokens=70)
    # online: 10 + 50 expected; queued: "wait" (30 + 50) and the inbox's 2.
    assert load == OfflineLoad(online_tokens=60, queued_jobs=3, queued_tokens=150,
                               running_jobs=1, free_slots=0)


def test_free_slots_only_in_offline_batching_mode_and_within_kv():
    run = [_job(f"r{i}", JobClass.OFFLINE) for i in range(3)]
    ids = {j.job_id for j in run}

    def slots(jobs: list[Job], free_blocks: int, inbox: int = 0) -> int:
        return offline_load(jobs, ids, mean_output_len=64, batch_limit=8,
                            free_blocks=free_blocks, block_size=16, inbox_jobs=inbox).free_slots

    assert slots(run, free_blocks=100) == 5  # batch limit 8, 3 running
    assert slots(run, free_blocks=8) == 2  # 4 blocks per mean answer
    assert slots(run + [_job("on", JobClass.ONLINE)], free_blocks=100) == 0
    assert slots(run + [_job("w", JobClass.OFFLINE)], free_blocks=100) == 0
    assert slots(run, free_blocks=100, inbox=1) == 0


def test_config_bounds_name_the_field():
    with pytest.raises(ValidationError, match="replica_queue_jobs"):
        OfflinePoolConfig(replica_queue_jobs=0)
    with pytest.raises(ValidationError, match="replica_queue_job\\b"):
        OfflinePoolConfig(replica_queue_job=3)


def test_unstarted_work_on_a_replica_busy_with_online_work_goes_back_for_free_slots():
    from scheduler.offline_pool import GIVE_BACK_EVERY_S

    p = pool(queue_jobs=2)
    busy = OfflineLoad(online_tokens=2000, queued_jobs=3)
    report(p, "busy", busy, now=0.0)
    report(p, "idle", OfflineLoad(free_slots=2), now=0.0)
    # The idle replica's two free slots take two of the three.
    assert p.to_give_back("busy", now=0.0) == 2
    # Not asked again before its reports can show what it gave.
    assert p.to_give_back("busy", now=GIVE_BACK_EVERY_S - 0.1) == 0
    assert p.to_give_back("busy", now=GIVE_BACK_EVERY_S) == 2
    assert p.stats(now=GIVE_BACK_EVERY_S)["give_backs_asked"] == 2
    # Nothing for an idle replica to hold, or none serving online work.
    assert p.to_give_back("idle", now=10.0) == 0
    report(p, "calm", OfflineLoad(queued_jobs=3), now=10.0)
    assert p.to_give_back("calm", now=10.0) == 0


def test_nothing_goes_back_while_the_pool_has_work_for_the_free_slots():
    p = pool(queue_jobs=2)
    report(p, "busy", OfflineLoad(online_tokens=2000, queued_jobs=3), now=0.0)
    report(p, "idle", OfflineLoad(free_slots=2, queued_jobs=2), now=0.0)
    add(p, "w")  # the idle replica's room goes to the pool's own first
    assert p.to_give_back("busy", now=0.0) == 0
    assert [r for _, r in p.assign(now=0.0)] == ["idle"]
    # Its hand-out, not yet in its figures, takes one of the two slots.
    report(p, "idle", OfflineLoad(free_slots=2), now=0.1)
    assert p.to_give_back("busy", now=0.1) == 1
    # Switched off: never.
    off = OfflinePool(OfflinePoolConfig(move_queued=False))
    report(off, "busy", OfflineLoad(online_tokens=2000, queued_jobs=3), now=0.0)
    report(off, "idle", OfflineLoad(free_slots=2), now=0.0)
    assert off.to_give_back("busy", now=0.0) == 0


def test_only_whole_unstarted_offline_requests_can_be_given_back():
    from scheduler.offline_pool import movable_offline

    def job(jid: str, cls: JobClass = JobClass.OFFLINE, computed: int = 0,
            out: list[int] | None = None) -> Job:
        j = Job(job_id=jid, prompt_token_ids=[1, 2, 3], max_tokens=4, arrival_time=0.0,
                job_class=cls)
        j.num_computed_tokens = computed
        j.output_token_ids = list(out or [])
        j.block_table = [0] if computed else []
        return j

    jobs = {j.job_id: j for j in [
        job("old"), job("started", computed=2), job("resumed", out=[5]),
        job("online", JobClass.ONLINE), job("pair"), job("pair#1", computed=3),
        job("running"), job("new")]}
    groups = {rid: [rid] for rid in ("old", "started", "resumed", "online", "running", "new")}
    groups["pair"] = ["pair", "pair#1"]  # one of its choices has started
    assert movable_offline(groups, jobs, {"running"}, 10) == ["new", "old"]
    assert movable_offline(groups, jobs, {"running"}, 1) == ["new"]
    assert movable_offline(groups, jobs, (), 0) == []


def test_started_offline_requests_move_with_little_kv_to_recompute():
    """With `recompute_blocks`: a started job goes when its KV is in the
    host tier or nowhere, or on the device with at most that many blocks
    past its host copy, and no copy is in flight."""
    from scheduler.offline_pool import movable_offline

    def job(jid: str, device: int = 0, checkpointed: int = 0, host: int = 0,
            swap: str | None = None, out: int = 1) -> Job:
        j = Job(job_id=jid, prompt_token_ids=list(range(40)), max_tokens=64,
                arrival_time=0.0, job_class=JobClass.OFFLINE)
        j.output_token_ids = list(range(out))
        j.block_table = list(range(device))
        j.num_checkpointed_blocks = checkpointed
        j.num_host_blocks = host
        j.swap_pending = swap
        j.num_computed_tokens = 16 * max(device, host)
        return j

    jobs = {j.job_id: j for j in [
        job("to_checkpoint", host=3, checkpointed=3),  # preempted back to it
        job("recompute", out=5),  # preempted, nothing kept: recomputed anywhere
        job("all_but_last", device=3, checkpointed=2),  # resident, last block unsaved
        job("two_unsaved", device=3, checkpointed=1),
        job("never_saved", device=2),
        job("long_unsaved", device=5, checkpointed=2),
        job("swapping_in", host=3, checkpointed=3, swap="swap_in"),
        job("in_batch", device=1, checkpointed=1),
        job("unstarted", out=0)]}
    groups = {rid: [rid] for rid in jobs}
    moved = movable_offline(groups, jobs, {"in_batch"}, 10, recompute_blocks=2)
    assert moved == ["unstarted", "never_saved", "two_unsaved", "all_but_last", "recompute",
                     "to_checkpoint"]
    assert movable_offline(groups, jobs, {"in_batch"}, 10, recompute_blocks=1) == [
        "unstarted", "all_but_last", "recompute", "to_checkpoint"]
    # Without (a tier other replicas cannot read), only the unstarted.
    assert movable_offline(groups, jobs, {"in_batch"}, 10) == ["unstarted"]


def test_a_replica_taking_offline_work_in_fast_gets_a_deeper_queue():
    p = pool(queue_jobs=2)
    report(p, "fast", OfflineLoad(online_tokens=500, running_jobs=40, started=100), now=0.0)
    assert p.room("fast") == 2  # nothing known of its pace yet
    # Ten first tokens since its last report: a queue of twice that, so
    # that its budget does not run dry before the next hand-out.
    report(p, "fast", OfflineLoad(online_tokens=500, queued_jobs=5, running_jobs=45,
                                  started=110), now=0.5)
    assert p.room("fast") == 2 * 10 - 5
    add(p, *(f"r{i}" for i in range(30)))
    assert len(p.assign(now=0.5)) == 15
    # Its pace drops (its online work grew): back to the configured queue.
    report(p, "fast", OfflineLoad(online_tokens=900, queued_jobs=1, running_jobs=45,
                                  started=110, accepted=15), now=1.0)
    assert p.room("fast") == 1
    # Switched off: the configured queue whatever the pace.
    fixed = OfflinePool(OfflinePoolConfig(replica_queue_jobs=2, queue_per_start=0))
    report(fixed, "fast", OfflineLoad(started=100), now=0.0)
    report(fixed, "fast", OfflineLoad(started=110), now=0.5)
    assert fixed.room("fast") == 2
