"""Speculative decoding (scheduler/speculation.py drafts, engine/speculative.py
verifies): a greedy request's tokens are those it yields without drafts,
through preemption, stop conditions and mixed batches, in fewer steps when
drafts are right.

A random model's text does not repeat itself, so the n-gram lookup would
find few drafts it accepts; here an oracle proposes each job's own future
tokens (from a run without drafts), every third proposal with a wrong
token in it, so that both accepted runs and refusals go through the engine.
The lookup itself is tested in tests/scheduler/test_speculation.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.helpers import DriveResult, drive, random_prompts

SPEC = {"num_tokens": 4, "min_ngram": 1, "max_ngram": 3}


def _looping(n: int, seed: int) -> dict[str, list[int]]:
    """Prompts that repeat a phrase: a model's answer tends to go on with
    it, and drafts are found in the prompt."""
    out = {}
    for i, (job, p) in enumerate(random_prompts([5] * n, seed=seed).items()):
        out[job] = (p * 4)[: 14 + i]
    return out


class Oracle:
    """Drafts from the tokens each prompt is known to yield."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.futures = futures
        self.calls = 0
        self.seen: set[tuple[int, ...]] = set()

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        for prompt, future in self.futures.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(future[done:done + limit])
                self.calls += 1
                self.seen.add(tuple(tokens))
                if drafts and self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 1000  # a wrong draft
                return drafts
        return []


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Oracle:
    o = Oracle({})
    monkeypatch.setattr("scheduler.speculation.NgramIndex.propose",
                        lambda self, tokens, limit: o.propose(tokens, limit))
    return o


def _plain(runner: ModelRunner, oracle: Oracle, prompts: dict[str, list[int]],
           params: dict[str, SamplingParams]) -> DriveResult:
    """The run without drafts, whose tokens the oracle then knows."""
    run = _drive(runner, prompts, params, None)
    oracle.futures = {tuple(prompts[j]): run.tokens[j] for j in prompts}
    return run


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=64, block_size=4,
                       max_model_len=128)


def _drive(runner: ModelRunner, prompts: dict[str, list[int]],
           params: dict[str, SamplingParams], spec: dict[str, Any] | None,
           **kw: Any) -> DriveResult:
    extra: dict[str, Any] = {"num_blocks": 64, "max_batch_tokens": 64, **kw}
    if spec is not None:
        extra["speculative"] = spec
    return drive(runner, prompts, params, block_size=4, **extra)


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_drafted_tokens_are_the_tokens_without_drafts(runner: ModelRunner,
                                                      oracle: Oracle) -> None:
    prompts = _looping(4, seed=31)
    params = {j: _greedy(24) for j in prompts}
    plain = _plain(runner, oracle, prompts, params)
    spec = _drive(runner, prompts, params, SPEC)
    assert spec.tokens == plain.tokens
    assert spec.num_steps <= 0.6 * plain.num_steps, (spec.num_steps, plain.num_steps)


def test_the_ngram_lookups_drafts_change_no_token(runner: ModelRunner,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The real lookup on prompts that repeat a phrase: drafts are proposed
    (a random model mostly refuses them) and the tokens stay the same."""
    import scheduler.core

    drafted = []
    add = scheduler.core.add_drafts
    monkeypatch.setattr(scheduler.core, "add_drafts",
                        lambda *a: drafted.append(add(*a)) or drafted[-1])
    prompts = _looping(4, seed=36)
    params = {j: _greedy(24) for j in prompts}
    plain = _drive(runner, prompts, params, None)
    spec = _drive(runner, prompts, params, SPEC)
    assert spec.tokens == plain.tokens and sum(drafted) > 0


def test_preemption_and_a_small_cache_keep_the_tokens(runner: ModelRunner,
                                                      oracle: Oracle) -> None:
    prompts = _looping(5, seed=32)
    params = {j: _greedy(20) for j in prompts}
    plain = _plain(runner, oracle, prompts, params)
    squeezed = _drive(runner, prompts, params, SPEC, num_blocks=16, max_model_len=48)
    assert squeezed.num_mid_generation_preemptions > 0
    assert squeezed.tokens == plain.tokens


def test_stop_conditions_end_inside_a_run_of_accepted_drafts(runner: ModelRunner,
                                                             oracle: Oracle) -> None:
    prompts = _looping(3, seed=33)
    base = _plain(runner, oracle, prompts, {j: _greedy(24) for j in prompts})
    params = {}
    for j, toks in base.tokens.items():
        # Stop at the token that follows the sixth output: wherever a draft
        # run covers it, nothing after it may be yielded.
        params[j] = SamplingParams(temperature=0.0, max_tokens=24,
                                   stop_token_ids=[toks[6]], ignore_eos=True)
    plain = _drive(runner, prompts, params, None)
    spec = _drive(runner, prompts, params, SPEC)
    assert spec.tokens == plain.tokens and spec.finish == plain.finish
    # max_tokens: drafts never run past it.
    short = {j: _greedy(7) for j in prompts}
    assert _drive(runner, prompts, short, SPEC).tokens == _drive(runner, prompts, short,
                                                                  None).tokens


def test_seeded_sampling_with_penalties_and_bans_yields_its_own_tokens(
        runner: ModelRunner, oracle: Oracle) -> None:
    """A row after drafts samples as the step without drafts would: from
    the seed stream of its output index, with the drafts in its penalties'
    history and in the count that lifts min_tokens' bans."""
    prompts = _looping(4, seed=38)
    ids = list(prompts)
    params = {
        ids[0]: SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
        ids[1]: SamplingParams(temperature=1.0, seed=6, top_p=0.9, top_k=50,
                               repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=20),
        ids[2]: SamplingParams(temperature=0.0, presence_penalty=0.5,
                               logit_bias={7: 2.0}, max_tokens=20, ignore_eos=True),
        ids[3]: SamplingParams(temperature=0.9, seed=8, min_tokens=12, max_tokens=20,
                               stop_token_ids=[5, 9, 11, 13]),
    }
    plain = _plain(runner, oracle, prompts, params)
    spec = _drive(runner, prompts, params, SPEC)
    assert spec.tokens == plain.tokens and spec.finish == plain.finish
    assert spec.num_steps <= 0.6 * plain.num_steps, (spec.num_steps, plain.num_steps)


def test_requests_it_cannot_verify_run_without_drafts(runner: ModelRunner,
                                                      oracle: Oracle) -> None:
    prompts = _looping(2, seed=34)
    ids = list(prompts)
    params = {ids[0]: _greedy(16), ids[1]: _greedy(16, logprobs=2)}
    plain = _plain(runner, oracle, prompts, params)
    spec = _drive(runner, prompts, params, SPEC)
    assert spec.tokens == plain.tokens
    # Only the request without logprobs was proposed drafts.
    asked = {t[:len(prompts[ids[0]])] for t in oracle.seen}
    assert asked == {tuple(prompts[ids[0]])}
    assert not SamplingParams(temperature=0.0, logprobs=1).draftable
    assert SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.2).draftable


def test_a_prediction_of_the_answer_drafts_it_and_edits_are_refused(
        runner: ModelRunner) -> None:
    """OpenAI's Predicted Outputs: the real answer with a few tokens changed
    as the prediction; the n-gram lookup finds the rest again after each
    change.  The answer is the one without drafts, in far fewer steps."""
    prompts = random_prompts([9, 12], seed=35)
    params = {j: _greedy(30) for j in prompts}
    plain = _drive(runner, prompts, params, None)
    predictions = {}
    for j, toks in plain.tokens.items():
        edited = list(toks)
        for at in (5, 17):
            edited[at] = (edited[at] + 1) % 1000
        predictions[j] = edited
    spec = _drive(runner, prompts, params, SPEC, predictions=predictions)
    assert spec.tokens == plain.tokens
    assert spec.num_steps <= 0.5 * plain.num_steps, (spec.num_steps, plain.num_steps)


def test_deterministic_bfloat16_answers_do_not_depend_on_drafts(
        tiny_llama_path: Path, oracle: Oracle) -> None:
    """Batch-invariant execution: a row's logits do not depend on the shape
    of its step, so in bfloat16 too drafts change no token."""
    det = ModelRunner(tiny_llama_path, "bfloat16", "cpu", num_blocks=64, block_size=4,
                      max_model_len=128, deterministic=True)
    prompts = _looping(4, seed=37)
    params = {j: _greedy(24) for j in prompts}
    plain = _plain(det, oracle, prompts, params)
    spec = _drive(det, prompts, params, SPEC)
    assert spec.tokens == plain.tokens
    assert spec.num_steps < plain.num_steps


def test_swapped_and_checkpointed_jobs_keep_their_tokens(tiny_llama_path: Path,
                                                          oracle: Oracle) -> None:
    """Blocks a draft run wrote past the accepted tokens are swapped out and
    checkpointed with the rest; what follows overwrites them."""
    from kvstore.tier import LocalHostTier
    from scheduler.plan import Plan

    runner = ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                         max_model_len=80, num_threads=1)
    prompts = _looping(5, seed=39)
    params = {j: _greedy(20) for j in prompts}
    plain = _plain(runner, oracle, prompts, params)
    runner.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
    try:
        got = _drive(runner, prompts, params, SPEC, num_blocks=20, max_model_len=80,
                     max_batch_tokens=24, swap_mode="reactive", host_kv_blocks=64,
                     survival={"checkpoint": True, "every_blocks": 1})
        assert got.core is not None
        runner.execute(Plan(0, [], block_ops=got.core.swap.take_pending()))
    finally:
        runner.swapper = None
    assert got.tokens == plain.tokens
    assert got.core.swap.num_swap_out > 0 and oracle.calls > 0
