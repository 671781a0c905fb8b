"""SamplingParams validation and the batched sampler."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.sampling import SampleRequest, Sampler, SamplingParams
from engine.top_k_top_p import (
    _top_k_top_p_sorted,
    apply_top_k_top_p,
    top_k_top_p_without_waiting,
)
from tests.engine.helpers import reference_adjust

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


def test_samples_follow_the_distribution_and_skip_zero_probabilities() -> None:
    # Probabilities 0.4 / 0.3 / 0.2 / 0.1 over four tokens, -inf elsewhere
    # (including between them: a flat step of the running sum).
    probs = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.0, 0.1])
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, : len(probs)] = probs.log()
    n = 20_000
    s = Sampler(seed=3)
    draws = s.sample(logits.repeat(n, 1), [SampleRequest(SamplingParams(temperature=1.0), 0)] * n)
    counts = torch.bincount(torch.tensor(draws), minlength=VOCAB).double()
    assert counts[len(probs):].sum() == 0 and counts[1] == 0 and counts[4] == 0
    expected = probs.double() * n
    nz = expected > 0
    chi2 = (((counts[: len(probs)][nz] - expected[nz]) ** 2) / expected[nz]).sum().item()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("case", ["peaked", "flat", "ties", "large_k", "mixed_off"])
def test_top_k_top_p_matches_the_full_sort(case: str) -> None:
    """The candidate cut gives the full sort's result, falling back to the
    sort where the kept set may reach past the candidates."""
    g = torch.Generator().manual_seed(len(case))
    # "flat": some nuclei reach past both candidate widths (256, 4,096).
    rows, vocab = 24, 6000 if case == "flat" else 3000
    scale = {"peaked": 4.0, "flat": 0.05}.get(case, 2.0)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if case == "ties":
        logits = logits.round()  # many equal logits around every k-th value
    top_k = torch.randint(1, 400, (rows,), generator=g)
    if case == "large_k":
        top_k = torch.randint(200, vocab + 1, (rows,), generator=g)
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    if case == "mixed_off":
        top_k[::3] = vocab
        top_p[1::3] = 1.0
    for k, p in [(top_k, None), (None, top_p), (top_k, top_p)]:
        got = apply_top_k_top_p(logits.clone(), k, p)
        want = _top_k_top_p_sorted(logits.clone(), k, p)
        # Rows whose nucleus edge is within float rounding of top_p may
        # differ by that one token; none of these cases has one that close.
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), case
        assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])


@pytest.mark.parametrize("ties", [False, True])
def test_the_cut_that_reads_nothing_back_keeps_what_the_candidate_cut_keeps(
        ties: bool) -> None:
    """The GPU's cut (rows chosen on the host: top-k alone by `topk`, top-p
    or a very large k by a sort) keeps the same tokens as the candidate cut,
    and leaves the rows that ask for neither as they are."""
    g = torch.Generator().manual_seed(3)
    rows, vocab = 14, 6000
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    logits[4] *= 0.02  # a flat row: its nucleus reaches past every candidate width
    if ties:
        logits = logits.round()  # many equal logits at every k-th value
    ks = [5, vocab, 300, 1, vocab, 9000, 5000, 40, vocab, 17, 2, vocab, 250, 64]
    ps = [1.0, 0.9, 1.0, 1.0, 0.95, 1.0, 1.0, 0.5, 1.0, 0.99, 1.0, 1.0, 0.3, 1.0]
    before = logits.clone()
    for k, p in [(ks, None), (None, ps), (ks, ps)]:
        got = top_k_top_p_without_waiting(logits, k, p)
        assert torch.equal(logits, before)  # the caller's logits are left alone
        want = apply_top_k_top_p(
            logits.clone(), None if k is None else torch.tensor(k),
            None if p is None else torch.tensor(p))
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], logits[kept])
        off = [i for i in range(rows)
               if (k is None or k[i] >= vocab) and (p is None or p[i] >= 1.0)]
        assert off and torch.equal(got[off], logits[off])
    assert torch.equal(top_k_top_p_without_waiting(logits, None, None), logits)


@pytest.mark.parametrize("cut", ["sorted", "candidates"])
def test_the_cuts_keep_every_tie_at_the_nucleus_edge(cut: str) -> None:
    """Mass above 3 is 0.46 of the row, above each 2 the same 0.46: all
    three 2s survive top_p 0.6, whatever order a sort or `topk` leaves them
    in (a GPU's sort is not stable), and top_p 0.4 keeps the 3 alone."""
    logits = torch.tensor([[2.0, 0.0, 2.0, 3.0, 2.0]] * 2)
    fn = _top_k_top_p_sorted if cut == "sorted" else apply_top_k_top_p
    got = fn(logits, None, torch.tensor([0.6, 0.4]))
    assert torch.isfinite(got).tolist() == [[True, False, True, True, True],
                                            [False, False, False, True, False]]


def test_ties_at_the_nucleus_edge_running_past_the_candidates_are_sorted() -> None:
    """300 equal logits below a clear top: the nucleus ends among them, so
    all 300 stay, though the first candidate width holds 256 of them."""
    logits = torch.full((1, 1000), -10.0)
    logits[0, 0] = 2.0
    logits[0, 100:400] = 0.0
    got = apply_top_k_top_p(logits, None, torch.tensor([0.2]))
    assert torch.isfinite(got[0]).nonzero().squeeze(1).tolist() == [0, *range(100, 400)]


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


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_top() -> None:
    # Logits 0..4 at temperature 0.5 are 0, 2, .., 8: against the top token,
    # the next ones have e^-2 = 0.135, e^-4 = 0.018, e^-6 = 0.0025 of its
    # probability (min_p applies after temperature).
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    s = Sampler(seed=0)
    rows = 1000
    for min_p, want in ((0.1, {3, 4}), (0.01, {2, 3, 4}), (0.5, {4})):
        p = SamplingParams(temperature=0.5, min_p=min_p)
        seen = set(s.sample(logits.repeat(rows, 1), [SampleRequest(p, 0)] * rows))
        assert seen == want, (min_p, seen)
    # Off: tokens 1 and 0 (0.2 % and 0.03 %) may come; token 2 (1.6 %) does.
    p = SamplingParams(temperature=0.5)
    assert {2, 3, 4} <= set(s.sample(logits.repeat(rows, 1), [SampleRequest(p, 0)] * rows))
    # Per row: one row's min_p does not touch its neighbour's draws.
    mixed = [SampleRequest(SamplingParams(temperature=0.5, min_p=0.5 if i % 2 else 0.0), 0)
             for i in range(rows)]
    picked = s.sample(logits.repeat(rows, 1), mixed)
    assert set(picked[1::2]) == {4} and len(set(picked[0::2])) >= 3


def test_banned_tokens_are_never_sampled() -> None:
    logits = _logits(4)
    top = logits.argmax(-1).tolist()
    reqs = [SampleRequest(SamplingParams(temperature=0.0), 0, banned_token_ids=[t]) for t in top]
    got = Sampler().sample(logits, reqs)
    assert all(g != t for g, t in zip(got, top))
    assert got == logits.scatter(1, torch.tensor(top)[:, None], float("-inf")).argmax(-1).tolist()


# Penalties, logit bias, logprobs ------------------------------------------


def _history(seed: int, n: int) -> list[int]:
    # A small id range so that tokens repeat and prompt / output overlap.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (n,), generator=gen).tolist()


def _reference_adjust(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    return torch.stack([
        reference_adjust(logits[i], r.params, list(r.prompt_token_ids),
                         list(r.output_token_ids), tuple(r.banned_token_ids))
        for i, r in enumerate(reqs)
    ])


def _penalised_requests() -> list[SampleRequest]:
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.8, presence_penalty=1.5),
        SamplingParams(temperature=0.0),  # nothing to adjust
        SamplingParams(temperature=1.0, frequency_penalty=-0.7, presence_penalty=-0.3,
                       repetition_penalty=0.6),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logit_bias={5: -100.0, 7: 3.5}),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias={39: 100.0}),
    ]
    return [
        SampleRequest(p, output_index=len(_history(100 + i, 3 * i)),
                      banned_token_ids=(2, 9) if i == 4 else (),
                      prompt_token_ids=_history(i, 7 + i),
                      output_token_ids=_history(100 + i, 3 * i))
        for i, p in enumerate(params)
    ]


def test_adjust_logits_matches_hf_and_formula() -> None:
    from engine.sampling import adjust_logits

    reqs = _penalised_requests()
    logits = _logits(len(reqs), seed=3)
    want = _reference_adjust(logits, reqs)
    got = logits.clone()
    adjust_logits(got, reqs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # The rows the test relies on were really changed, the plain row not.
    changed = (got != logits).any(dim=-1).tolist()
    assert changed == [True, True, False, True, True, True]
    # Presence / frequency count outputs only: a prompt-only token of row 1
    # keeps its logit.
    prompt_only = set(reqs[1].prompt_token_ids) - set(reqs[1].output_token_ids)
    assert prompt_only
    for tok in prompt_only:
        assert got[1, tok] == logits[1, tok]


def test_sampler_applies_adjustments_before_greedy_and_keeps_input_raw() -> None:
    reqs = _penalised_requests()
    logits = _logits(len(reqs), seed=4)
    raw = logits.clone()
    got = Sampler(seed=0).sample(logits, reqs)
    assert torch.equal(logits, raw)
    want = _reference_adjust(logits, reqs).argmax(-1).tolist()
    for i, r in enumerate(reqs):
        if r.params.greedy:
            assert got[i] == want[i]
    assert got[5] == 39  # forced by +100 through temperature sampling


def test_logit_bias_bans_and_forces_tokens() -> None:
    logits = _logits(64, seed=5)
    top = logits.argmax(-1).tolist()
    s = Sampler(seed=1)
    for temperature in (0.0, 1.0):
        banned = [SampleRequest(SamplingParams(temperature=temperature,
                                               logit_bias={t: -100.0}), 0) for t in top]
        assert all(g != t for g, t in zip(s.sample(logits, banned), top))
        forced = [SampleRequest(SamplingParams(temperature=temperature, seed=k,
                                               logit_bias={(7 * k) % VOCAB: 100.0}), k)
                  for k in range(64)]
        assert s.sample(logits, forced) == [(7 * k) % VOCAB for k in range(64)]


def test_seeded_penalised_rows_are_batch_independent() -> None:
    reqs = [r for r in _penalised_requests() if not r.params.greedy]
    seeded = [SampleRequest(r.params.model_copy(update={"seed": 7 + i}), r.output_index,
                            r.banned_token_ids, r.prompt_token_ids, r.output_token_ids)
              for i, r in enumerate(reqs)]
    logits = _logits(len(seeded), seed=6)
    alone = [Sampler().sample(logits[i : i + 1], [r])[0] for i, r in enumerate(seeded)]
    crowd = [SampleRequest(SamplingParams(temperature=1.2), 0)] * 5
    rows = torch.cat([_logits(5, seed=8), logits.flip(0)])
    batched = Sampler(seed=3).sample(rows, crowd + seeded[::-1])[5:]
    assert batched[::-1] == alone


def test_token_logprobs_match_log_softmax() -> None:
    from engine.sampling import token_logprobs

    logits = _logits(5, seed=9)
    ids = [3, 499, 0, 250, 17]
    num_top = [0, 1, 4, 7, 2]
    got = token_logprobs(logits, ids, num_top)
    ref = logits.double().log_softmax(-1)
    for i, (tok, k) in enumerate(zip(ids, num_top)):
        assert got[i].logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        order = ref[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in got[i].top] == order
        assert [lp for _, lp in got[i].top] == pytest.approx(ref[i, order].tolist(), abs=1e-5)
        # vLLM's rank: 1 + the tokens more likely (random logits: no ties).
        assert got[i].rank == ref[i].argsort(descending=True).tolist().index(tok) + 1
    # The most likely token ranks first.
    top_id = int(logits[0].argmax())
    assert token_logprobs(logits[:1], [top_id], [0])[0].rank == 1
    # More alternatives than the vocabulary: all of it, most likely first.
    (whole,) = token_logprobs(logits[:1], [0], [VOCAB + 10])
    assert len(whole.top) == VOCAB
    assert token_logprobs(logits[:0], [], []) == []


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101.0}), r"\[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), "non-negative"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_surface_validation_messages(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        SamplingParams(**kwargs)
