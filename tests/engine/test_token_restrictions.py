"""vLLM's `allowed_token_ids` and `bad_words` in the engine: the words'
spellings, the bans they make after an answer so far, the sampler's mask,
and whole decodes through the scheduler core, with preemption and
speculative drafts (iterations planned ahead: tests/engine/test_plan_ahead.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from engine.bad_words import bad_words_token_ids, banned_by_words, needs_history
from engine.request import RequestState
from engine.runner import ModelRunner
from engine.sampling import SampleRequest, Sampler, adjust_logits
from engine.sampling_params import SamplingParams
from tests.engine.helpers import drive, random_prompts

SCHED = {"block_size": 4, "max_model_len": 80}


def test_a_word_is_banned_as_written_and_after_a_space() -> None:
    vocab = {"cat": [7], " cat": [8], "dog house": [3, 4], " dog house": [9, 4],
             "hotdog": [5, 6], " hotdog": [10, 5, 6]}

    def encode(text: str) -> list[int]:
        return list(vocab[text])

    # Leading spaces are dropped; the spaced spelling is kept where the
    # space makes a word token of its own (same length, another first id).
    assert bad_words_token_ids(["cat", "  dog house", "hotdog"], encode) == [
        [7], [8], [3, 4], [9, 4], [5, 6]]
    assert needs_history([[7], [8]]) is False
    assert needs_history([[7], [3, 4]]) is True


def test_the_bans_follow_the_answers_last_tokens() -> None:
    words = [[7], [3, 4], [1, 2, 3]]
    assert banned_by_words(words, []) == [7]
    assert banned_by_words(words, [5, 3]) == [7, 4]
    assert banned_by_words(words, [1, 2]) == [7, 3]
    assert banned_by_words(words, [2, 1, 2]) == [7, 3]
    assert banned_by_words(words, [1, 2, 9]) == [7]


def _state(params: SamplingParams, outputs: list[int]) -> RequestState:
    # No text is decoded here: the bans read token ids alone.
    return RequestState("j", params, [1, 2], None,  # type: ignore[arg-type]
                        frozenset({0}), output_token_ids=list(outputs))


def test_a_requests_bans_join_min_tokens_and_count_drafts() -> None:
    params = SamplingParams(min_tokens=3, bad_words_token_ids=[[3, 4], [6]])
    assert _state(params, [3]).banned_token_ids() == (0, 4, 6)
    assert _state(params, [3, 5]).banned_token_ids() == (0, 6)
    # Drafts count as outputs, for min_tokens and for the words.
    assert _state(params, [5]).banned_token_ids([5, 3]) == (4, 6)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[2, -3]]), "bad_words_token_ids"),
])
def test_params_refuse_empty_or_negative_ids(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        SamplingParams(**kwargs)


def test_the_mask_leaves_the_allowed_logits_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    reqs = [SampleRequest(SamplingParams(allowed_token_ids=[4, 9, 9, 30]), 0),
            SampleRequest(SamplingParams(), 0),
            SampleRequest(SamplingParams(allowed_token_ids=[49]), 0)]
    adjust_logits(logits, reqs)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[4, 9, 30], list(range(50)), [49]]
    assert torch.equal(logits[0, [4, 9, 30]], raw[0, [4, 9, 30]])
    assert torch.equal(logits[1], raw[1])
    # Sampled, greedy or random, only allowed tokens come out.
    sampler = Sampler(seed=0)
    allowed = SamplingParams(allowed_token_ids=[4, 9, 30], temperature=1.0)
    picks = sampler.sample(raw.repeat(100, 1), [SampleRequest(allowed, 0)] * 300)
    assert set(picks) == {4, 9, 30}
    greedy = allowed.model_copy(update={"temperature": 0.0})
    want = [4, 9, 30][int(raw[0, [4, 9, 30]].argmax())]
    assert sampler.sample(raw[:1].clone(), [SampleRequest(greedy, 0)]) == [want]


def test_contradicting_restrictions_leave_a_token_to_sample() -> None:
    """Allowed tokens that a request's own bans or grammar all refuse: the
    row keeps what it had before that stage, never nothing at all."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    only_1 = torch.zeros(2, dtype=torch.int32)  # a grammar's mask row: token 1 alone
    only_1[0] = 1 << 1
    reqs = [
        SampleRequest(SamplingParams(allowed_token_ids=[5, 6]), 0, banned_token_ids=(5, 6)),
        SampleRequest(SamplingParams(allowed_token_ids=[5]), 0, allowed=only_1),
        SampleRequest(SamplingParams(allowed_token_ids=[5, 6]), 0, banned_token_ids=(5,)),
    ]
    adjust_logits(logits, reqs)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[5, 6], [1], [6]]
    for temperature in (0.0, 1.0):
        params = [r.params.model_copy(update={"temperature": temperature}) for r in reqs]
        again = [SampleRequest(p, 0, r.banned_token_ids, allowed=r.allowed)
                 for p, r in zip(params, reqs)]
        raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
        picks = Sampler(seed=0).sample(raw, again)
        assert picks[0] in (5, 6) and picks[1] == 1 and picks[2] == 6


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, "float32", "cpu", num_blocks=96, block_size=4,
                       max_model_len=80, num_threads=1)


def _greedy(**kw: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    return SamplingParams(**(base | kw))  # type: ignore[arg-type]


def _pairs(tokens: list[int]) -> set[tuple[int, int]]:
    return set(zip(tokens, tokens[1:]))


def test_decodes_keep_to_the_allowed_tokens_and_avoid_the_words(tiny: ModelRunner) -> None:
    prompts = random_prompts([6, 21, 13, 30], seed=41)
    jobs = list(prompts)
    free = drive(tiny, prompts, _greedy(), num_blocks=96, **SCHED).tokens
    a, b, c, d = (free[j] for j in jobs)
    params = {
        # Its own answer's tokens and more: the mask changes nothing.
        jobs[0]: _greedy(allowed_token_ids=sorted(set(a)) + [1, 2, 3]),
        # Three tokens, none of its answer's first: a new answer of them.
        jobs[1]: _greedy(allowed_token_ids=[t for t in (11, 12, 13, 14) if t != b[0]][:3]),
        # A one-token word (its first token) and a two-token one (its
        # answer's 5th and 6th).
        jobs[2]: _greedy(bad_words_token_ids=[[c[0]]]),
        jobs[3]: _greedy(bad_words_token_ids=[[d[4], d[5]]]),
    }
    want_pair = (d[4], d[5])
    squeezed = {"num_blocks": 14, "max_batch_tokens": 10, "max_model_len": 48}
    for kw in ({"num_blocks": 96}, squeezed):
        got = drive(tiny, prompts, params, **{**SCHED, **kw})  # type: ignore[arg-type]
        t0, t1, t2, t3 = (got.tokens[j] for j in jobs)
        assert t0 == a
        assert set(t1) <= set(params[jobs[1]].allowed_token_ids or ()) and len(t1) == 12
        assert c[0] not in t2 and t2 != c
        # The same up to the word's first token; then another next token.
        assert t3[:5] == d[:5] and t3[5] != d[5] and want_pair not in _pairs(t3)
        if kw["num_blocks"] == 14:
            assert got.num_mid_generation_preemptions > 0


def test_out_of_vocabulary_ids_are_refused(tiny: ModelRunner) -> None:
    prompt = random_prompts([5], seed=42)["job0"]
    for params in (_greedy(allowed_token_ids=[1, tiny.vocab_size]),
                   _greedy(bad_words_token_ids=[[tiny.vocab_size + 3]])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tiny.add_request("oov", params, prompt)
        assert not tiny.has_request("oov")


def test_drafts_keep_the_bans(tiny: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row after drafts is banned what the answer with those drafts would
    be: the tokens are those without drafts."""
    prompts = {j: (p * 4)[:14] for j, p in random_prompts([5, 5, 5], seed=43).items()}
    free = drive(tiny, prompts, _greedy(max_tokens=20), num_blocks=96, **SCHED).tokens
    params = {j: _greedy(max_tokens=20, bad_words_token_ids=[[t[6], t[7]], [t[10]]])
              for j, t in free.items()}
    plain = drive(tiny, prompts, params, num_blocks=96, **SCHED)
    assert all(plain.tokens[j] != free[j] for j in prompts)
    # Drafts: each job's answer without the bans, so that drafts are
    # accepted up to where the bans turn the answer and refused there.
    futures = {tuple(prompts[j]): free[j] for j in prompts}

    def propose(self: object, tokens: list[int], limit: int) -> list[int]:
        for prompt, future in futures.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return list(future[done:done + limit])
        return []

    monkeypatch.setattr("scheduler.speculation.NgramIndex.propose", propose)
    spec = drive(tiny, prompts, params, num_blocks=96,
                 speculative={"num_tokens": 4, "min_ngram": 1, "max_ngram": 3}, **SCHED)
    assert spec.tokens == plain.tokens
    assert spec.num_steps < plain.num_steps
