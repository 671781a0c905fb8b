"""Planning the next iteration while a pass is in flight (scheduler/ahead.py)
through the real runner: every request gets the tokens, text, finish reason
and logprobs it gets when each plan waits for the previous one's tokens,
with preemption, swapping, early stops, aborts, penalties and logprobs,
op by op and from graph buckets (float32: the two runs batch differently)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.ahead import AheadDriver, OnWallClockAhead
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver, OnWallClock
from scheduler.job import Job
from scheduler.plan import PENDING_TOKEN, Plan, ScheduledChunk
from tests.engine.helpers import random_prompts

BLOCK = 4


@dataclass
class Served:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    num_ahead: int = 0
    num_preemptions: int = 0


def serve(runner: ModelRunner, prompts: dict[str, list[int]],
          params: Callable[[str], SamplingParams], *, ahead: bool, num_blocks: int = 24,
          policy: str = "mlfq", swap_mode: str = "recompute", host_kv_blocks: int = 0,
          abort: dict[int, str] | None = None) -> Served:
    """Run `prompts` to completion; `abort` maps a step number to a job
    aborted before that step (as the replica's inbox does, between steps)."""
    clock = itertools.count()
    core = SchedulerCore(SchedulerConfig(
        policy=policy, block_size=BLOCK, num_blocks=num_blocks, max_batch_size=8,
        max_batch_tokens=32, max_model_len=runner.max_model_len, swap_mode=swap_mode,
        host_kv_blocks=host_kv_blocks, mlfq={"base_quantum_s": 2.0}),
        clock=lambda: float(next(clock)))
    if host_kv_blocks:
        runner.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
    out = Served()
    for job_id, prompt in prompts.items():
        p = params(job_id)
        assert p.max_tokens is not None
        core.add(Job(job_id, prompt, p.max_tokens, arrival_time=0.0))
        runner.add_request(job_id, p, prompt)
        out.tokens[job_id], out.text[job_id], out.logprobs[job_id] = [], "", []
    driver: IterationDriver = (AheadDriver(core, OnWallClockAhead(runner)) if ahead
                               else IterationDriver(core, OnWallClock(runner)))
    for step in range(2_000):
        if abort and step in abort and core.abort(abort[step]):
            runner.remove_request(abort[step])
        if not core.has_work and driver.in_flight is None:
            break
        its = driver.steps() if core.has_work or core.swap.pending_ops else driver.drain()
        for it in its:
            for ev in it.events:
                assert ev.job_id not in out.finish, f"{ev.job_id}: a token after its finish"
                assert ev.token_id is not None and ev.token_id >= 0
                out.tokens[ev.job_id].append(ev.token_id)
                out.text[ev.job_id] += ev.text
                if ev.logprobs is not None:
                    out.logprobs[ev.job_id].append(ev.logprobs.logprob)
                if ev.finished:
                    out.finish[ev.job_id] = ev.finish_reason
    else:
        raise AssertionError("did not finish")
    core.blocks.check()
    assert core.blocks.num_free == num_blocks
    assert runner.num_requests == 0
    out.num_ahead = getattr(driver, "num_ahead", 0)
    out.num_preemptions = core.num_preemptions
    return out


def _greedy(max_tokens: dict[str, int], **extra: object) -> Callable[[str], SamplingParams]:
    return lambda j: SamplingParams(max_tokens=max_tokens[j], temperature=0.0,
                                    ignore_eos=True, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=BLOCK,
                       max_model_len=96, num_threads=1, attention_backend="torch")


PROMPTS = random_prompts([5, 19, 33, 8, 27, 12], seed=7)
LENGTHS = dict(zip(PROMPTS, [30, 9, 22, 40, 16, 3]))


def _same(a: Served, b: Served) -> None:
    assert a.tokens == b.tokens
    assert a.text == b.text
    assert a.finish == b.finish
    assert a.logprobs == b.logprobs


@pytest.mark.parametrize("policy,swap_mode,host", [
    ("fcfs", "recompute", 0), ("mlfq", "recompute", 0), ("mlfq", "proactive", 64)])
def test_greedy_outputs_do_not_change(runner: ModelRunner, policy: str, swap_mode: str,
                                      host: int) -> None:
    params = _greedy(LENGTHS)
    base = serve(runner, PROMPTS, params, ahead=False, policy=policy, swap_mode=swap_mode,
                 host_kv_blocks=host)
    ahead = serve(runner, PROMPTS, params, ahead=True, policy=policy, swap_mode=swap_mode,
                  host_kv_blocks=host)
    _same(ahead, base)
    assert [len(ahead.tokens[j]) for j in PROMPTS] == list(LENGTHS.values())
    assert ahead.num_ahead > 20
    if policy == "mlfq":  # 24 blocks of 4 hold fewer than all six at once
        assert base.num_preemptions > 0 and ahead.num_preemptions > 0


def test_a_stop_seen_late_drops_the_token_already_launched(runner: ModelRunner) -> None:
    # Stop tokens taken from the outputs themselves, so that jobs end early
    # while their next pass is already in flight.
    free = serve(runner, PROMPTS, _greedy(LENGTHS), ahead=False)
    stops = sorted({toks[len(toks) // 2] for toks in free.tokens.values() if len(toks) > 4})
    params = _greedy(LENGTHS, stop_token_ids=stops)
    base = serve(runner, PROMPTS, params, ahead=False)
    ahead = serve(runner, PROMPTS, params, ahead=True)
    _same(ahead, base)
    assert sum(r == "stop" for r in base.finish.values()) >= 3


def test_stop_strings_seeds_penalties_and_logprobs(runner: ModelRunner) -> None:
    free = serve(runner, PROMPTS, _greedy(LENGTHS), ahead=False)
    some = free.text["job3"]
    stop = some[len(some) // 2: len(some) // 2 + 3]
    toks = free.tokens["job4"]
    k = next(i for i in range(4, len(toks)) if toks[i] not in toks[:i])

    special: dict[str, dict[str, object]] = {
        "job0": {"temperature": 0.9, "seed": 3},
        "job1": {"frequency_penalty": 1.5},
        "job2": {"logprobs": 2},
        "job3": {"stop": [stop]},
        # Its first k tokens may not stop it; the k+1-th does, where the
        # bans end (a count one short would ban it once more).
        "job4": {"min_tokens": k, "stop_token_ids": [toks[k]]},
    }

    def params(j: str) -> SamplingParams:
        kw: dict[str, object] = {"temperature": 0.0, "ignore_eos": True, **special.get(j, {})}
        return SamplingParams(max_tokens=LENGTHS[j], **kw)  # type: ignore[arg-type]

    base = serve(runner, PROMPTS, params, ahead=False)
    ahead = serve(runner, PROMPTS, params, ahead=True)
    _same(ahead, base)
    assert base.finish["job3"] == "stop" and len(base.logprobs["job2"]) == LENGTHS["job2"]
    assert base.finish["job4"] == "stop" and len(base.tokens["job4"]) == k + 1
    assert ahead.num_ahead > 0


def test_allowed_tokens_and_bad_words(runner: ModelRunner) -> None:
    """A plan is launched ahead of a token a request's bans depend on (a
    word of two tokens) only where they do not: the tokens are the same."""
    free = serve(runner, PROMPTS, _greedy(LENGTHS), ahead=False)
    a, b = free.tokens["job0"], free.tokens["job3"]
    special: dict[str, dict[str, object]] = {
        "job0": {"bad_words_token_ids": [[a[3], a[4]], [a[9]]]},
        "job2": {"allowed_token_ids": sorted(set(free.tokens["job2"]))[:4]},
        "job3": {"bad_words_token_ids": [[b[2]]]},
    }

    def params(j: str) -> SamplingParams:
        return SamplingParams(max_tokens=LENGTHS[j], temperature=0.0, ignore_eos=True,
                              **special.get(j, {}))  # type: ignore[arg-type]

    base = serve(runner, PROMPTS, params, ahead=False)
    ahead = serve(runner, PROMPTS, params, ahead=True)
    _same(ahead, base)
    assert all(base.tokens[j] != free.tokens[j] for j in special)
    assert ahead.num_ahead > 0


@pytest.mark.parametrize("extra,bound", [
    ({}, False), ({"bad_words_token_ids": [[7]]}, False), ({"min_tokens": 3}, False),
    ({"presence_penalty": 0.5}, True), ({"repetition_penalty": 1.1}, True),
    ({"bad_words_token_ids": [[7], [8, 9]]}, True)])
def test_which_requests_sample_on_their_previous_token(
        runner: ModelRunner, extra: dict[str, object], bound: bool) -> None:
    """Penalties and a word of several tokens bind each token to the one
    before it for the request's life; min_tokens only until it is reached,
    which `can_run_ahead` reads from the outputs."""
    params = SamplingParams(max_tokens=4, **extra)  # type: ignore[arg-type]
    runner.add_request("flag", params, [5, 6, 7])
    try:
        assert runner._requests["flag"].samples_on_history is bound
    finally:
        runner.remove_request("flag")


def test_aborts_between_steps_leave_the_others_unchanged(runner: ModelRunner) -> None:
    params = _greedy(LENGTHS)
    abort = {3: "job0", 6: "job3", 7: "job4"}
    base = serve(runner, PROMPTS, params, ahead=False, abort=abort)
    ahead = serve(runner, PROMPTS, params, ahead=True, abort=abort)
    for j in ("job1", "job2", "job5"):
        assert ahead.tokens[j] == base.tokens[j] and ahead.finish[j] == "length"
    for j in ("job0", "job3", "job4"):
        assert j not in ahead.finish
        assert ahead.tokens[j] == base.tokens[j][: len(ahead.tokens[j])]
    # The comparison means something: steps ran ahead, and aborted jobs had
    # tokens to compare (one aborted before its first may have none).
    assert ahead.num_ahead > 0
    assert sum(len(ahead.tokens[j]) > 0 for j in ("job0", "job3", "job4")) >= 2


def test_graph_buckets_read_the_pending_tokens_on_the_device(tiny_llama_path: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graphs = ModelRunner(tiny_llama_path, "float32", device, num_blocks=64, block_size=BLOCK,
                         max_model_len=96, num_threads=1, attention_backend="triton",
                         cuda_graph_max_batch=4, cuda_graph_max_tokens=24)
    prompts = dict(itertools.islice(PROMPTS.items(), 4))
    # At most 12 tokens each: on CPU every pass runs the Triton kernels in
    # the interpreter, and 12 already give mixed passes and a dozen ahead.
    params = _greedy({j: min(n, 12) for j, n in LENGTHS.items()})
    base = serve(graphs, prompts, params, ahead=False, policy="fcfs")
    runs = (graphs.graphs.num_runs, graphs.mixed_graphs.num_runs)  # type: ignore[union-attr]
    ahead = serve(graphs, prompts, params, ahead=True, policy="fcfs")
    _same(ahead, base)
    assert graphs.graphs.num_runs > runs[0]  # type: ignore[union-attr]
    assert graphs.mixed_graphs.num_runs > runs[1]  # type: ignore[union-attr]
    assert ahead.num_ahead > 10


def test_a_pending_token_anywhere_but_last_is_refused(runner: ModelRunner) -> None:
    runner.add_request("x", SamplingParams(max_tokens=4), [5, 6, 7])
    try:
        bad = Plan(1, [ScheduledChunk("x", [5, PENDING_TOKEN, 7], 0, [0], True, 0)])
        with pytest.raises(ValueError, match="other than the last"):
            runner.execute(bad)
        # A lone id below 0 that is not the pending one, first or last.
        for ids in ([-7], [-7, PENDING_TOKEN]):
            bad = Plan(1, [ScheduledChunk("x", ids, 2, [0], True, 0)])
            with pytest.raises(ValueError, match="other than the last"):
                runner.execute(bad)
        # Last, but with nothing in flight and nothing sampled yet.
        bad = Plan(2, [ScheduledChunk("x", [5, 6, PENDING_TOKEN], 0, [0], True, 0)])
        with pytest.raises(ValueError, match="neither sampled nor in flight"):
            runner.execute(bad)
    finally:
        runner.remove_request("x")
