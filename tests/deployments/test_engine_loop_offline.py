"""The engine loop's part in the offline pool and the autoscaler: giving
offline requests back, and the online token cadence (fake runner,
no Ray)."""

from __future__ import annotations

import time

from deployments.engine_loop import EngineLoop
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from tests.deployments.test_engine_loop import Collector, FakeRunner, make_loop, req


def test_unstarted_offline_requests_are_given_back_whole_and_newest_first():
    """What the offline pool asks of a replica busy with online work
    (scheduler/offline_pool.py): only requests of one prompt (`movable`)
    with nothing computed leave, each stream ended with `moved`."""
    runner = FakeRunner()
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=1,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic)
    sink = Collector()
    loop = EngineLoop(runner, core, lambda r, i: "ok", sink)  # driven by hand
    off = {"job_class": "offline"}
    loop.submit(req("first").model_copy(update=off), movable=True)
    loop.submit(req("a").model_copy(update=off), movable=True)
    loop.submit(req("pair").model_copy(update={**off, "n": 2}), movable=True)
    loop.submit(req("several").model_copy(update=off), movable=False)  # one prompt of more
    loop.submit(req("b").model_copy(update=off), movable=True)
    loop.submit(req("on"))
    assert loop._drain_inbox() == []
    loop._iterate()  # batch of one: "first" starts, the others wait
    assert core.jobs["first"].num_computed_tokens > 0
    loop.give_back(3)
    moved = loop._drain_inbox()
    assert [d.event.job_id for d in moved] == ["b", "pair", "a"]
    assert all(d.moved and d.event.finished and d.error for d in moved)
    assert set(core.jobs) == {"first", "several", "on"}
    assert set(runner.requests) == {"first", "several", "on"}
    assert loop.num_given_back == 3 and loop._movable == {"first"}
    loop.give_back(5)  # nothing left that has not started or may move
    assert loop._drain_inbox() == [] and loop.num_given_back == 3
    loop.stop()


def test_started_offline_requests_are_given_back_where_their_kv_can_follow():
    """A started request waiting with no device block (here one that came
    resumed and has not run again) moves only where the replica's host tier
    is one every replica reads (`move_recompute_blocks`), the Engine's case
    with the application's tier."""
    runner = FakeRunner()
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=1,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic)
    loop = EngineLoop(runner, core, lambda r, i: "ok", Collector())  # driven by hand
    off = {"job_class": "offline"}
    loop.submit(req("first").model_copy(update=off), movable=True)
    loop.submit(req("started", max_tokens=6).model_copy(update={**off, "resume": [[7, 8]]}),
                movable=True)
    loop.submit(req("fresh").model_copy(update=off), movable=True)
    assert loop._drain_inbox() == []
    loop._iterate()  # batch of one: "first" starts, the others wait
    assert core.jobs["started"].output_token_ids == [7, 8]
    loop.give_back(5)
    assert [d.event.job_id for d in loop._drain_inbox()] == ["fresh"]
    loop.move_recompute_blocks = 4
    loop.give_back(5)
    moved = loop._drain_inbox()
    assert [d.event.job_id for d in moved] == ["started"]
    assert moved[0].moved and set(core.jobs) == set(runner.requests) == {"first"}
    assert loop.num_given_back == 2 and loop._movable == {"first"}
    loop.stop()


def test_a_request_given_back_keeps_its_host_copy_only_if_its_client_has_tokens():
    """Its next replica adopts the copy only when it resumes from the
    client's tokens; a copy of one without any (here: a resumed request whose
    client had none) is dropped here, not left in the tier."""
    from scheduler.plan import BlockOpKind

    runner = FakeRunner()
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=1,
                                         max_batch_tokens=64, max_model_len=64,
                                         host_kv_blocks=16), time.monotonic)
    loop = EngineLoop(runner, core, lambda r, i: "ok", Collector())  # driven by hand
    loop.move_recompute_blocks = 4
    off = {"job_class": "offline", "resume_kv_blocks": [1]}
    loop.submit(req("first").model_copy(update={"job_class": "offline"}), movable=True)
    loop.submit(req("tokens", n_prompt=6).model_copy(update={**off, "resume": [[7]]}),
                movable=True)
    loop.submit(req("none", n_prompt=6).model_copy(update={**off, "resume": [[]]}),
                movable=True)
    assert loop._drain_inbox() == []
    loop._iterate()  # batch of one: "first"; the others wait on the host tier
    assert core.swap.host_used == 2
    loop.give_back(5)
    assert {d.event.job_id for d in loop._drain_inbox()} == {"tokens", "none"}
    drops = [op.job_id for op in core.swap.pending_ops if op.kind is BlockOpKind.DROP]
    assert drops == ["none"] and core.swap.host_used == 0
    loop.stop()


def test_only_online_decodes_make_the_autoscalers_tpot_cadence():
    """A batch job alone decodes in large, slow iterations; they must not
    read as online TPOT (scheduler/autoscale.py, `online_cadence`)."""
    loop, sink, core = make_loop(FakeRunner(), policy="conserve")
    try:
        loop.submit(req("off", max_tokens=6).model_copy(update={"job_class": "offline"}))
        sink.wait_finished({"off"})
        assert not loop.stats.decode_gaps
        loop.submit(req("on", max_tokens=6))
        sink.wait_finished({"on"})
        # Five decodes, each after another: four gaps.
        assert len(loop.stats.decode_gaps) == 4
    finally:
        loop.stop()
