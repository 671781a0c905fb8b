"""The profiler: measures our engine's iteration cost and writes a cost table.

It drives `engine.runner.ModelRunner` with plans from the real
`SchedulerCore` (FCFS), so every measured iteration is one the server
could run, and records each iteration's batch shape (bench/costmodel.py
`BatchShape`: prefill tokens, prefill attention pairs, decode batch size,
decode context) with its time:

- prefill: one job of P prompt tokens prefilled in one chunk, for each P;
- decode: B jobs of context C (prefilled for real; those prefill and mixed
  iterations are measurements too), then `repeats` decode iterations at
  each batch size, shrinking the batch by aborting jobs;
- swap: time per KV block of a SWAP_OUT + SWAP_IN round trip, through a
  host-memory tier when the runner has none; a runner without block ops
  (a fake one) raises NotImplementedError and the table has no swap entries.

The measured time of an iteration is the wall time of one
`scheduler.iteration.IterationDriver` step, schedule + execute + complete,
the very step the server's loop runs without `async_scheduling` (less
token delivery); the engine's own forward time is kept beside it.  The
fitted table (`CostTable.fitted`) is what `TableCostModel` and the
simulator use.

The engine is imported lazily, only to build the real runner (no
`runner_factory`) and its sampling parameters: the tests drive this module
with a fake runner, without torch.
"""

from __future__ import annotations

import datetime as _dt
import random
import statistics
import time
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from bench.costmodel import BatchShape
from bench.costtable import CostTable, Measurement, SwapMeasurement
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver, OnWallClock
from scheduler.job import Job
from scheduler.plan import BlockOp, BlockOpKind, Plan


class ProfileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "embedded:smollm2"
    # "auto" resolves as the server does (engine/dtypes.py resolve_dtype).
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = 1
    block_size: int = 16
    max_model_len: int = 2048
    prefill_lens: list[int] = Field(default_factory=lambda: [16, 64, 128, 256, 512])
    decode_batches: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32])
    contexts: list[int] = Field(default_factory=lambda: [64, 256, 768])
    swap_blocks: list[int] = Field(default_factory=lambda: [1, 8, 32])
    # Token budget while filling contexts (also yields mixed iterations).
    fill_batch_tokens: int = 512
    repeats: int = 3
    seed: int = 0


def _sampling_params(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class _Driver:
    """SchedulerCore + ModelRunner on the wall clock, recording iterations."""

    def __init__(self, runner: Any, cfg: ProfileConfig, num_blocks: int, budget: int,
                 max_batch: int) -> None:
        self.runner = runner
        self.cfg = cfg
        sc = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_batch_size=max_batch,
            max_batch_tokens=budget,
            max_model_len=cfg.max_model_len,
        )
        self.core = SchedulerCore(sc, time.perf_counter)
        self.driver = IterationDriver(self.core, OnWallClock(runner))
        self.rng = random.Random(cfg.seed)
        self.vocab = int(getattr(runner, "vocab_size", 32000))
        self._n = 0

    def add(self, prompt_len: int, max_tokens: int) -> str:
        self._n += 1
        jid = f"p{self._n}"
        ids = [self.rng.randrange(100, self.vocab) for _ in range(prompt_len)]
        self.runner.add_request(jid, _sampling_params(max_tokens), ids)
        self.core.add(Job(job_id=jid, prompt_token_ids=ids, max_tokens=max_tokens,
                          arrival_time=time.perf_counter()))
        return jid

    def abort(self, jid: str) -> None:
        self.core.abort(jid)
        self.runner.remove_request(jid)

    def step(self) -> tuple[Plan, float, float]:
        """(plan, wall seconds of the step, engine seconds)."""
        t0 = time.perf_counter()
        it = self.driver.step()
        return it.plan, time.perf_counter() - t0, it.result.iteration_time


def _measurement(plan: Plan, wall: float, engine: float) -> Measurement:
    return Measurement.of(BatchShape.of(plan), wall, engine)


def profile(
    cfg: ProfileConfig,
    log: Callable[[str], None] = print,
    runner_factory: Callable[..., Any] | None = None,
) -> CostTable:
    if runner_factory is None:
        from engine.dtypes import resolve_dtype
        from engine.runner import ModelRunner

        runner_factory = ModelRunner
        cfg = cfg.model_copy(update={"dtype": resolve_dtype(cfg.dtype, cfg.device)})
    max_ctx = max(cfg.contexts + cfg.prefill_lens)
    bmax = max(cfg.decode_batches)
    per_job = -(-(max_ctx + 4 * cfg.repeats + 8) // cfg.block_size)
    num_blocks = max(bmax * per_job, -(-cfg.max_model_len // cfg.block_size)) + 64
    budget = max(max(cfg.prefill_lens), cfg.fill_batch_tokens)
    runner = runner_factory(
        cfg.model, dtype=cfg.dtype, device=cfg.device, num_blocks=num_blocks,
        block_size=cfg.block_size, max_model_len=cfg.max_model_len,
        num_threads=cfg.num_threads,
    )
    ms: list[Measurement] = []

    # Warm-up (allocator, lazy init), not recorded.
    d = _Driver(runner, cfg, num_blocks, budget, bmax)
    d.add(32, 2)
    while d.core.has_work:
        d.step()

    # Prefill: one chunk of P tokens.
    for p in cfg.prefill_lens:
        times = []
        for _ in range(cfg.repeats):
            jid = d.add(p, 1)
            plan, wall, eng = d.step()
            ms.append(_measurement(plan, wall, eng))
            times.append(wall)
            if jid in d.core.jobs:
                d.abort(jid)
        log(f"prefill {p:5d} tokens: {1e3 * statistics.median(times):8.1f} ms")

    # Decode at each (context, batch size); filling contexts is measured too.
    for c in cfg.contexts:
        fill = _Driver(runner, cfg, num_blocks, cfg.fill_batch_tokens, bmax)
        jids = [fill.add(c, 10_000) for _ in range(bmax)]
        while any(fill.core.jobs[j].num_computed_tokens < c for j in jids):
            plan, wall, eng = fill.step()
            ms.append(_measurement(plan, wall, eng))
        for b in sorted(cfg.decode_batches, reverse=True):
            while len(jids) > b:
                fill.abort(jids.pop())
            times = []
            for _ in range(cfg.repeats):
                plan, wall, eng = fill.step()
                ms.append(_measurement(plan, wall, eng))
                times.append(wall)
            log(f"decode batch {b:3d} context {c:5d}: {1e3 * statistics.median(times):8.1f} ms")
        for j in jids:
            fill.abort(j)

    swaps = _profile_swaps(runner, cfg, log)
    table = CostTable(
        model=cfg.model,
        device=cfg.device,
        dtype=cfg.dtype,
        num_threads=cfg.num_threads,
        block_size=cfg.block_size,
        measurements=ms,
        swaps=swaps,
        block_bytes=getattr(runner, "kv_block_bytes", None),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    ).fitted()
    log(f"fit: {table.coef}  mean |rel err| = {table.fit_error:.3f}")
    return table


def _profile_swaps(runner: Any, cfg: ProfileConfig, log: Callable[[str], None]) -> list[SwapMeasurement]:
    """Round trip of n blocks: SWAP_OUT, then SWAP_IN until it has landed
    and been written back; half of it is the time per direction.

    Without a tier set by the caller, a host-memory tier is used: on a CPU
    engine that is what a copy costs; the object-store tier of the server
    adds its own overhead off the critical path (its copies run on a side
    thread)."""
    if getattr(runner, "swapper", "absent") is None and hasattr(runner, "set_kv_tier"):
        from kvstore.tier import LocalHostTier

        runner.set_kv_tier(LocalHostTier(1 << 36))
    out: list[SwapMeasurement] = []
    for n in cfg.swap_blocks:
        ops_out = [BlockOp(BlockOpKind.SWAP_OUT, "swap-probe", 0, list(range(n)))]
        ops_in = [BlockOp(BlockOpKind.SWAP_IN, "swap-probe", 0, list(range(n)))]
        times = []
        try:
            for _ in range(cfg.repeats):
                t0 = time.perf_counter()
                runner.execute(Plan(step=0, block_ops=ops_out))
                res = runner.execute(Plan(step=0, block_ops=ops_in))
                deadline = t0 + 30.0
                while "swap-probe" not in res.swaps_in_done and time.perf_counter() < deadline:
                    res = runner.execute(Plan(step=0))
                if "swap-probe" not in res.swaps_in_done:
                    raise RuntimeError(f"swap-in of {n} blocks did not land in 30 s")
                times.append((time.perf_counter() - t0) / 2)
        except NotImplementedError as e:
            log(f"swap: not measured ({e})")
            return []
        dt = statistics.median(times)
        out.append(SwapMeasurement(blocks=n, time=dt))
        log(f"swap {n:4d} blocks: {1e3 * dt:8.2f} ms")
    return out


def table_from_iterations(
    rows: Sequence[tuple[Sequence[Sequence[int]], float, float]],
    *, model: str, device: str, dtype: str, num_threads: int | None, block_size: int,
    swaps: Sequence[SwapMeasurement] = (),
) -> CostTable:
    """A cost table from iterations a running server recorded
    (`Engine.iteration_log`: chunk spans, forward time, planning-to-
    completion time), so that it includes what the deployed engine pays
    beside the forward pass: the replica's other threads, token delivery
    and the other processes on the machine."""
    ms = [Measurement.of(BatchShape.of_spans((int(a), int(n)) for a, n in spans), wall, fwd)
          for spans, fwd, wall in rows]
    return CostTable(
        model=model, device=device, dtype=dtype, num_threads=num_threads, block_size=block_size,
        measurements=ms, swaps=list(swaps),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    ).fitted()


def quick_config(**kw: Any) -> ProfileConfig:
    """A small grid (tens of seconds on the CPU machines)."""
    base: dict[str, Sequence[int] | int] = dict(
        prefill_lens=[16, 64, 256], decode_batches=[1, 8, 32], contexts=[64, 256], repeats=2
    )
    base.update(kw)
    return ProfileConfig(**base)  # type: ignore[arg-type]
