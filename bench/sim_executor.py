"""The simulated device: a cost model and two PCIe copy lanes on a virtual clock.

`SimulatedExecutor` is the simulator's `scheduler.iteration.Executor`: the
server's iteration driver hands it the plans a model runner would get, and
it answers with what the iteration would have cost, advancing the virtual
clock by that much.  An iteration lasts cost(plan's batch shape)
(bench/costmodel.py) plus the exposed time of its block copies (PCIe 4.0
x16, `cost.swap_time`), modelled two ways:

* default (reactive swapping, FastServe Fig. 9a): every copy of the plan,
  out and in, runs on the critical path before the forward pass: the
  iteration lasts compute + copy time, and the plan's swap-ins have landed
  when it ends;
* `overlap_swap` (proactive swapping, FastServe §4.2 / Fig. 9b): the copies
  run on side streams, one per PCIe direction.  Swap-outs (device -> host)
  overlap the forward pass, but the iteration cannot end before they are
  done (their blocks were freed for reuse), so only the part longer than
  the compute is exposed.  Swap-ins (host -> device) queue on their own lane
  and land after their copy time, possibly iterations later, without
  stalling the batch.

Checkpoint copies (ConServe §4.4) always run on a side lane of their own:
the blocks stay in use, so nothing waits for them; `checkpoint_lane_busy`
says how much of the run that lane was busy.  A PREFETCH is a swap-in.

Either way a landed swap-in is reported through `StepResult.swaps_in_done`
at the first iteration boundary after it lands; when nothing is runnable
meanwhile, `wait_for_swaps` jumps the clock to the next landing (or arrival).

A plan marked `preemptible_at_layers` (co-serving's offline batching mode)
is cut at the first layer boundary after an online arrival that the
policy's `cut_wanted` (Algorithm 2) says should cut it, as the server's
model cuts it (ConServe §4.3): the iteration lasts until that boundary and
computes nothing.  Layer times are the pass's time split evenly over the
cost model's layers; a cost model that does not know its layers (a measured
table) runs such passes whole.

It also splits each job's time (FastServe Figures 1 and 15b): execution is
the compute time of the iterations it was part of; swapping is the exposed
copy time of those iterations plus the time from the issue of its own
swap-in to the boundary that reports it landed ("blocked by the swapping
mechanism", an upper bound since the job might not have been scheduled
earlier anyway).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

from bench.costmodel import BatchShape, CostModel
from scheduler.plan import BlockOpKind, JobOutput, Plan, StepResult

SAMPLED_TOKEN_ID = 1
# The copy size the modelled copy rate is taken at (the default checkpoint
# budget per iteration, `conserve.checkpoint_max_blocks`).
_RATE_BLOCKS = 32


class VirtualClock:
    """The injected clock: a callable returning simulated seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class DeviceTotals:
    """Sums over the executed iterations, for `SimStats`."""

    busy_time: float = 0.0  # Σ iteration times
    # Copy time that lengthened iterations (on the critical path).
    exposed_swap_time: float = 0.0
    # Busy time of the host -> device lane (overlap mode).
    swap_in_lane_busy: float = 0.0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    checkpoint_blocks: int = 0
    checkpoint_lane_busy: float = 0.0
    # Passes cut between layers, and the compute they threw away.
    cut_passes: int = 0
    cut_time: float = 0.0


class SimulatedExecutor:
    def __init__(self, cost: CostModel, clock: VirtualClock, overlap_swap: bool,
                 next_arrival: Callable[[], float | None],
                 next_online_after: Callable[[float], tuple[float, int] | None] | None = None,
                 cut_wanted: Callable[[Plan, float, int], bool] | None = None) -> None:
        self.cost = cost
        self.clock = clock
        self.overlap_swap = overlap_swap
        # Output length at which a job samples its end-of-sequence token,
        # for jobs whose `max_tokens` is only a cap (the scheduler does not
        # know when they end, as a server does not).
        self.stop_lengths: dict[str, int] = {}
        # The engine's length-head estimate of a job's answer, reported with
        # the job's first sampled token as the live engine's step result
        # carries it (engine/length_head.py; SimOptions.predictions_at_first_token).
        self.head_estimates: dict[str, int] = {}
        # When the next request arrives (None: no more): waiting for a
        # swap-in ends there too, so that the request is admitted on time.
        self.next_arrival = next_arrival
        # The first online arrival after a time: it cuts a pass the plan
        # marks `preemptible_at_layers` at the next layer boundary (ConServe
        # §4.3), if the cost model knows its layers.
        self.next_online_after = next_online_after
        # The policy's decision (ConServe Algorithm 2): whether online
        # prompts of n tokens, arrived t s into the pass, cut it.  None:
        # the first online arrival does.
        self.cut_wanted = cut_wanted
        model = getattr(cost, "model", None)
        self.num_layers: int | None = getattr(model, "num_layers", None)
        self.totals = DeviceTotals()
        # Per job: compute seconds, swap seconds, blocks copied.
        self.exec_time: dict[str, float] = {}
        self.swap_time: dict[str, float] = {}
        self.swap_blocks: dict[str, int] = {}
        # Swap-ins in flight: (landing time, seq, job id).
        self._in_flight: list[tuple[float, int, str]] = []
        self._issued_at: dict[str, float] = {}
        self._in_lane_free = 0.0  # host -> device copy lane
        self._ckpt_lane_free = 0.0  # device -> host, checkpoints
        # What the engine would measure: the lane's rate on a copy of
        # `_RATE_BLOCKS` blocks (its fixed latency included).
        self.copy_rate = _RATE_BLOCKS / cost.swap_time(_RATE_BLOCKS)
        self._seq = 0

    @property
    def swaps_in_flight(self) -> int:
        return len(self._in_flight)

    def execute(self, plan: Plan) -> StepResult:
        if plan.is_empty:
            # Nothing to run: no time passes (see wait_for_swaps).
            return StepResult(plan.step, [], 0.0)
        cost, t = self.cost, self.totals
        compute = cost.iteration_time(BatchShape.of(plan))
        ins: dict[str, int] = {}  # job -> blocks, in op order
        n_out = n_ckpt = 0
        for op in plan.block_ops:
            if op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH):
                ins[op.job_id] = ins.get(op.job_id, 0) + op.num_blocks
            elif op.kind is BlockOpKind.SWAP_OUT:
                n_out += op.num_blocks
            elif op.kind is BlockOpKind.CHECKPOINT:
                n_ckpt += op.num_blocks
        n_in = sum(ins.values())
        start = self.clock.now
        if n_ckpt:
            lane_start = max(self._ckpt_lane_free, start)
            self._ckpt_lane_free = lane_start + cost.swap_time(n_ckpt)
            t.checkpoint_lane_busy += self._ckpt_lane_free - lane_start
            t.checkpoint_blocks += n_ckpt
        if self.overlap_swap:
            out_t = cost.swap_time(n_out) if n_out else 0.0
            exposed_swap = max(0.0, out_t - compute)
            dt = compute + exposed_swap
            for jid, nb in ins.items():
                lane_start = max(self._in_lane_free, start)
                self._in_lane_free = lane_start + cost.swap_time(nb)
                t.swap_in_lane_busy += self._in_lane_free - lane_start
                self._issue(jid, self._in_lane_free, start)
        else:
            swap = cost.swap_time(n_in + n_out) if (n_in + n_out) else 0.0
            exposed_swap = swap
            dt = compute + swap
            for jid in ins:
                self._issue(jid, start + dt, start)
        cut = self._cut(plan, start + (0.0 if self.overlap_swap else exposed_swap), compute)
        if cut is not None:
            # Cut at a layer boundary: the compute so far is thrown away,
            # but the plan's copies went ahead (their lanes are as above).
            spent = cut - start
            dt = max(spent, dt - compute) if self.overlap_swap else spent
            t.cut_passes += 1
            t.cut_time += spent
        self.clock.now += dt
        t.busy_time += dt
        t.exposed_swap_time += exposed_swap
        if n_in or n_out or n_ckpt:
            t.swap_in_blocks += n_in
            t.swap_out_blocks += n_out
            for op in plan.block_ops:
                if op.kind is not BlockOpKind.DROP:
                    self.swap_blocks[op.job_id] = (self.swap_blocks.get(op.job_id, 0)
                                                   + op.num_blocks)
        if cut is not None:
            result = StepResult(plan.step, [], dt, interrupted=True)
            done = self._landed()
            if done:
                result.swaps_in_done = done
            return result
        for c in plan.chunks:
            self.exec_time[c.job_id] = self.exec_time.get(c.job_id, 0.0) + compute
            if exposed_swap:
                self.swap_time[c.job_id] = self.swap_time.get(c.job_id, 0.0) + exposed_swap
        stops = self.stop_lengths
        outputs = [JobOutput(c.job_id, SAMPLED_TOKEN_ID,
                             "stop" if stops and c.output_index + 1 >= stops.get(c.job_id, 1 << 62)
                             else None)
                   for c in plan.chunks if c.sample]
        if self.head_estimates:
            for out in outputs:
                out.predicted_output_len = self.head_estimates.pop(out.job_id, None)
        result = StepResult(plan.step, outputs, dt, copy_rate=self.copy_rate)
        done = self._landed()
        if done:
            result.swaps_in_done = done
        return result

    def _cut(self, plan: Plan, forward_start: float, compute: float) -> float | None:
        """When the forward pass of `plan` ends cut, or None if it runs whole."""
        if (not plan.preemptible_at_layers or self.next_online_after is None
                or not self.num_layers or compute <= 0):
            return None
        end = forward_start + compute
        after, tokens = self.clock.now, 0
        while True:
            nxt = self.next_online_after(after)
            if nxt is None or nxt[0] >= end:
                return None
            after, n = nxt
            tokens += n
            if self.cut_wanted is None or self.cut_wanted(
                    plan, max(0.0, after - forward_start), tokens):
                break
        layer = compute / self.num_layers
        done = max(1, math.ceil((after - forward_start) / layer - 1e-9))
        if done >= self.num_layers:
            return None  # it arrived during the last layer: the pass completes
        return forward_start + done * layer

    def remove_request(self, job_id: str) -> None:
        """Nothing to forget: a job finishes only once its copies landed."""

    def wait_for_swaps(self, plan: Plan, result: StepResult) -> StepResult:
        if not plan.is_empty:
            # A plan of copies alone took its copy time in `execute`.
            return result
        arrival = self.next_arrival()
        if self._in_flight:
            # Idle until a swap-in lands (or a request arrives).
            nxt = self._in_flight[0][0]
            if arrival is not None:
                nxt = min(nxt, arrival)
            self.clock.now = max(self.clock.now, nxt)
            done = self._landed()
            if done:
                result.swaps_in_done = done
        elif arrival is not None:
            self.clock.now = max(self.clock.now, arrival)
        return result

    def _issue(self, job_id: str, lands_at: float, start: float) -> None:
        self._seq += 1
        heapq.heappush(self._in_flight, (lands_at, self._seq, job_id))
        self._issued_at[job_id] = start

    def _landed(self) -> list[str]:
        """Pop the swap-ins landed by now; each job was blocked on its own
        copy from the issue to this report."""
        now = self.clock.now
        done: list[str] = []
        while self._in_flight and self._in_flight[0][0] <= now + 1e-12:
            _, _, jid = heapq.heappop(self._in_flight)
            done.append(jid)
            t0 = self._issued_at.pop(jid, None)
            if t0 is not None:
                self.swap_time[jid] = self.swap_time.get(jid, 0.0) + (now - t0)
        return done
