"""Drafts for speculative decoding (scheduler/speculation.py): the n-gram
lookup, the limits a draft run keeps to, and the core's accounting of what
the engine accepted."""

from __future__ import annotations

import random

from scheduler.plan import JobOutput, Plan, StepResult
from scheduler.speculation import NgramIndex
from tests.scheduler.conftest import make_core, make_job

SPEC = {"num_tokens": 4, "min_ngram": 1, "max_ngram": 3}


def test_the_longest_ngram_ending_the_text_finds_what_followed_it_last() -> None:
    # "2 3" last occurred before at 1..2 and at 5..6; "1 2 3" at 0..2 only.
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, 4) == [9, 8, 2, 3]
    assert NgramIndex(1, 2).propose(tokens, 4) == [7, 1, 2, 3]  # the latest "2 3"
    assert NgramIndex(1, 3).propose(tokens, 2) == [9, 8]
    assert NgramIndex(2, 3).propose([5, 6, 7], 4) == []
    assert NgramIndex(1, 1).propose([4, 4], 3) == [4]


def test_a_growing_index_answers_as_a_fresh_one() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(30)]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 3) == NgramIndex(1, 3).propose(tokens[:end], 3)


def _decoding(clock, prompt: list[int], max_tokens: int, **kw):  # type: ignore[no-untyped-def]
    """A core whose one job has prefilled and sampled its first token."""
    core = make_core(clock, speculative=SPEC, **kw)
    job = make_job(len(prompt), max_tokens, prompt=prompt)
    job.speculate = True
    core.add(job)
    plan = core.schedule()
    core.complete(plan, StepResult(plan.step, [JobOutput(job.job_id, prompt[1])], 0.01))
    return core, job


def _run(core, plan: Plan, accept: int, token: int = 77) -> None:  # type: ignore[no-untyped-def]
    outs = [JobOutput(c.job_id, token, accepted=list(c.token_ids[-c.draft:][:accept])
                      if c.draft else []) for c in plan.chunks]
    core.complete(plan, StepResult(plan.step, outs, 0.01))
    core.blocks.check(core.jobs.values())


def test_drafts_come_from_the_text_and_only_accepted_ones_count(clock) -> None:
    # Prompt "5 6 7 8 5" then output 6: "5 6" occurred before, followed by 7 8 5 6.
    core, job = _decoding(clock, [5, 6, 7, 8, 5], 20, block_size=16)
    plan = core.schedule()
    (chunk,) = plan.chunks
    assert chunk.token_ids == [6, 7, 8, 5, 6] and chunk.draft == 4
    assert chunk.start_pos == 5 and chunk.num_known_tokens == 1
    _run(core, plan, accept=2)
    assert job.output_token_ids == [6, 7, 8, 77]
    assert job.num_computed_tokens == 5 + 1 + 2  # the decode token and two drafts
    assert (job.num_drafted, job.num_accepted) == (4, 2)
    nxt = core.schedule().chunks[0]
    assert nxt.start_pos == job.num_tokens - 1 and nxt.token_ids[0] == 77


def test_a_draft_run_keeps_within_blocks_length_and_budget(clock) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 5]
    # Block size 4: the job holds 2 blocks (8 slots); its 8th token is at
    # position 7, so no slot is left for a draft.
    core, _ = _decoding(clock, prompt, 20, block_size=4)
    assert core.schedule().chunks[0].draft == 0
    # max_tokens 3 with one output: one draft at most (it and one more token).
    core, _ = _decoding(clock, prompt, 3, block_size=16)
    assert core.schedule().chunks[0].draft == 1
    # max_model_len 10 with 8 tokens known: one draft.
    core, _ = _decoding(clock, prompt, 20, block_size=16, max_model_len=10)
    assert core.schedule().chunks[0].draft == 1
    # The plan's token budget: 8, of which another job's prefill takes 6.
    core, job = _decoding(clock, prompt, 20, block_size=16, max_batch_tokens=8)
    core.add(make_job(6, 4))
    plan = core.schedule()
    assert [(c.job_id == job.job_id, c.draft) for c in plan.chunks] == [(True, 1), (False, 0)]
    assert plan.num_tokens == 8


def test_no_drafts_for_a_job_that_cannot_verify_or_a_wide_batch(clock) -> None:
    core, job = _decoding(clock, [5, 6, 7, 8, 5], 20, block_size=8)
    job.speculate = False
    assert core.schedule().chunks[0].draft == 0
    core = make_core(clock, block_size=8, speculative={**SPEC, "max_batch": 1})
    jobs = [make_job(5, 20, prompt=[5, 6, 7, 8, 5]) for _ in range(2)]
    for j in jobs:
        j.speculate = True
        core.add(j)
    plan = core.schedule()
    core.complete(plan, StepResult(plan.step, [JobOutput(j.job_id, 6) for j in jobs], 0.01))
    assert [c.draft for c in core.schedule().chunks] == [0, 0]  # two decodes > max_batch


def test_a_job_ends_at_max_tokens_with_its_accepted_drafts(clock) -> None:
    core, job = _decoding(clock, [5, 6, 7, 8, 5], 4, block_size=8)
    plan = core.schedule()
    assert plan.chunks[0].draft == 2  # 1 output + 2 drafts + 1 = max_tokens
    _run(core, plan, accept=2)
    assert job.is_finished and job.finish_reason == "length"
    assert job.output_token_ids == [6, 7, 8, 77] and not core.has_work
    assert core.blocks.num_free == core.blocks.num_blocks


def test_a_prediction_is_walked_in_order_through_repeated_lines() -> None:
    from scheduler.speculation import PredictionDrafts

    # Two equal "lines" (1 2 3 9): after the first, the second is proposed.
    pred = [1, 2, 3, 9, 1, 2, 3, 9, 4]
    p = PredictionDrafts(pred, max_n=2)
    assert p.propose([], 3) == [1, 2, 3]
    assert p.propose([1, 2, 3], 2) == [9, 1]
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 4]
    # An edit: the answer wrote 7 where the prediction has 9; after a token
    # the prediction has again, its continuation is proposed.
    q = PredictionDrafts(pred, max_n=2)
    assert q.propose([1, 2, 3, 7], 2) == []
    assert q.propose([1, 2, 3, 7, 1], 2) == [2, 3]


def test_prediction_drafts_are_counted_apart(clock) -> None:
    core = make_core(clock, block_size=16, speculative=SPEC)
    job = make_job(3, 20, prompt=[40, 41, 42])
    job.speculate, job.prediction = True, [6, 7, 8, 9, 10]
    core.add(job)
    plan = core.schedule()
    core.complete(plan, StepResult(plan.step, [JobOutput(job.job_id, 6)], 0.01))
    plan = core.schedule()
    assert plan.chunks[0].token_ids == [6, 7, 8, 9, 10]  # the prediction after "6"
    _run(core, plan, accept=3)
    assert (job.num_prediction_drafted, job.num_prediction_accepted) == (4, 3)
    assert job.output_token_ids == [6, 7, 8, 9, 77]


def test_the_draft_length_follows_a_jobs_recent_acceptance() -> None:
    from scheduler.config import SpeculativeConfig
    from scheduler.speculation import draft_length, observe

    cfg = SpeculativeConfig(num_tokens=4, min_acceptance=0.25)
    job = make_job(3, 100)
    job.output_token_ids = [1]
    assert draft_length(job, cfg) == 4  # a new job: long runs
    lengths = []
    for _ in range(6):  # every draft refused
        observe(job, draft_length(job, cfg) or 1, 0)
        lengths.append(draft_length(job, cfg))
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
    job.output_token_ids = [1] * 8  # below one draft: a probe every 8th output
    assert draft_length(job, cfg) == 1
    for _ in range(8):  # accepted again
        observe(job, 4, 4)
    assert draft_length(job, cfg) == 4
    assert draft_length(job, SpeculativeConfig(num_tokens=3)) == 3  # the default: fixed
