"""The replica's loop keeping a pass in flight (`EngineLoop(ahead=True)`,
scheduler/ahead.py) with a fake runner that checks what each plan feeds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.engine_loop import EngineLoop
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.plan import PENDING_TOKEN, JobOutput, Plan, StepResult
from tests.deployments.test_engine_loop import Collector, FakeRunner, req


def token(index: int) -> int:
    return 7 + index


@dataclass
class Launched:
    plan: Plan
    sampled: set[str] = field(default_factory=set)


class AheadRunner(FakeRunner):
    """Token `7 + i` for output i; `stop_at[job] = i` ends the job there
    with "stop" (as EOS would).  Every decode's fed token must be the one
    the core was told, or PENDING when the pass in flight samples it."""

    def __init__(self, stop_at: dict[str, int] | None = None, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.stop_at = stop_at or {}
        self.in_flight: Launched | None = None
        self.num_pending_fed = 0

    def launch(self, plan: Plan) -> Launched:
        if any(c.job_id == self.fail_on for c in plan.chunks):
            raise RuntimeError("boom")
        for c in plan.chunks:
            if not c.is_decode:
                continue
            fed = c.token_ids[-1]
            if fed == PENDING_TOKEN:
                assert self.in_flight is not None and c.job_id in self.in_flight.sampled
                self.num_pending_fed += 1
            else:
                assert fed == token(c.output_index - 1), (c.job_id, fed, c.output_index)
        launched = Launched(plan, {c.job_id for c in plan.chunks if c.sample})
        self.in_flight = launched
        return launched

    def collect(self, pending: Launched) -> StepResult:
        time.sleep(self.step_s)
        if self.in_flight is pending:
            self.in_flight = None
        outs = []
        for c in pending.plan.chunks:
            if not c.sample or c.job_id not in self.requests:
                outs.append(JobOutput(c.job_id, None))
                continue
            stop = self.stop_at.get(c.job_id) == c.output_index
            outs.append(JobOutput(c.job_id, token(c.output_index), "stop" if stop else None,
                                  text=f"<{c.output_index}>"))
        return StepResult(pending.plan.step, outs, self.step_s)

    def can_run_ahead(self, pending: Launched, plan: Plan) -> bool:
        return True

    def execute(self, plan: Plan) -> StepResult:
        return self.collect(self.launch(plan))


def make_loop(runner: AheadRunner) -> tuple[EngineLoop, Collector, SchedulerCore]:
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic)
    sink = Collector()
    loop = EngineLoop(runner, core, lambda r, i: "ok", sink, ahead=True)
    loop.start()
    return loop, sink, core


def _tokens(sink: Collector, job: str) -> list[int | None]:
    return [d.event.token_id for d in sink.items if d.event.job_id == job]


def test_tokens_arrive_in_order_and_early_stops_drop_the_launched_token() -> None:
    runner = AheadRunner(stop_at={"r1": 2, "r3": 0})
    loop, sink, core = make_loop(runner)
    try:
        for i in range(4):
            loop.submit(req(f"r{i}", max_tokens=6))
        sink.wait_finished({f"r{i}" for i in range(4)})
        assert _tokens(sink, "r0") == [token(i) for i in range(6)]
        assert _tokens(sink, "r1") == [token(i) for i in range(3)]
        assert _tokens(sink, "r3") == [token(0)]
        last = {d.event.job_id: d for d in sink.items if d.event.finished}
        assert last["r1"].event.finish_reason == "stop"
        assert last["r0"].event.finish_reason == "length"
        assert all(d.metrics is not None for d in last.values())
        # A finished job is delivered once, and nothing after it.
        assert [d.event.job_id for d in sink.items].count("r1") == 3
        assert runner.num_pending_fed > 5 and loop.driver.num_ahead >= 4  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while loop.driver.in_flight is not None or runner.requests:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert core.blocks.num_free == core.blocks.num_blocks and not core.jobs
    finally:
        loop.stop()


def test_abort_and_a_failed_pass_do_not_stop_the_loop() -> None:
    runner = AheadRunner(fail_on="doomed", step_s=0.005)
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("long", max_tokens=40))
        deadline = time.monotonic() + 5
        while len(_tokens(sink, "long")) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        loop.abort("long")
        loop.submit(req("doomed"))
        sink.wait_finished({"doomed"})
        loop.submit(req("fine", max_tokens=5))
        sink.wait_finished({"fine"})
        assert _tokens(sink, "fine") == [token(i) for i in range(5)]
        errors = {d.event.job_id for d in sink.items if d.event.finish_reason == "error"}
        assert errors == {"doomed"}
        assert len(_tokens(sink, "long")) < 40
        deadline = time.monotonic() + 5
        while core.jobs or runner.requests:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert core.blocks.num_free == core.blocks.num_blocks
    finally:
        loop.stop()


def test_shutdown_delivers_the_pass_in_flight_before_the_errors() -> None:
    runner = AheadRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    loop.submit(req("a", max_tokens=60))
    deadline = time.monotonic() + 5
    while len(_tokens(sink, "a")) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert loop.shutdown("going away") == 1
    toks = _tokens(sink, "a")
    assert toks[-1] is None and sink.items[-1].stopped
    assert toks[:-1] == [token(i) for i in range(len(toks) - 1)]
    assert core.blocks.num_free == core.blocks.num_blocks and runner.requests == {}
