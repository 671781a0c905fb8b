"""EngineLoop.shutdown: every job in flight ends with an error, nothing hangs."""

from __future__ import annotations

import threading
import time

from deployments.delivery import Delivery
from deployments.engine_loop import EngineLoop
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.plan import Plan, StepResult
from tests.deployments.test_engine_loop import Collector, FakeRunner, make_loop, req


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def errors(sink: Collector) -> dict[str, Delivery]:
    return {d.event.job_id: d for d in sink.items if d.error is not None}


class GatedRunner(FakeRunner):
    """Blocks inside execute() until released, like a long forward pass."""

    def __init__(self) -> None:
        super().__init__(step_s=0.0)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.added: list[str] = []

    def add_request(self, job_id: str, params: object, prompt_token_ids: list[int],
                    output_token_ids: list[int] | None = None) -> None:
        self.added.append(job_id)
        super().add_request(job_id, params, prompt_token_ids)

    def execute(self, plan: Plan) -> StepResult:
        if plan.chunks:
            self.entered.set()
            self.gate.wait(10)
        return super().execute(plan)


def test_shutdown_ends_running_jobs_with_the_reason_and_frees_everything():
    runner = FakeRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    for i in range(3):
        loop.submit(req(f"r{i}", max_tokens=60))
    wait_for(lambda: {d.event.job_id for d in sink.items} >= {"r0", "r1", "r2"})

    assert loop.shutdown("the server is shutting down") == 3

    assert not loop.alive
    errs = errors(sink)
    assert set(errs) == {"r0", "r1", "r2"}
    for d in errs.values():
        assert d.stopped and d.error == "the server is shutting down"
        assert d.event.finished and d.event.finish_reason == "error"
    # Each job's error is its last delivery: no token after it.
    for rid in errs:
        assert [d for d in sink.items if d.event.job_id == rid][-1] is errs[rid]
    assert not core.jobs and not core.has_work
    assert core.blocks.num_free == core.blocks.num_blocks
    assert runner.requests == {}
    assert loop.closed == "the server is shutting down"


def test_requests_after_shutdown_are_refused_at_once():
    runner = FakeRunner()
    loop, sink, core = make_loop(runner)
    loop.shutdown("going away")
    calls = sink.calls

    loop.submit(req("late").model_copy(update={"n": 2}))

    # Delivered synchronously by submit(), for each of the request's choices.
    assert sink.calls == calls + 1
    errs = errors(sink)
    assert set(errs) == {"late", "late#1"}
    assert all(d.stopped and d.error == "going away" for d in errs.values())
    assert not core.jobs and runner.requests == {}


def test_requests_waiting_in_the_inbox_are_refused_and_the_iteration_in_progress_finishes():
    runner = GatedRunner()
    loop, sink, core = make_loop(runner)
    loop.submit(req("running", max_tokens=50))
    assert runner.entered.wait(5)
    loop.submit(req("queued"))  # sits in the inbox behind the forward pass

    stopper = threading.Thread(target=loop.shutdown, args=("stop",))
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive()  # waits for the forward pass, does not tear it
    runner.gate.set()
    stopper.join(5)

    assert not stopper.is_alive() and not loop.alive
    errs = errors(sink)
    assert set(errs) == {"running", "queued"}
    assert all(d.stopped and d.error == "stop" for d in errs.values())
    assert runner.added == ["running"]  # the queued request never reached the runner
    assert runner.requests == {} and not core.jobs
    assert core.blocks.num_free == core.blocks.num_blocks


def test_shutdown_is_idempotent():
    loop, sink, core = make_loop(FakeRunner(step_s=0.01))
    loop.submit(req("a", max_tokens=60))
    wait_for(lambda: any(d.event.job_id == "a" for d in sink.items))
    assert loop.shutdown("first") == 1
    n = len(sink.items)

    assert loop.shutdown("second") == 1
    loop.stop()

    assert len(sink.items) == n
    assert loop.closed == "first"


def test_shutdown_before_start_ends_submitted_requests():
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic)
    sink = Collector()
    loop = EngineLoop(FakeRunner(), core, lambda r, i: "ok", sink)
    loop.submit(req("early"))

    loop.shutdown("never started")

    assert set(errors(sink)) == {"early"}
    assert errors(sink)["early"].error == "never started"


def test_a_crashed_loop_thread_ends_its_jobs_instead_of_leaving_them_hanging():
    runner = FakeRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    loop.submit(req("victim", max_tokens=60))
    wait_for(lambda: any(d.event.job_id == "victim" for d in sink.items))

    def broken_schedule() -> Plan:
        raise RuntimeError("planner bug")

    core.schedule = broken_schedule  # type: ignore[method-assign]
    wait_for(lambda: not loop.alive)

    d = errors(sink)["victim"]
    assert d.stopped and d.error == "internal error in the engine"
    assert runner.requests == {}
    # Later requests fail fast too, rather than waiting on a dead thread.
    loop.submit(req("after"))
    assert errors(sink)["after"].error == "internal error in the engine"


def test_serve_logs_a_stopped_job_as_one_info_line_not_a_failure_traceback():
    import logging
    import sys

    from deployments.engine import _StoppedJobLogs
    from deployments.delivery import EngineStopped

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1,
                                     "Request failed.", None, sys.exc_info())

    stopped = record(EngineStopped("the server is shutting down"))
    assert _StoppedJobLogs().filter(stopped)
    assert stopped.levelno == logging.INFO and stopped.exc_info is None
    assert stopped.getMessage().endswith("the server is shutting down")
    # A request's own error stays an error, with its traceback.
    bad = record(ValueError("bad params"))
    assert _StoppedJobLogs().filter(bad)
    assert bad.levelno == logging.ERROR and bad.exc_info is not None
