"""The simulated device (bench/sim_executor.py) and the simulator's use of
the server's iteration driver."""

from __future__ import annotations

from typing import Any

import pytest

import bench.simulator as simulator
from bench.sim_executor import SimulatedExecutor, VirtualClock
from scheduler.iteration import Iteration, IterationDriver
from scheduler.plan import BlockOp, BlockOpKind, Plan, ScheduledChunk
from tests.bench.test_simulator import UnitCost, _three_jobs_in_six_blocks, by_id


def decode(job_id: str) -> ScheduledChunk:
    return ScheduledChunk(job_id, [5], 9, [0, 1, 2], sample=True, output_index=1)


def swap_in(job_id: str, n: int) -> list[BlockOp]:
    return [BlockOp(BlockOpKind.SWAP_IN, job_id, 0, list(range(n)))]


def test_reactive_copies_stall_the_iteration_and_land_with_it():
    clock = VirtualClock(10.0)
    dev = SimulatedExecutor(UnitCost(), clock, overlap_swap=False, next_arrival=lambda: None)
    res = dev.execute(Plan(step=1, chunks=[decode("a")], block_ops=swap_in("b", 2)))
    # 1 s compute + 2 blocks x 0.5 s on the critical path.
    assert res.iteration_time == 2.0 and clock.now == 12.0
    assert res.swaps_in_done == ["b"] and dev.swaps_in_flight == 0
    assert dev.exec_time == {"a": 1.0}
    assert dev.swap_time == {"a": 1.0, "b": 2.0}  # exposed copy; b blocked from issue
    assert (dev.totals.busy_time, dev.totals.exposed_swap_time) == (2.0, 1.0)


def test_overlapped_swap_in_lands_later_and_the_wait_jumps_to_it():
    clock = VirtualClock()
    dev = SimulatedExecutor(UnitCost(), clock, overlap_swap=True, next_arrival=lambda: None)
    res = dev.execute(Plan(step=1, chunks=[decode("a")], block_ops=swap_in("b", 4)))
    # The 2 s copy runs beside the 1 s forward pass: not landed yet.
    assert res.iteration_time == 1.0 and res.swaps_in_done == [] and dev.swaps_in_flight == 1
    empty = Plan(step=2)
    res = dev.execute(empty)
    assert res.iteration_time == 0.0 and clock.now == 1.0
    res = dev.wait_for_swaps(empty, res)
    assert clock.now == 2.0 and res.swaps_in_done == ["b"]
    assert dev.swap_time == {"b": 2.0} and dev.totals.swap_in_lane_busy == 2.0
    assert dev.totals.busy_time == 1.0  # waiting is not busy


def test_the_wait_stops_at_an_arrival():
    clock = VirtualClock()
    dev = SimulatedExecutor(UnitCost(), clock, overlap_swap=True, next_arrival=lambda: 0.5)
    dev.execute(Plan(step=1, block_ops=swap_in("b", 4)))
    res = dev.wait_for_swaps(Plan(step=2), dev.execute(Plan(step=2)))
    assert clock.now == 1.0 and res.swaps_in_done == []  # past the arrival already
    dev2 = SimulatedExecutor(UnitCost(), VirtualClock(), overlap_swap=True,
                             next_arrival=lambda: 1.5)
    dev2.execute(Plan(step=1, chunks=[decode("a")], block_ops=swap_in("b", 4)))
    res = dev2.wait_for_swaps(Plan(step=2), dev2.execute(Plan(step=2)))
    assert dev2.clock.now == 1.5 and res.swaps_in_done == [] and dev2.swaps_in_flight == 1


def test_a_plan_of_copies_alone_is_an_iteration_not_a_wait():
    clock = VirtualClock()
    dev = SimulatedExecutor(UnitCost(), clock, overlap_swap=False, next_arrival=lambda: 9.0)
    plan = Plan(step=1, block_ops=swap_in("b", 1))
    res = dev.execute(plan)
    assert clock.now == 1.5
    assert dev.wait_for_swaps(plan, res) is res and clock.now == 1.5


class CountingDriver(IterationDriver):
    steps: list[Iteration] = []

    def step(self) -> Iteration:
        it = super().step()
        CountingDriver.steps.append(it)
        return it


class SlowCopy(UnitCost):
    """Copies of 3 s a block: an overlapped swap-in outlasts an iteration."""

    def swap_time(self, num_blocks: int) -> float:
        return 3.0 * num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_the_simulator_runs_the_server_step(monkeypatch: Any, overlap: bool):
    CountingDriver.steps = []
    monkeypatch.setattr(simulator, "IterationDriver", CountingDriver)
    reqs, config = _three_jobs_in_six_blocks()
    out = simulator.simulate(reqs, config, SlowCopy(), simulator.SimOptions(overlap_swap=overlap))
    steps = CountingDriver.steps
    assert all(x.ok and x.output_tokens == 8 for x in out.records)
    assert out.stats.swap_in_blocks > 0
    # Every iteration the simulator counted was a driver step.
    executed = [it for it in steps if not it.plan.is_empty]
    assert len(executed) == out.stats.iterations
    assert sum(len(it.plan.chunks) for it in executed) == out.stats.sum_batch_size
    # The swap-in is issued by a plan of copies alone: the driver's wait
    # rule applies, but that plan is an iteration of its own (1 s, plus the
    # 6 s copy when it is on the critical path).
    issue = next(it for it in steps if any(op.kind is BlockOpKind.SWAP_IN
                                           for op in it.plan.block_ops))
    assert issue.waited and not issue.plan.chunks
    assert issue.result.iteration_time == (1.0 if overlap else 7.0)
    idle = [it for it in steps if it.plan.is_empty]
    if overlap:
        # Issued at 13, 6 s on its lane: the next, empty plan waits, and the
        # clock jumps to the landing at 19, where j2 runs again.
        assert issue.planned_at == 13.0
        assert [(it.planned_at, it.result.swaps_in_done) for it in idle] == [(14.0, ["j2"])]
        assert steps[steps.index(idle[0]) + 1].planned_at == 19.0
        assert by_id(out)["j2"].swap_time == pytest.approx(6.0)
    else:
        # Reactive: the copy lands with the plan that issued it.
        assert idle == [] and issue.result.swaps_in_done == ["j2"]
    assert all(it.waited for it in idle)


class FourLayers(UnitCost):
    """1 s passes of four 0.25 s layers."""

    class model:
        num_layers = 4


def test_an_online_arrival_cuts_a_preemptible_pass_at_the_next_layer():
    clock = VirtualClock(10.0)
    dev = SimulatedExecutor(FourLayers(), clock, overlap_swap=False, next_arrival=lambda: None,
                            next_online_after=lambda t: (10.3, 1) if t < 10.3 else None)
    plan = Plan(step=1, chunks=[decode("a")], preemptible_at_layers=True)
    res = dev.execute(plan)
    # Arrival 0.3 s into the pass: it stops at the end of the second layer.
    assert res.interrupted and res.outputs == [] and clock.now == pytest.approx(10.5)
    assert dev.totals.cut_passes == 1 and dev.totals.cut_time == pytest.approx(0.5)
    assert dev.exec_time == {}  # the thrown-away compute is no job's execution
    # Not marked preemptible, or no online arrival within it: it runs whole.
    for plan, after in ((Plan(step=2, chunks=[decode("a")]), 10.6),
                        (Plan(step=3, chunks=[decode("a")], preemptible_at_layers=True), 99.0)):
        dev.next_online_after = lambda t, after=after: (after, 1) if t < after else None
        res = dev.execute(plan)
        assert not res.interrupted and res.outputs
    assert clock.now == pytest.approx(12.5)


def test_conserve_in_the_simulator_cuts_offline_passes_for_online_arrivals():
    from bench.costmodel import AnalyticCostModel
    from bench.workload import RequestSpec

    reqs = [RequestSpec(request_id=f"off{i}", job_class="offline", arrival_time=0.0,
                        prompt_tokens=1500, output_tokens=50) for i in range(8)]
    reqs += [RequestSpec(request_id=f"on{i}", arrival_time=0.5 + i, prompt_tokens=20,
                         output_tokens=5) for i in range(3)]
    cfg = simulator.SchedulerConfig(policy="conserve", num_blocks=2000, block_size=16,
                                    max_batch_size=16, max_batch_tokens=8192,
                                    max_model_len=2048)
    out = simulator.simulate(reqs, cfg, AnalyticCostModel.preset("llama-2-7b", "a100-80gb"))
    assert out.stats.cut_passes >= 1
    recs = {r.request_id: r for r in out.records}
    assert all(recs[r.request_id].end_time is not None for r in reqs)
    # An online request waits for a layer of the offline pass under way
    # (8,192 tokens: ~0.6 s, ~18 ms a layer), then one co-serving iteration
    # (within the 93 ms TTFT objective), not for the whole pass.
    assert max(recs[f"on{i}"].token_times[0] - (0.5 + i) for i in range(3)) < 0.15


def test_checkpoints_never_stall_and_a_prefetch_is_a_swap_in():
    clock = VirtualClock()
    dev = SimulatedExecutor(UnitCost(), clock, overlap_swap=False, next_arrival=lambda: None)
    ckpt = [BlockOp(BlockOpKind.CHECKPOINT, "a", 0, list(range(6)))]
    res = dev.execute(Plan(step=1, chunks=[decode("a")], block_ops=ckpt))
    # Even with copies on the critical path, a checkpoint's 3 s copy runs
    # on its own lane beside the 1 s forward pass.
    assert res.iteration_time == 1.0 and dev.totals.exposed_swap_time == 0.0
    assert dev.totals.checkpoint_blocks == 6 and dev.totals.checkpoint_lane_busy == 3.0
    # Its lane is still busy: the next checkpoint queues behind.
    dev.execute(Plan(step=2, chunks=[decode("a")],
                     block_ops=[BlockOp(BlockOpKind.CHECKPOINT, "a", 6, [6, 7])]))
    assert dev.totals.checkpoint_lane_busy == 4.0
    prefetch = [BlockOp(BlockOpKind.PREFETCH, "b", 0, [0, 1])]
    res = dev.execute(Plan(step=3, chunks=[decode("a")], block_ops=prefetch))
    assert res.iteration_time == 2.0 and res.swaps_in_done == ["b"]


def test_conserve_checkpoints_under_memory_pressure_in_the_simulator():
    """Offline work fills a small KV cache; online bursts evict it.  With
    a host tier the victims are checkpointed and discarded, and give up
    far fewer computed tokens than recomputation does."""
    from bench.costmodel import AnalyticCostModel
    from bench.workload import RequestSpec

    reqs = [RequestSpec(request_id=f"off{i}", job_class="offline", arrival_time=0.0,
                        prompt_tokens=600, output_tokens=300) for i in range(12)]
    reqs += [RequestSpec(request_id=f"on{i}", arrival_time=2.0 + 0.5 * i, prompt_tokens=900,
                         output_tokens=20) for i in range(6)]
    cost = AnalyticCostModel.preset("llama-2-7b", "a100-80gb")
    got = {}
    for name, host, ckpt in (("recompute", 0, False), ("checkpoint", 4096, True)):
        cfg = simulator.SchedulerConfig(
            policy="conserve", num_blocks=400, block_size=16, max_batch_size=32,
            max_batch_tokens=2048, max_model_len=2048, host_kv_blocks=host,
            conserve={"checkpoint": ckpt})
        out = simulator.simulate(reqs, cfg, cost, simulator.SimOptions(overlap_swap=True))
        assert all(r.end_time is not None for r in out.records), name
        got[name] = out.stats
    assert got["recompute"].checkpoint_blocks == 0 and got["recompute"].num_preemptions > 0
    ck = got["checkpoint"]
    assert ck.checkpoint_blocks > 0 and ck.checkpoint_discards > 0
    assert ck.swap_out_blocks == 0
    assert ck.tokens_discarded < 16 * ck.checkpoint_discards


def test_the_policy_decides_which_arrival_cuts_the_pass():
    """Arrivals at 10.1 s and 10.3 s of a 1 s pass; the policy lets the
    first one wait for the pass and cuts for the second (both prompts)."""
    clock = VirtualClock(10.0)
    arrivals = [(10.1, 5), (10.3, 7)]
    asked: list[tuple[float, int]] = []

    def decide(plan: Plan, elapsed: float, tokens: int) -> bool:
        asked.append((round(elapsed, 6), tokens))
        return tokens > 5

    dev = SimulatedExecutor(FourLayers(), clock, overlap_swap=False, next_arrival=lambda: None,
                            next_online_after=lambda t: next((a for a in arrivals if a[0] > t),
                                                             None),
                            cut_wanted=decide)
    res = dev.execute(Plan(step=1, chunks=[decode("a")], preemptible_at_layers=True))
    assert asked == [(0.1, 5), (0.3, 12)]
    assert res.interrupted and clock.now == pytest.approx(10.5)
