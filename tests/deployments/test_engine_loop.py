"""The engine replica's iteration loop with a fake runner (no Ray, no model)."""

from __future__ import annotations

import itertools

import threading
import time

import pytest

from api.protocol import GenerateRequest
from deployments.delivery import Delivery
from deployments.engine_loop import EngineLoop
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.plan import JobOutput, Plan, StepResult


class FakeRunner:
    def __init__(self, step_s: float = 0.002, fail_on: str | None = None,
                 head_estimate: int | None = None) -> None:
        self.step_s = step_s
        self.fail_on = fail_on
        # Handed out with each first token, as a length head does.
        self.head_estimate = head_estimate
        self.requests: dict[str, object] = {}
        self.resumed_from: dict[str, list[int]] = {}

    def add_request(self, job_id: str, params: object, prompt_token_ids: list[int],
                    output_token_ids: list[int] | None = None) -> None:
        if params == "bad":
            raise ValueError("bad params")
        self.requests[job_id] = params
        self.resumed_from[job_id] = list(output_token_ids or [])

    def remove_request(self, job_id: str) -> None:
        self.requests.pop(job_id, None)

    def execute(self, plan: Plan) -> StepResult:
        if any(c.job_id == self.fail_on for c in plan.chunks):
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        outs = [JobOutput(c.job_id, 7 + c.output_index if c.sample else None,
                          text=f"<{c.output_index}>" if c.sample else "",
                          predicted_output_len=(self.head_estimate if c.sample
                                                and c.output_index == 0 else None))
                for c in plan.chunks]
        return StepResult(plan.step, outs, self.step_s)


_first_tokens = itertools.count(1000)


def req(rid: str, n_prompt: int = 5, max_tokens: int = 4) -> GenerateRequest:
    """A request whose prompt shares no KV block with another's."""
    prompt = [next(_first_tokens)] + list(range(2, n_prompt + 1))
    return GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
        temperature=0.0, top_p=1.0, top_k=-1, seed=None, stop=[], stop_token_ids=[],
        ignore_eos=True, min_tokens=0, arrival_time=time.monotonic())


class Collector:
    def __init__(self) -> None:
        self.items: list[Delivery] = []
        self.calls = 0
        self.cv = threading.Condition()

    def __call__(self, items: list[Delivery]) -> None:
        with self.cv:
            self.calls += 1
            self.items += items
            self.cv.notify_all()

    def wait_finished(self, rids: set[str], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cv:
            while not rids <= {d.event.job_id for d in self.items if d.event.finished}:
                left = deadline - time.monotonic()
                assert left > 0, "timed out waiting for jobs to finish"
                self.cv.wait(left)


def make_loop(runner: FakeRunner, **kw) -> tuple[EngineLoop, Collector, SchedulerCore]:
    cfg = dict(block_size=4, num_blocks=64, max_batch_size=8, max_batch_tokens=64,
               max_model_len=64)
    cfg.update(kw)
    core = SchedulerCore(SchedulerConfig(**cfg), time.monotonic)
    sink = Collector()
    loop = EngineLoop(runner, core, lambda r, i: "bad" if r.request_id.startswith("bad") else "ok", sink)
    loop.start()
    return loop, sink, core


def test_streams_tokens_and_batches_delivery_per_iteration():
    runner = FakeRunner()
    loop, sink, core = make_loop(runner)
    try:
        for i in range(4):
            loop.submit(req(f"r{i}", max_tokens=6))
        sink.wait_finished({f"r{i}" for i in range(4)})
        per_job = {f"r{i}": [d.event.token_id for d in sink.items if d.event.job_id == f"r{i}"]
                   for i in range(4)}
        assert all(toks == [7, 8, 9, 10, 11, 12] for toks in per_job.values())
        # Four jobs' tokens, delivered in far fewer calls than tokens.
        assert sink.calls < len(sink.items)
        last = [d for d in sink.items if d.event.finished]
        assert all(d.metrics is not None and d.metrics.e2e >= d.metrics.ttft >= 0 for d in last)
        assert core.blocks.num_free == core.blocks.num_blocks
        assert runner.requests == {}
        # The plan trace holds every plan, each job's six tokens in order.
        trace = loop.stats.plans()
        assert [r.step for r in trace] == sorted(r.step for r in trace)
        assert all(sum(i in r.jobs for r in trace) == 6 for i in per_job)
        assert all(r.iteration_time == runner.step_s for r in trace if r.jobs)
        # The scheduler's share of the host time is counted apart from the
        # pass, within the loop's busy time.
        st = loop.stats
        assert st.plan_time > 0 and st.complete_time > 0
        assert st.forward_time + st.plan_time + st.complete_time <= st.loop_time
    finally:
        loop.stop()


class LaunchingRunner(FakeRunner):
    """Calls `on_launch` mid-`execute`, as `ModelRunner` does once a pass
    is queued, and leaves each token's text for later (`defer_text`)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_launch = None
        self.defer_text = False
        # Per execute: deliveries the sink held before and after on_launch.
        self.seen: list[tuple[int, int]] = []
        self.sink: "Collector | None" = None

    def execute(self, plan: Plan) -> StepResult:
        assert self.sink is not None
        before = len(self.sink.items)
        if self.on_launch is not None:
            self.on_launch()
        self.seen.append((before, len(self.sink.items)))
        step = super().execute(plan)
        for o in step.outputs:
            if o.token_id is not None and self.defer_text:
                text, o.text = o.text, ""
                o.text_later = lambda text=text: text
        return step


def _launching(deliver=None) -> tuple[LaunchingRunner, Collector, EngineLoop]:
    runner = LaunchingRunner()
    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8, max_batch_tokens=64,
                          max_model_len=64)
    sink = Collector()
    runner.sink = sink
    loop = EngineLoop(runner, SchedulerCore(cfg, time.monotonic), lambda r, i: "ok",
                      deliver or sink)
    return runner, sink, loop


def test_an_iterations_tokens_leave_during_the_next_pass_and_before_idling():
    runner, sink, loop = _launching()
    assert runner.on_launch is not None and runner.defer_text
    loop.start()
    try:
        loop.submit(req("a", max_tokens=5))
        sink.wait_finished({"a"})
        got = [d.event for d in sink.items]
        assert [e.token_id for e in got] == [7, 8, 9, 10, 11]
        assert "".join(e.text for e in got) == "<0><1><2><3><4>"
        assert all(e.text_later is None for e in got)
        # The first pass had nothing to send; each later one sent the
        # previous iteration's token while it ran; the last token left
        # when the loop went idle, not during a pass.
        assert runner.seen[0] == (0, 0)
        assert [after - before for before, after in runner.seen[1:]] == [1, 1, 1, 1]
    finally:
        loop.stop()


def test_a_failed_delivery_still_ends_the_loop_not_the_next_iteration():
    calls = 0

    def deliver(items):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ConnectionError("the replica's event loop is gone")
        sink(items)

    runner, sink, loop = _launching(deliver)
    loop.start()
    try:
        loop.submit(req("a", max_tokens=8))
        deadline = time.monotonic() + 5
        while loop.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.alive  # as when delivery failed before
        assert loop.closed == "internal error in the engine"
        assert not any(d.error == "internal error in the engine" and d.internal
                       for d in sink.items)  # no iteration was failed for it
    finally:
        loop.stop()


def test_abort_frees_blocks_and_runner_state():
    runner = FakeRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("long", max_tokens=50))
        deadline = time.monotonic() + 5
        while not any(d.event.job_id == "long" for d in sink.items):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        loop.abort("long")
        deadline = time.monotonic() + 5
        while core.has_work or runner.requests:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert core.blocks.num_free == core.blocks.num_blocks
        assert core.num_aborted == 1
        # Reported taken in (the Scheduler stops counting it as in transit).
        assert loop.stats.take_arrived() == ["long"] and loop.stats.take_arrived() == []
        # The dashboard counts it, as its client left it.
        [gone] = loop.stats.finished
        assert gone.finish_reason == "abort" and 0 < gone.output_tokens < 50
        assert gone.ttft is not None and gone.e2e >= gone.ttft
    finally:
        loop.stop()


def test_bad_request_and_failing_iteration_do_not_stop_the_loop():
    runner = FakeRunner(fail_on="doomed")
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("bad-1"))
        loop.submit(req("doomed"))
        sink.wait_finished({"bad-1", "doomed"})
        errs = {d.event.job_id: d.error for d in sink.items if d.event.finish_reason == "error"}
        assert errs["bad-1"] == "bad params"
        assert "doomed" in errs
        loop.submit(req("fine", max_tokens=3))
        sink.wait_finished({"fine"})
        assert core.blocks.num_free == core.blocks.num_blocks
    finally:
        loop.stop()


def test_the_engine_heads_estimate_is_not_replaced_by_a_later_prediction():
    """A predictor's answer landing after the engine's length head estimated
    the job (at its first token) leaves the head's estimate in place."""
    runner = FakeRunner(step_s=0.01, head_estimate=77)
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("p", max_tokens=40))
        deadline = time.monotonic() + 5
        while core.jobs.get("p") is None or not core.jobs["p"].length_from_engine:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        loop.set_prediction("p", 123, 142)
        sink.wait_finished({"p"})
        last = next(d for d in sink.items if d.event.finished)
        assert last.metrics.predicted_output_len == 77
    finally:
        loop.stop()


def test_prediction_reaches_a_running_job_and_is_ignored_after_it_ends():
    runner = FakeRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("p", max_tokens=40))
        deadline = time.monotonic() + 5
        while "p" not in core.jobs:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        loop.set_prediction("p", 123, 142)
        deadline = time.monotonic() + 5
        while core.jobs.get("p") is not None and core.jobs["p"].allocated_output_len is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        job = core.jobs.get("p")
        # 40 steps of 10 ms: still running when the next iteration took it.
        assert job is not None and job.allocated_output_len == 142
        sink.wait_finished({"p"})
        last = next(d for d in sink.items if d.event.finished)
        assert last.metrics.predicted_output_len == 123
        # When it landed, counted from the job's arrival on the engine's clock.
        assert last.metrics.prediction_delay is not None
        assert 0.0 <= last.metrics.prediction_delay <= last.metrics.e2e
        delivered = sum(d.event.job_id == "p" for d in sink.items)
        loop.set_prediction("p", 5)  # too late: no job, no error
        loop.submit(req("q", max_tokens=2))
        sink.wait_finished({"q"})
        assert sum(d.event.job_id == "p" for d in sink.items) == delivered  # nothing more of p
        assert "p" not in core.jobs
    finally:
        loop.stop()


def test_a_jct_slo_sets_the_jobs_deadline_on_the_cores_clock():
    runner = FakeRunner(step_s=0.01)
    loop, sink, core = make_loop(runner)
    try:
        r = req("s", max_tokens=40).model_copy(update={"jct_slo_s": 5.0})
        before = core.clock()
        loop.submit(r)
        deadline = time.monotonic() + 5
        while "s" not in core.jobs:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert before + 5.0 <= core.jobs["s"].deadline <= core.clock() + 5.0
        sink.wait_finished({"s"})
    finally:
        loop.stop()


def test_n_choices_run_as_jobs_sharing_the_prompt_and_abort_together():
    runner = FakeRunner(step_s=0.005)
    loop, sink, core = make_loop(runner, max_batch_tokens=8)
    try:
        r = req("multi", n_prompt=13, max_tokens=4).model_copy(update={"n": 3})
        loop.submit(r)
        ids = {"multi", "multi#1", "multi#2"}
        sink.wait_finished(ids)
        per_job = {j: [d.event.token_id for d in sink.items if d.event.job_id == j] for j in ids}
        assert all(toks == [7, 8, 9, 10] for toks in per_job.values())
        # The siblings took the leader's 3 full blocks (12 tokens) each.
        assert core.stats().num_shared_prompt_tokens == 2 * 12
        assert core.blocks.num_free == core.blocks.num_blocks and runner.requests == {}

        loop.submit(req("gone", n_prompt=13, max_tokens=60).model_copy(update={"n": 2}))
        deadline = time.monotonic() + 5
        while not {"gone", "gone#1"} <= {d.event.job_id for d in sink.items}:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        loop.abort("gone")  # the request's id aborts every choice
        deadline = time.monotonic() + 5
        while core.has_work or runner.requests:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert core.num_aborted == 2 and core.blocks.num_free == core.blocks.num_blocks
    finally:
        loop.stop()


def test_an_iteration_failure_is_internal_and_a_refusal_is_not():
    runner = FakeRunner(fail_on="doomed")
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("bad-2"))
        loop.submit(req("doomed"))
        sink.wait_finished({"bad-2", "doomed"})
        kinds = {d.event.job_id: d.internal for d in sink.items if d.error is not None}
        assert kinds == {"bad-2": False, "doomed": True}
    finally:
        loop.stop()


def test_counts_tokens_preemptions_and_latencies_by_job_class():
    """What the dashboard's per-class figures come from (ConServe)."""
    runner = FakeRunner()
    # Room for one job's KV at a time: the online job takes the offline one's.
    loop, sink, core = make_loop(runner, policy="conserve", num_blocks=4, max_model_len=16)
    try:
        off = req("off-0", n_prompt=4, max_tokens=10).model_copy(
            update={"job_class": "offline", "admission_id": "off"})
        loop.submit(off)
        deadline = time.monotonic() + 5
        while loop.stats.tokens_by_class.get("offline", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        loop.submit(req("on", n_prompt=9, max_tokens=3))
        sink.wait_finished({"on", "off-0"})
        stats = loop.stats
        # A prompt of a request is reported under the request's admission id.
        assert stats.take_arrived() == ["off", "on"]
        assert stats.tokens_by_class == {"online": 3, "offline": 10}
        assert stats.offline_started == 1  # its first token, once, preempted or not
        assert stats.preemptions_by_class.get("offline", 0) >= 1
        assert "online" not in stats.preemptions_by_class
        done = {f.job_class: f for f in stats.finished}
        assert set(done) == {"online", "offline"}
        assert all(f.ttft is not None and f.ttft > 0 and f.tpot is not None and f.tpot > 0
                   and f.e2e >= f.ttft >= f.queue_time >= 0 for f in done.values())
        assert [(f.finish_reason, f.prompt_tokens, f.output_tokens)
                for f in (done["online"], done["offline"])] == [("length", 9, 3), ("length", 4, 10)]
    finally:
        loop.stop()


def test_an_online_arrival_cuts_a_long_offline_pass_but_not_one_about_to_end():
    """ConServe Algorithm 2 at the replica: the preempt flag is set for an
    online request when the pass under way would keep it past the TTFT
    objective, and left alone when the pass ends soon enough."""
    from engine.preemption import PreemptFlag
    from scheduler.cost import LinearCost
    from scheduler.plan import ScheduledChunk

    runner = FakeRunner()
    runner.preempt_flag = PreemptFlag()  # type: ignore[attr-defined]
    core = SchedulerCore(SchedulerConfig(
        policy="conserve", block_size=4, num_blocks=64, max_batch_size=8, max_batch_tokens=64,
        max_model_len=64, conserve={"ttft_slo_s": 0.09}), time.monotonic,
        cost=LinearCost(0.01, 0.001, 0.001))
    loop = EngineLoop(runner, core, lambda r, i: "ok", Collector())
    # A 60-token offline pass (70 ms by the estimate), 20 ms in; 20-token
    # online prompts (30 ms each).
    plan = Plan(1, [ScheduledChunk("off", list(range(60)), 0, list(range(15)), True, 0)],
                preemptible_at_layers=True)
    runner.running_pass = (plan, time.monotonic() - 0.02)  # type: ignore[attr-defined]
    loop.cutter.online_arrived(20)  # 50 + 30 <= 90: it waits for the pass
    assert not runner.preempt_flag.is_set()  # type: ignore[attr-defined]
    loop.cutter.online_arrived(60)  # both prompts (64 tokens in an iteration): 50 + 74 > 90
    assert runner.preempt_flag.is_set()  # type: ignore[attr-defined]
    runner.preempt_flag.clear()  # type: ignore[attr-defined]
    runner.running_pass = None  # type: ignore[attr-defined]
    loop.cutter.online_arrived(20)  # no pass under way: set, for the runner to spend
    assert runner.preempt_flag.is_set()  # type: ignore[attr-defined]


def test_offline_requests_in_the_inbox_count_until_drained():
    # What the offline pool counts as this replica's queued work from the
    # moment `submit` accepts a request (scheduler/offline_pool.py).
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8,
                                         max_batch_tokens=64, max_model_len=64,
                                         policy="conserve"), time.monotonic)
    sink = Collector()
    loop = EngineLoop(FakeRunner(), core, lambda r, i: "ok", sink)
    off = req("off", n_prompt=5, max_tokens=4).model_copy(update={"job_class": "offline", "n": 2})
    loop.submit(off)
    loop.submit(req("on"))
    assert loop.inbox_offline == {"off": (2, 5 + 2 * 4)}
    loop.start()
    try:
        sink.wait_finished({"off", "off#1", "on"})
        assert loop.inbox_offline == {}
    finally:
        loop.stop()
    # Still in the inbox at shutdown: refused, and no longer counted.
    closing = EngineLoop(FakeRunner(), core, lambda r, i: "ok", Collector())
    closing.submit(off)
    closing.shutdown("bye")
    assert closing.inbox_offline == {}


def test_a_resumed_request_goes_on_from_the_clients_tokens():
    """A request resumed after its replica failed (deployments/resume.py):
    each unfinished choice recomputes prompt and tokens and samples the
    next output; a finished one is not run."""
    from deployments.engine_loop import choice_job_ids

    runner = FakeRunner()
    loop, sink, core = make_loop(runner)
    try:
        r = req("again", max_tokens=4).model_copy(update={"n": 2, "resume": [None, [7, 8]]})
        loop.submit(r)
        first, second = choice_job_ids("again", 2)
        sink.wait_finished({second})
        got = [d.event.token_id for d in sink.items if d.event.job_id == second]
        assert got == [9, 10]  # outputs 2 and 3 (the fake samples 7 + index)
        assert (loop.stats.resumed_jobs, loop.stats.resumed_tokens) == (1, 5 + 2)
        assert runner.resumed_from[second] == [7, 8]
        assert first not in runner.resumed_from
        assert all(d.event.job_id != first for d in sink.items)
        with pytest.raises(ValueError, match="resume lists 1 choices, the request 2"):
            req("bad-resume").model_copy(update={"n": 2}).model_validate(
                {**r.model_dump(), "resume": [[1]]})
    finally:
        loop.stop()


def test_a_resumed_choice_starts_from_the_blocks_its_checkpoints_left():
    runner = FakeRunner()  # lands no fetch: the job waits for its blocks
    loop, sink, core = make_loop(runner, host_kv_blocks=16,
                                 survival={"checkpoint": True})
    try:
        r = req("back", n_prompt=10, max_tokens=6)
        r = r.model_copy(update={"resume": [[7, 8]], "resume_kv_blocks": [2]})
        loop.submit(r)
        deadline = time.monotonic() + 5
        while "back" not in core.jobs:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        job = core.jobs["back"]
        assert job.num_checkpointed_blocks == 2 and job.output_token_ids == [7, 8]
        assert loop.stats.resumed_kv_tokens == 8 and loop.stats.resumed_tokens == 12
    finally:
        loop.stop()
    with pytest.raises(ValueError, match="resume_kv_blocks goes with resume"):
        GenerateRequest.model_validate({**req("x").model_dump(), "resume_kv_blocks": [1]})
