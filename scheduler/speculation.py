"""Draft tokens for speculative decoding, looked up in the job's own text
(prompt lookup decoding, Saxena 2023; vLLM's `ngram` method).

An answer often repeats what its prompt or its own earlier text holds (code
being edited, a quoted passage, a list).  The longest n-gram that ends the
job's tokens (`max_ngram` down to `min_ngram`) is looked up where it last
occurred before, and the tokens that followed it there are the drafts.
The engine checks them in the job's decode pass (engine/speculative.py):
each draft is accepted while it is the token the model picks before it,
and the pass yields the accepted drafts and one token more (the model's
own where a draft was refused), so a step yields 1 to k + 1 tokens for the
cost of one pass over k + 1 rows.

A request with a prediction of its answer (OpenAI's Predicted Outputs)
takes its drafts from the prediction first (`PredictionDrafts`).

With `min_acceptance` > 0, how many drafts a job gets adapts to how many
of its drafts were accepted lately (`draft_length`): refused drafts cost
rows for nothing, and an answer that departs from its text (or a random
request at a high temperature) refuses most.  With the default, 0, a job
is always worth `num_tokens` drafts.

`add_drafts` extends the decode chunks of a plan the policy made, within
what the job already holds: its allocated blocks (no block is allocated
for a draft, so memory accounting and preemption are untouched),
`max_tokens`, `max_model_len` and the plan's token budget; and only while
the plan decodes at most `max_batch` jobs.  A draft's KV is computed but
counted (`num_computed_tokens`) only if accepted; the rest is overwritten
by the tokens that follow.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.config import SpeculativeConfig
from scheduler.job import Job
from scheduler.plan import Plan


class NgramIndex:
    """Where each n-gram of a job's tokens last ended, kept up to date as
    the tokens grow, so a lookup costs a few dictionary reads."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        # n-grams ending at positions up to this one are indexed.
        self.upto = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest n-gram ending
        `tokens` where it last occurred before; [] if none did."""
        end = len(tokens)
        # Index the n-grams ending before the last position: the one ending
        # there is the suffix being looked up.
        for e in range(self.upto + 1, end):
            for n, ends in self.ends.items():
                if e >= n:
                    ends[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end - 1)
        for n in self.sizes:
            if end > n:
                at = self.ends[n].get(tuple(tokens[end - n:]))
                if at is not None:
                    return tokens[at:at + limit]
        return []


class PredictionDrafts:
    """Drafts from a prediction of the answer (OpenAI's Predicted Outputs):
    an answer that edits a text mostly repeats it, so where the answer's
    last n tokens (`max_n` down to 1) occur in the prediction, what follows
    them there is proposed; an empty answer gets the prediction's start.
    Of several occurrences the one nearest where the answer should be by now
    wins (the last match moved on by the tokens written since), so the
    lookup walks the prediction in order through repeated lines."""

    def __init__(self, prediction: list[int], max_n: int) -> None:
        self.prediction = prediction
        self.sizes = range(max_n, 0, -1)
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        for n in self.sizes:
            for e in range(n, len(prediction) + 1):
                self.ends[n].setdefault(tuple(prediction[e - n:e]), []).append(e)
        # (place in the prediction, answer length) of the last match.
        self.anchor = (0, 0)

    def propose(self, output: list[int], limit: int) -> list[int]:
        if not output:
            return self.prediction[:limit]
        place, length = self.anchor
        expected = place + len(output) - length
        for n in self.sizes:
            if len(output) < n:
                continue
            ends = self.ends[n].get(tuple(output[-n:]))
            if ends:
                at = min(ends, key=lambda e: (abs(e - expected), -e))
                self.anchor = (at, len(output))
                return self.prediction[at:at + limit]
        return []


def _propose(job: Job, cfg: SpeculativeConfig, limit: int) -> list[int]:
    """Drafts for `job`: from its prediction if it has one that offers
    some, else from its own text."""
    job.predicted_drafts = False
    if job.prediction:
        source = job.drafts
        if not isinstance(source, tuple):
            source = job.drafts = (PredictionDrafts(job.prediction, cfg.max_ngram),
                                   NgramIndex(cfg.min_ngram, cfg.max_ngram))
        drafts = source[0].propose(job.output_token_ids, limit)
        if drafts:
            job.predicted_drafts = True
            return drafts
        index = source[1]
    else:
        index = job.drafts
        if not isinstance(index, NgramIndex):
            index = job.drafts = NgramIndex(cfg.min_ngram, cfg.max_ngram)
    return index.propose(job.prompt_token_ids + job.output_token_ids, limit)


# Weight of a job's earlier draft outcomes against the latest step's.
_DECAY = 0.8
# A job whose acceptance is too low for one draft tries one every this many
# outputs, so that its rate can recover.
_PROBE_EVERY = 8


def observe(job: Job, drafted: int, accepted: int) -> None:
    """A step verified `drafted` drafts of `job` and accepted `accepted`:
    that many successes, and a failure if the run stopped short."""
    job.draft_hits = _DECAY * job.draft_hits + accepted
    job.draft_misses = _DECAY * job.draft_misses + (accepted < drafted)


def draft_length(job: Job, cfg: SpeculativeConfig) -> int:
    """How many drafts `job` is worth now (adaptive length): the largest n
    up to `num_tokens` whose chance of all being accepted, a^n with a the
    job's recent acceptance rate, is at least `min_acceptance`.  A new job
    is taken to accept 4 drafts in 5 (`Job.draft_hits`, `draft_misses`,
    which fade as its own outcomes come), so it starts with long runs."""
    k, floor = cfg.num_tokens, cfg.min_acceptance
    if floor <= 0.0:
        return k
    rate = job.draft_hits / (job.draft_hits + job.draft_misses)
    n, chance = 0, rate
    while n < k and chance >= floor:
        n, chance = n + 1, chance * rate
    if n == 0 and job.num_output_tokens % _PROBE_EVERY == 0:
        return 1
    return n


def add_drafts(plan: Plan, jobs: Mapping[str, Job], cfg: SpeculativeConfig, block_size: int,
               max_model_len: int, max_batch_tokens: int) -> int:
    """Extend `plan`'s decode chunks of speculating jobs with drafts;
    returns how many were added."""
    k = cfg.num_tokens
    decodes = [c for c in plan.chunks if c.is_decode]
    if not k or not decodes or len(decodes) > cfg.max_batch:
        return 0
    budget = max_batch_tokens - plan.num_tokens
    added = 0
    for chunk in decodes:
        job = jobs.get(chunk.job_id)
        if job is None or not job.speculate or budget <= 0:
            continue
        known = job.num_tokens  # the chunk's token is the last of them
        limit = min(draft_length(job, cfg), budget,
                    len(chunk.block_table) * block_size - known,
                    job.max_tokens - job.num_output_tokens - 1,
                    max_model_len - known - 1)
        if limit <= 0:
            continue
        drafts = _propose(job, cfg, limit)
        if not drafts:
            continue
        chunk.token_ids = chunk.token_ids + drafts
        chunk.draft = len(drafts)
        job.num_drafted += len(drafts)
        if job.predicted_drafts:
            job.num_prediction_drafted += len(drafts)
        budget -= len(drafts)
        added += len(drafts)
    return added
