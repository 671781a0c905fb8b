from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import BlockOp, BlockOpKind, JobOutput, Plan, StepResult


def per_block(ops: Iterable[BlockOp]) -> Iterator[tuple[BlockOp, int, int]]:
    """Each op's blocks as (op, logical block, device block); an op that
    moves none (DROP) once, as (op, -1, -1)."""
    for op in ops:
        if not op.device_blocks:
            yield op, -1, -1
        for index, block in zip(op.block_indices, op.device_blocks):
            yield op, index, block


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# Every core made during a test, so that the fake engine can read the true
# tokens of the jobs it runs (`_track_cores`).
_CORES: list[SchedulerCore] = []


@pytest.fixture(autouse=True)
def _track_cores(monkeypatch: pytest.MonkeyPatch):
    init = SchedulerCore.__init__

    def tracked(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        _CORES.append(self)

    monkeypatch.setattr(SchedulerCore, "__init__", tracked)
    yield
    _CORES.clear()


def _prefix_labels(tokens: list[int]) -> list[int]:
    """One label per position: the hash of every token up to it, which is
    what a position's KV depends on."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FakeEngine:
    """Samples token `1000 + output_index` for every sampling chunk.

    Keeps a fake KV store: each position of a device block holds a label of
    the tokens up to it (its "KV"), and every chunk checks that each
    position it reads holds the label of its own job's tokens there, so a
    test can tell that swapped blocks came back intact and that blocks
    shared by siblings or found in the prefix cache hold the same tokens.
    The jobs' true tokens come from the cores made during the test.
    Checkpoints copy a block's labels to the host and leave it on the device.
    Swap-ins and prefetches land `swap_delay` steps after they were issued.
    """

    block_size = 4

    def __init__(self, clock: FakeClock, step_time: float = 0.01, swap_delay: int = 0) -> None:
        self.clock = clock
        self.step_time = step_time
        self.swap_delay = swap_delay
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[tuple[str, int], list[int | None]] = {}
        self.in_flight: list[tuple[int, str]] = []
        self.swapped_in_blocks = 0
        self.swapped_out_blocks = 0
        self.checkpointed_blocks = 0
        self._step = 0

    def share_prompt(self, sibling: str, leader: str, prompt_len: int) -> None:
        """Kept for tests that name their siblings: labels are by content."""

    def _tokens(self, job_id: str, chunk_start: int, chunk_ids: list[int]) -> list[int] | None:
        """The job's tokens up to the chunk's end; None for a job no core of
        this test knows.  A chunk whose ids are not its job's tokens (what a
        recompute feeding the wrong tokens would send) fails here."""
        known = False
        for core in reversed(_CORES):
            job = core.jobs.get(job_id)
            if job is not None:
                known = True
                tokens = job.token_slice(0, chunk_start + len(chunk_ids))
                if tokens[chunk_start:] == chunk_ids:
                    return tokens
        assert not known, f"{job_id}: a chunk at {chunk_start} that is not the job's tokens"
        return None

    def execute(self, plan: Plan) -> StepResult:
        self._step += 1
        landed_now: list[str] = []
        fetching: set[str] = set()
        moved: set[str] = set()
        for op, index, block in per_block(plan.block_ops):
            if op.kind in (BlockOpKind.SWAP_OUT, BlockOpKind.CHECKPOINT):
                self.host[(op.job_id, index)] = list(self.device[block])
                if op.kind is BlockOpKind.SWAP_OUT:
                    self.swapped_out_blocks += 1
                else:
                    self.checkpointed_blocks += 1
            elif op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH):
                key = (op.job_id, index)
                # A prefetch restores a checkpoint and keeps it.
                self.device[block] = list(self.host.pop(key) if op.kind is
                                          BlockOpKind.SWAP_IN else self.host[key])
                self.swapped_in_blocks += 1
                # A fetch may start past block 0: the leading blocks still
                # on the device are not copied (`SwapManager.swap_in`).
                if op.job_id not in fetching:
                    fetching.add(op.job_id)
                    self.in_flight.append((self._step + self.swap_delay, op.job_id))
                if op.kind is BlockOpKind.SWAP_IN:
                    moved.add(op.job_id)
            elif op.kind is BlockOpKind.DROP:
                for k in [k for k in self.host if k[0] == op.job_id]:
                    del self.host[k]
        # A swap-in is a move: the whole host copy goes, blocks not fetched too.
        for k in [k for k in self.host if k[0] in moved]:
            del self.host[k]
        bs = self.block_size
        for c in plan.chunks:
            end = c.start_pos + c.num_tokens
            tokens = self._tokens(c.job_id, c.start_pos, c.token_ids)
            labels = _prefix_labels(tokens) if tokens is not None else None
            for pos in range(c.start_pos, end):
                block = self.device.setdefault(c.block_table[pos // bs], [None] * bs)
                block[pos % bs] = labels[pos] if labels is not None else None
            if labels is None:
                continue  # a job no core of this test knows: nothing to check
            for pos in range(end):
                block = self.device.get(c.block_table[pos // bs])
                label = block[pos % bs] if block is not None else None
                assert label == labels[pos], (
                    f"{c.job_id} position {pos} (block {pos // bs}) holds other KV")
        done = [j for t, j in self.in_flight if t <= self._step]
        self.in_flight = [(t, j) for t, j in self.in_flight if t > self._step]
        landed_now += done
        self.clock.advance(self.step_time)
        outs = [
            JobOutput(c.job_id, 1000 + c.output_index if c.sample else None)
            for c in plan.chunks
        ]
        return StepResult(plan.step, outs, self.step_time, swaps_in_done=landed_now)


_ids = itertools.count()


def make_job(prompt_len: int, max_tokens: int, t: float = 0.0, job_id: str | None = None,
             priority: int = 0, prompt: list[int] | None = None) -> Job:
    """A job whose prompt shares no block with any other's unless `prompt`
    says otherwise (its first token is its own)."""
    n = next(_ids)
    return Job(
        job_id=job_id or f"j{n}",
        prompt_token_ids=(prompt if prompt is not None
                          else [100_000 + n] + list(range(2, prompt_len + 1))),
        max_tokens=max_tokens,
        arrival_time=t,
        priority=priority,
    )


def make_core(clock: FakeClock, **kw) -> SchedulerCore:
    cfg = dict(policy="fcfs", block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=64, max_model_len=64)
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg), clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def add_siblings(core: SchedulerCore, engine: FakeEngine, leader: Job, n: int,
                 max_tokens: int | None = None, priority: int = 0) -> list[Job]:
    """Add `n` more completions of `leader`'s request, sharing its prompt."""
    out = []
    for i in range(n):
        s = Job(f"{leader.job_id}.{i + 1}", list(leader.prompt_token_ids),
                max_tokens if max_tokens is not None else leader.max_tokens,
                leader.arrival_time, priority=priority)
        engine.share_prompt(s.job_id, leader.job_id, leader.num_prompt_tokens)
        core.add(s, share_prompt_with=leader.job_id)
        out.append(s)
    return out


def step(core: SchedulerCore, engine: FakeEngine) -> Plan:
    plan = core.schedule()
    core.complete(plan, engine.execute(plan))
    core.blocks.check(core.jobs.values())
    return plan


def drain(core: SchedulerCore, engine: FakeEngine, max_steps: int = 10_000) -> list[Plan]:
    plans = []
    while core.has_work:
        plans.append(step(core, engine))
        assert len(plans) < max_steps, "scheduler did not drain"
    return plans
