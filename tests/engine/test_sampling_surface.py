"""The OpenAI sampling surface end to end through the runner and the
scheduler core: penalties and logit bias in decoding, the logprobs of
sampled tokens and of prompt tokens, against the HF float32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kvstore.tier import LocalHostTier
from scheduler.plan import Plan, ScheduledChunk, TokenLogprob
from tests.engine.helpers import (
    DriveResult, drive, hf_adjusted_greedy, hf_greedy, hf_logprobs, load_hf, random_prompts,
)

NEW = 10
SCHED = {"block_size": 4, "max_model_len": 64}
# Logprobs of two float32 forwards (ours, HF's) differ by summation order.
ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


@pytest.fixture(scope="module")
def hf(tiny_llama_path: Path) -> torch.nn.Module:
    return load_hf(tiny_llama_path)


def _params(**kw: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}
    return SamplingParams(**(base | kw))  # type: ignore[arg-type]


def _assert_logprob(got: TokenLogprob | None, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert got is not None
    assert got.logprob == pytest.approx(ref_row[token].item(), abs=ATOL)
    ref_top = ref_row.topk(k)
    assert [t for t, _ in got.top] == ref_top.indices.tolist()
    assert [lp for _, lp in got.top] == pytest.approx(ref_top.values.tolist(), abs=ATOL)


def _assert_prompt_logprobs(got: list[TokenLogprob | None], hf: torch.nn.Module,
                            prompt: list[int], k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        _assert_logprob(got[p], ref[p - 1], prompt[p], k)


def test_penalties_and_bias_match_hf_in_a_preempting_batch(
    tiny: ModelRunner, hf: torch.nn.Module
) -> None:
    prompts = random_prompts([7, 30, 19, 44, 3], seed=11)
    jobs = list(prompts)
    plain = drive(tiny, prompts, _params(), num_blocks=96, **SCHED)
    # A random model seldom repeats itself, so penalties below 1 / below 0
    # (which favour what was seen) are what visibly changes its decoding.
    params = {
        jobs[0]: _params(repetition_penalty=0.5),
        jobs[1]: _params(presence_penalty=-1.5, frequency_penalty=-0.5),
        jobs[2]: _params(),
        jobs[3]: _params(repetition_penalty=1.5, frequency_penalty=-1.0,
                         logit_bias={plain.tokens[jobs[3]][0]: -100.0, 11: 4.0}),
        jobs[4]: _params(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.2),
    }
    want = {j: hf_adjusted_greedy(hf, prompts[j], params[j], NEW) for j in jobs}
    # The reference without adjustments is HF's plain greedy decode, and
    # every adjustment changes what is decoded (else this test could not fail).
    assert plain.tokens == {j: hf_greedy(hf, p, NEW) for j, p in prompts.items()}
    assert [want[j] != plain.tokens[j] for j in jobs] == [True, True, False, True, True]
    together = drive(tiny, prompts, params, num_blocks=96, **SCHED)
    squeezed = drive(tiny, prompts, params, num_blocks=18, max_batch_tokens=12, **SCHED)
    assert squeezed.num_mid_generation_preemptions > 0
    assert together.tokens == want
    assert squeezed.tokens == want


def test_logit_bias_bans_and_forces(tiny: ModelRunner) -> None:
    prompt = random_prompts([9], seed=12)["job0"]
    free = drive(tiny, {"j": prompt}, _params(), num_blocks=96, **SCHED).tokens["j"]
    banned = set(free[:3])
    got = drive(tiny, {"j": prompt}, _params(logit_bias={t: -100.0 for t in banned}),
                num_blocks=96, **SCHED).tokens["j"]
    assert not banned & set(got)
    forced = 777 if 777 not in free else 778
    for temperature in (0.0, 1.0):
        got = drive(tiny, {"j": prompt},
                    _params(temperature=temperature, logit_bias={forced: 100.0}),
                    num_blocks=96, **SCHED).tokens["j"]
        assert got == [forced] * NEW
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.add_request("oov", _params(logit_bias={tiny.vocab_size: 1.0}), prompt)
    assert not tiny.has_request("oov")


def test_sampled_logprobs_are_raw_and_match_hf(tiny: ModelRunner, hf: torch.nn.Module) -> None:
    prompts = random_prompts([6, 25, 14, 2], seed=13)
    jobs = list(prompts)
    params = {
        jobs[0]: _params(logprobs=5),
        # Raw logprobs: neither temperature, top-k, penalties nor bias
        # change the reported numbers.
        jobs[1]: _params(temperature=0.7, top_k=20, seed=3, presence_penalty=1.0,
                         repetition_penalty=1.3, logit_bias={5: 2.0}, logprobs=3),
        jobs[2]: _params(logprobs=0),
        jobs[3]: _params(),
    }
    got = drive(tiny, prompts, params, num_blocks=18, max_batch_tokens=10, **SCHED)
    assert got.num_preemptions > 0
    for j in jobs:
        k = params[j].logprobs
        if k is None:
            assert got.logprobs[j] == [None] * NEW
            continue
        ref = hf_logprobs(hf, prompts[j] + got.tokens[j])
        for i, tok in enumerate(got.tokens[j]):
            _assert_logprob(got.logprobs[j][i], ref[len(prompts[j]) - 1 + i], tok, k)
    assert got.prompt_logprobs == {}


def _count_logits_rows(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rows: list[int] = []
    inner = runner.model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return inner(hidden)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    return rows


@pytest.mark.parametrize("scenario", ["chunked", "recompute", "swap"])
def test_prompt_logprobs_match_hf_across_chunks_and_preemption(
    tiny: ModelRunner, hf: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    prompts = random_prompts([5, 38, 29, 1, 17], seed=14)
    jobs = list(prompts)
    params = {
        jobs[0]: _params(max_tokens=20),
        jobs[1]: _params(prompt_logprobs=3, logprobs=1),
        jobs[2]: _params(prompt_logprobs=0, temperature=1.0, seed=9),
        jobs[3]: _params(prompt_logprobs=2),
        jobs[4]: _params(),
    }
    rows = _count_logits_rows(tiny, monkeypatch)
    sched: dict[str, object] = dict(SCHED, max_batch_tokens=7, num_blocks=96)
    if scenario != "chunked":
        sched["num_blocks"] = 16
    if scenario == "swap":
        tiny.set_kv_tier(LocalHostTier(capacity_bytes=10**8))
        sched |= {"swap_mode": "reactive", "host_kv_blocks": 64}
    try:
        got = drive(tiny, prompts, params, **sched)  # type: ignore[arg-type]
        if scenario == "swap":
            assert got.core is not None and got.core.swap.num_swap_in > 0
            tiny.execute(Plan(0, [], block_ops=got.core.swap.take_pending()))
    finally:
        tiny.swapper = None
    if scenario != "chunked":
        assert got.num_mid_prompt_preemptions > 0
    asked = [j for j in jobs if params[j].prompt_logprobs is not None]
    assert sorted(got.prompt_logprobs) == sorted(asked)
    for j in asked:
        k = params[j].prompt_logprobs
        assert k is not None
        _assert_prompt_logprobs(got.prompt_logprobs[j], hf, prompts[j], k)
    # Each prompt position is computed once, however often its KV was
    # recomputed: one logits row per sampled token plus one per owed
    # prompt logprob.
    owed = sum(len(prompts[j]) - 1 for j in asked)
    assert sum(rows) == sum(len(t) for t in got.tokens.values()) + owed
    # Prompt logprobs leave the tokens alone.
    plain = drive(tiny, prompts, {j: p.model_copy(update={"prompt_logprobs": None})
                                  for j, p in params.items()}, **SCHED, num_blocks=96)
    assert plain.tokens == got.tokens


def test_prompt_logprobs_need_the_prefill(tiny: ModelRunner, hf: torch.nn.Module) -> None:
    prompt = random_prompts([10], seed=15)["job0"]
    tiny.add_request("shared", _params(prompt_logprobs=2), prompt)
    try:
        # Positions 0..3 prefilled by a sibling: their logits never existed here.
        late = ScheduledChunk("shared", prompt[4:], 4, [0, 1, 2], sample=True, output_index=0)
        with pytest.raises(ValueError, match="need the logits at prompt position 0"):
            tiny.execute(Plan(1, [late]))
        # Nothing was recorded: prefilling from the start still works.
        full = ScheduledChunk("shared", prompt, 0, [0, 1, 2], sample=True, output_index=0)
        out = tiny.execute(Plan(2, [full])).outputs[0]
        assert out.prompt_logprobs is not None
        _assert_prompt_logprobs(out.prompt_logprobs, hf, prompt, 2)
    finally:
        tiny.remove_request("shared")
    # A request resumed with outputs (migrated) got its prompt logprobs
    # where its first token was sampled.
    tiny.add_request("moved", _params(prompt_logprobs=2), prompt[:6], prompt[6:])
    try:
        chunk = ScheduledChunk("moved", prompt, 0, [0, 1, 2], sample=True, output_index=4)
        assert tiny.execute(Plan(3, [chunk])).outputs[0].prompt_logprobs is None
    finally:
        tiny.remove_request("moved")


def _drive_all(runner: ModelRunner, prompts: dict[str, list[int]],
               params: dict[str, SamplingParams], **sched: object) -> DriveResult:
    return drive(runner, prompts, params, **(dict(SCHED) | sched))  # type: ignore[arg-type]


def test_seeded_penalties_survive_preemption_and_batching(tiny: ModelRunner) -> None:
    prompts = random_prompts([5, 23, 41, 60, 2], seed=16)
    params = {
        j: SamplingParams(temperature=1.0, top_p=0.9, seed=200 + i, max_tokens=12,
                          ignore_eos=True, presence_penalty=0.5 * i - 1.0,
                          frequency_penalty=0.3, repetition_penalty=1.0 + 0.2 * i,
                          logit_bias={3 + i: 2.0}, logprobs=2)
        for i, j in enumerate(prompts)
    }
    together = _drive_all(tiny, prompts, params, num_blocks=96, max_model_len=80)
    squeezed = _drive_all(tiny, prompts, params, num_blocks=20, max_batch_tokens=24,
                          max_model_len=80)
    assert squeezed.num_mid_generation_preemptions > 0
    assert squeezed.tokens == together.tokens
    for j, p in prompts.items():
        alone = _drive_all(tiny, {j: p}, {j: params[j]}, num_blocks=96, max_model_len=80)
        assert alone.tokens[j] == together.tokens[j]
        for a, b in zip(alone.logprobs[j], squeezed.logprobs[j]):
            assert a is not None and b is not None
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
