"""SamplingParams validation and the batched sampler."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.sampling import SampleRequest, Sampler, SamplingParams, apply_top_k_top_p

VOCAB = 500


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_defaults_follow_openai() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1
    assert p.seed is None and p.stop == [] and not p.ignore_eos
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=3), "min_tokens=5 must not exceed max_tokens=3"),
        (dict(stop=["ok", ""]), "non-empty"),
        (dict(stop_token_ids=[-1]), "non-negative"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_validation_messages(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        SamplingParams(**kwargs)


def test_greedy_and_top_k_1_and_tiny_top_p_agree() -> None:
    logits = _logits(8)
    want = logits.argmax(-1).tolist()
    s = Sampler(seed=0)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-6),
    ):
        assert s.sample(logits, [SampleRequest(params, 0)] * 8) == want


def test_seeded_reproducible_and_batch_independent() -> None:
    logits = _logits(6)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler().sample(logits[i : i + 1], [SampleRequest(seeded, k)])[0]
             for i, k in enumerate(range(6))]
    # Same rows inside a batch with greedy, unseeded and other-seed rows,
    # in a different order, from a sampler with another global seed.
    others = [
        SampleRequest(SamplingParams(temperature=0.0), 0),
        SampleRequest(SamplingParams(temperature=1.3, top_k=50), 3),
        SampleRequest(SamplingParams(temperature=0.9, seed=99, top_p=0.8), 2),
    ]
    order = [5, 2, 0, 4, 1, 3]
    rows = torch.cat([logits[order], _logits(3, seed=7)])
    reqs = [SampleRequest(seeded, k) for k in order] + others
    batched = Sampler(seed=42).sample(rows, reqs)[: len(order)]
    assert batched == [alone[k] for k in order]


def test_seed_stream_depends_on_output_index() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is the noise alone
    p = SamplingParams(temperature=1.0, seed=5)
    draws = {Sampler().sample(logits, [SampleRequest(p, k)])[0] for k in range(20)}
    assert len(draws) > 10
    other = SamplingParams(temperature=1.0, seed=6)
    assert [Sampler().sample(logits, [SampleRequest(other, k)])[0] for k in range(20)] != [
        Sampler().sample(logits, [SampleRequest(p, k)])[0] for k in range(20)
    ]


def test_top_k_top_p_support() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(masked[0, :3]).all() and torch.isfinite(masked[0, 3:]).all()
    # softmax of 0..4 puts ~0.64 on the top token, ~0.87 on the top two.
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.8]))
    assert torch.isfinite(masked[0]).tolist() == [False, False, False, True, True]
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0, top_k=2)
    seen = set(s.sample(logits.repeat(200, 1), [SampleRequest(p, 0)] * 200))
    assert seen == {3, 4}


def test_banned_tokens_are_never_sampled() -> None:
    logits = _logits(4)
    top = logits.argmax(-1).tolist()
    reqs = [SampleRequest(SamplingParams(temperature=0.0), 0, banned_token_ids=[t]) for t in top]
    got = Sampler().sample(logits, reqs)
    assert all(g != t for g, t in zip(got, top))
    assert got == logits.scatter(1, torch.tensor(top)[:, None], float("-inf")).argmax(-1).tolist()
