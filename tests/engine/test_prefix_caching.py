"""Prefix caching through the real runner: requests that begin with a
system prompt, or re-send a conversation's earlier turn, adopt the KV of
the jobs before them (live or ended) and produce the tokens they produce
when every prompt is computed in full, under FCFS and under MLFQ with
preemption and swapping (float32: the two runs batch differently)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver, OnWallClock
from scheduler.job import Job

BLOCK = 4
Prompt = Callable[[dict[str, list[int]]], list[int]]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(14, 1)  # three full blocks and two tokens


def _chat(user_seed: int) -> Prompt:
    return lambda out: SYSTEM + _tokens(5 + user_seed % 7, user_seed)


def _next_turn(earlier: str, prompts: dict[str, list[int]], user_seed: int) -> Prompt:
    """The conversation so far (its earlier prompt and answer) and a new message."""
    return lambda out: prompts[earlier] + out[earlier] + _tokens(6, user_seed)


def serve(runner: ModelRunner, arrivals: list[tuple[int | None, str, Prompt, int]], *,
          prefix_caching: bool, policy: str = "fcfs", swap_mode: str = "recompute",
          host_kv_blocks: int = 0, num_blocks: int = 32,
          ) -> tuple[dict[str, list[int]], dict[str, int], SchedulerCore]:
    """Greedy outputs of `arrivals`: (step it arrives at, None once everyone
    before it finished; job id; its prompt from earlier outputs; max tokens).
    Also the prompt tokens each job found cached, when it arrived or when
    it first started."""
    clock = iter(range(10**6))
    core = SchedulerCore(SchedulerConfig(
        policy=policy, block_size=BLOCK, num_blocks=num_blocks, max_batch_size=4,
        max_batch_tokens=16, max_model_len=runner.max_model_len, swap_mode=swap_mode,
        host_kv_blocks=host_kv_blocks, prefix_caching=prefix_caching,
        mlfq={"base_quantum_s": 2.0}), clock=lambda: float(next(clock)))
    if host_kv_blocks:
        runner.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
    driver = IterationDriver(core, OnWallClock(runner))
    out: dict[str, list[int]] = {}
    jobs: dict[str, Job] = {}
    prompts: dict[str, list[int]] = {}
    pending = list(arrivals)
    step = 0
    while pending or core.has_work:
        while pending and (pending[0][0] is None and not core.has_work
                           or pending[0][0] is not None and pending[0][0] <= step):
            _, job_id, make, max_tokens = pending.pop(0)
            prompts[job_id] = make(out)
            job = Job(job_id, prompts[job_id], max_tokens, arrival_time=0.0)
            core.add(job)
            jobs[job_id] = job
            runner.add_request(job_id, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True), prompts[job_id])
            out[job_id] = []
        for it in driver.steps():
            for ev in it.events:
                assert ev.token_id is not None
                out[ev.job_id].append(ev.token_id)
        core.blocks.check(core.jobs.values())
        step += 1
        assert step < 2_000, "did not finish"
    assert core.blocks.num_free == num_blocks and runner.num_requests == 0
    return out, {j: job.num_cached_tokens for j, job in jobs.items()}, core


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=BLOCK,
                       max_model_len=96, num_threads=1, attention_backend="torch")


def _arrivals() -> list[tuple[int | None, str, Prompt, int]]:
    prompts: dict[str, list[int]] = {}

    def remember(job_id: str, make: Prompt) -> Prompt:
        def made(out: dict[str, list[int]]) -> list[int]:
            prompts[job_id] = make(out)
            return prompts[job_id]
        return made

    return [
        (0, "a", remember("a", _chat(11)), 9),
        (0, "b", remember("b", _chat(12)), 14),
        (3, "c", remember("c", _chat(13)), 7),  # a and b have the system prompt
        (None, "a2", remember("a2", _next_turn("a", prompts, 21)), 8),
        (None, "d", remember("d", _chat(14)), 5),
        (0, "b2", remember("b2", _next_turn("b", prompts, 22)), 10),
    ]


@pytest.mark.parametrize("policy,swap_mode,host,blocks", [
    ("fcfs", "recompute", 0, 32), ("mlfq", "recompute", 0, 24), ("mlfq", "proactive", 64, 24),
    ("econoserve", "recompute", 0, 32)])
def test_cached_prefixes_give_the_same_tokens(runner: ModelRunner, policy: str,
                                              swap_mode: str, host: int, blocks: int) -> None:
    kw = dict(policy=policy, swap_mode=swap_mode, host_kv_blocks=host, num_blocks=blocks)
    base, base_cached, _ = serve(runner, _arrivals(), prefix_caching=False, **kw)
    got, cached, core = serve(runner, _arrivals(), prefix_caching=True, **kw)
    assert got == base
    assert all(n == 0 for n in base_cached.values())
    sys_blocks = len(SYSTEM) // BLOCK * BLOCK
    # Arrived while a and b ran, after they computed the system prompt.
    assert cached["c"] >= sys_blocks
    # Arrived with a, before anyone had computed it: found it when it
    # started, after a's first chunk (16-token iterations).  EconoServe
    # starts the longer prompt first: b, and a found it.
    first, second = ("b", "a") if policy == "econoserve" else ("a", "b")
    assert (cached[first], cached[second]) == (0, sys_blocks)
    # Its whole earlier turn, prompt and answer, up to the last full block
    # that turn computed (its last token was sampled, never fed back).
    turn = len(_chat(11)(base)) + len(base["a"]) - 1
    assert cached["a2"] == turn // BLOCK * BLOCK
    stats = core.stats()
    # A job preempted for recomputation that adopts its own blocks back
    # counts as a hit, not as its client's cached tokens.
    assert stats.num_prefix_hit_tokens >= sum(cached.values())
    if not core.num_preemptions:
        assert stats.num_prefix_hit_tokens == sum(cached.values())
    assert stats.num_prefix_queried_tokens > stats.num_prefix_hit_tokens > 0


HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_cached_prefixes_give_the_same_tokens_in_bfloat16_when_deterministic(
        tiny_llama_path: Path) -> None:
    """In bfloat16 a block's KV depends on how its prompt was cut and
    batched unless execution is batch-invariant; with `deterministic`, a
    prompt adopted from the cache is the prompt computed in full."""
    runner = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=64, block_size=BLOCK,
                         max_model_len=96, num_threads=1, deterministic=True)
    kw = dict(policy="mlfq", num_blocks=24)
    base, _, _ = serve(runner, _arrivals(), prefix_caching=False, **kw)
    got, cached, _ = serve(runner, _arrivals(), prefix_caching=True, **kw)
    assert sum(cached.values()) > 0
    assert got == base
