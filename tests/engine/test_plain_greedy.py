"""Batches of plain greedy rows take the argmax without per-row sampling
requests (`engine.runner_prepare.plain_greedy`), with the tokens the full
sampling path gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.runner as runner_module
from engine.request import RequestState
from engine.runner import ModelRunner
from engine.runner_prepare import plain_greedy
from engine.sampling import Sampler, SampleRequest
from engine.sampling_params import SamplingParams
from scheduler.plan import ScheduledChunk
from tests.engine.helpers import drive, random_prompts


def _state(params: SamplingParams, outputs: int = 0) -> RequestState:
    return RequestState("j", params, [1, 2], None,  # type: ignore[arg-type]
                        frozenset({0}), output_token_ids=list(range(5, 5 + outputs)))


def _chunk(draft: int = 0) -> ScheduledChunk:
    return ScheduledChunk("j", [7] * (1 + draft), 2, [0], True, 1, draft=draft)


@pytest.mark.parametrize(("params", "plain"), [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, logprobs=3), True),  # read after sampling
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0.0, allowed_token_ids=[5, 6]), False),
    (SamplingParams(temperature=0.0, bad_words_token_ids=[[6]]), False),
])
def test_a_request_is_plain_greedy_only_without_anything_that_changes_its_logits(
        params: SamplingParams, plain: bool) -> None:
    assert _state(params).plain_greedy is plain


def test_a_batch_is_plain_only_past_every_rows_min_tokens_and_without_drafts() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert plain_greedy([(_chunk(), _state(greedy)), (_chunk(), _state(greedy, 3))])
    assert plain_greedy([])
    # Before min_tokens its stop tokens are banned.
    early = SamplingParams(temperature=0.0, min_tokens=2)
    assert not plain_greedy([(_chunk(), _state(greedy)), (_chunk(), _state(early, 1))])
    assert plain_greedy([(_chunk(), _state(early, 2))])
    assert not plain_greedy([(_chunk(draft=2), _state(greedy))])
    assert not plain_greedy([(_chunk(), _state(SamplingParams(temperature=0.5)))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_argmax_is_the_sampling_paths_greedy_token(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=gen).to(dtype)
    weight = torch.randn(300, 32, generator=gen).to(dtype)
    weight[17] = weight[3]  # a tie at the top for some rows
    logits = hidden @ weight.T
    sampler = Sampler(seed=0)
    reqs = [SampleRequest(SamplingParams(temperature=0.0), 1) for _ in range(6)]
    for exact in (None, (hidden, weight)):
        want = sampler.sample_tensor(logits, reqs, exact)
        assert torch.equal(sampler.greedy_tensor(logits, exact), want)
    assert sampler.greedy_tensor(logits[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_skips_sampling_requests_for_plain_batches_with_the_same_tokens(
        tiny_llama_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r = ModelRunner(tiny_llama_path, dtype, "cpu", num_blocks=64, block_size=4,
                    max_model_len=80, num_threads=1)
    prompts = random_prompts([9, 5, 12], seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    built: list[int] = []
    real = ModelRunner._sample_requests

    def spy(self: ModelRunner, sampled: list) -> list[SampleRequest]:  # type: ignore[type-arg]
        built.append(len(sampled))
        return real(self, sampled)

    monkeypatch.setattr(ModelRunner, "_sample_requests", spy)
    fast = drive(r, prompts, greedy, num_blocks=64, block_size=4, max_model_len=80)
    assert built == []  # every batch plain greedy
    # The same batches with the same ids at every step: comparable in bf16 too.
    monkeypatch.setattr(runner_module, "plain_greedy", lambda sampled: False)
    full = drive(r, prompts, greedy, num_blocks=64, block_size=4, max_model_len=80)
    assert built and fast.tokens == full.tokens
    monkeypatch.undo()
    # One sampled request in the batch: every row goes the full way.
    built.clear()
    monkeypatch.setattr(ModelRunner, "_sample_requests", spy)
    mixed = {j: greedy for j in prompts} | {"job1": SamplingParams(
        temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)}
    got = drive(r, prompts, mixed, num_blocks=64, block_size=4, max_model_len=80)
    assert built
    if dtype == "float32":  # another row's tokens differ: compared only in float32
        assert got.tokens["job0"] == fast.tokens["job0"]
