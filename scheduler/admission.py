"""Admission control: refuse a request that would miss its TTFT objective.

A request that would wait past the TTFT objective is better refused at once
(429 with Retry-After) than admitted to a queue that makes it, and everyone
behind it, late.  Under FCFS with a full batch, a job reaches the batch once
the jobs ahead of it have run: a replica that computes `mu` tokens/s starts
it after about (queued tokens ahead) / mu seconds.  So the default bound on
queued work is `ttft_slo_s * mu`, with `mu` the replica's measured
throughput when its batch is full.  Policies that let new jobs overtake
(MLFQ) only start them sooner; the bound is conservative for them.

Queued work counts the tokens still to compute of jobs outside the running
batch (the latest plan's): their uncomputed prompt (or recomputation) plus
their expected remaining output: the predictor's estimate when it has
landed, otherwise the replica's mean output length, less what they
generated, but at least `OUTRUN_SHARE` of it (answer lengths are
heavy-tailed: a job past its expected length is not about to end), never
more than `max_tokens` allows.  Counting such a job as having nothing left
admitted, under MLFQ in a 5x overload, requests whose TPOT then averaged
142 ms against 63 ms with the floor (studies/admission_mlfq).  Outside the
batch, not "never started": under MLFQ most jobs have started and wait
preempted in lower queues.  A replica with nothing queued admits any
request, however large, so that no request is refused forever.

What a newcomer waits for first is prefill, not output: a replica with a
free batch slot starts its prompt at the next iteration, chunked beside the
prompts already there and the running decodes.  So where the replica
reports its prefill load (`PrefillLoad`: prompt tokens still to compute,
decodes, batch limits, its iteration cost model and how far real iterations
run over that model), the decision is an estimate of the newcomer's TTFT
(`ttft_estimate`): the iterations its prompt and every prompt token ahead
of it need at the batch's token budget, each costing the model's time for
the decodes riding along; plus, when the batch has no free slot, the
queued output work above at the measured speed.  Under skip-join MLFQ that
last term counts only what a newcomer would really wait for: the jobs in
the queue it joins and above, and only while they fill the batch, each
until it is demoted below it (scheduler/policies/mlfq_admission.py;
`admission.per_queue_wait`, off by default); the work queued in lower queues
does not delay its first token.  The request is
admitted when the estimate is within `ttft_slo_s`, or when nothing is ahead
of it (no prompt to compute, a free slot): a prompt whose own prefill
exceeds the objective then still starts at once, and is refused only while
it would wait.  A fixed `max_queued_tokens` keeps the plain token bound.

That queued work still has to be served: under MLFQ a replica that admits
every newcomer in sustained overload keeps first tokens fast while the jobs
demoted below them wait longer and longer for their next tokens.  So with
the per-queue wait, a replica also takes nothing more while its queued work
outside the batch would take over `max_backlog_s` at the measured speed
(unless it has none).  Measured (studies/admission_mlfq): bursts that the
FCFS reading refused in part were served whole, but in a 5x overload the
admitted requests' TPOT was worse than under the FCFS reading (mean 105
against 63 ms with 10 s of backlog): the demoted jobs wait through the
queued work it lets a replica hold.  Hence the FCFS reading stays the
default.

Under co-serving (`policy: conserve`) offline work is neither bounded nor
counted: it has no TTFT objective, and every online job runs ahead of it
(ConServe §4.2), so a backlog of batch work delays no online request.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from scheduler.cost import LinearCost
from scheduler.job import Job, JobClass

if TYPE_CHECKING:
    from scheduler.policies.mlfq_admission import NewcomerLevel


@dataclass(frozen=True)
class AdmissionBound:
    ttft_slo_s: float
    # Fixed bound per replica; None: derived from the measured throughput.
    max_queued_tokens: int | None = None
    # With the TTFT estimate and the policy's levels: queued work outside
    # the batch, at the measured speed, past which nothing more is admitted
    # (see the module's text); None: no such bound, no levels reported.
    max_backlog_s: float | None = None

    def capacity(self, tokens_per_s: float | None) -> float:
        """Queued tokens a replica computing `tokens_per_s` may hold."""
        if self.max_queued_tokens is not None:
            return float(self.max_queued_tokens)
        if not tokens_per_s:
            return math.inf  # not measured yet: nothing to bound by
        return self.ttft_slo_s * tokens_per_s


def bounded(job_class: str, policy: str) -> bool:
    """Whether a job of `job_class` is subject to the bound, and counts in
    queued work, under `policy`."""
    return not (policy == "conserve" and job_class == JobClass.OFFLINE.value)


# What a job that has generated as many tokens as its expected answer
# length still has to generate, as a share of that length: past the mean,
# the mean remaining ShareGPT answer stays 0.58-0.65 of the mean answer
# (bench's pool, 15,358 answers, mean 336: 218 tokens left past 300, 212
# past 400, 196 past 500), where "expected less generated" says none.
OUTRUN_SHARE = 0.6


def remaining_output(job: Job, mean_output_len: float) -> float:
    """Output tokens `job` is expected to still generate: its expected
    answer length (the predictor's estimate, else the replica's mean) less
    what it generated, but at least `OUTRUN_SHARE` of that length, and never
    past `max_tokens`."""
    guess = job.predicted_output_len if job.predicted_output_len is not None else mean_output_len
    done = job.num_output_tokens
    return max(0.0, min(float(job.max_tokens) - done,
                        max(guess - done, OUTRUN_SHARE * guess)))


def queued_work(jobs: Iterable[Job], batch: Collection[str], mean_output_len: float) -> int:
    """Tokens still to compute for the jobs outside the running `batch`."""
    total = 0.0
    for job in jobs:
        if job.job_id in batch:
            continue
        total += job.num_uncomputed_tokens + remaining_output(job, mean_output_len)
    return int(total)


def request_work(prompt_tokens: int, max_tokens: int, n: int, mean_output_len: float) -> int:
    """Expected tokens of a new request of `n` choices."""
    return prompt_tokens + int(n * min(float(max_tokens), mean_output_len))


@dataclass(frozen=True)
class PrefillLoad:
    """A replica's load as a newcomer's first token sees it (bounded jobs)."""

    # Prompt tokens (and recomputation after a preemption) still to compute.
    prefill_tokens: int
    # Jobs past their prompt: each takes a token of every iteration.
    decodes: int
    jobs: int
    max_batch_size: int
    max_batch_tokens: int
    # The replica's iteration cost model (scheduler/cost.py, LinearCost).
    base_s: float
    per_token_s: float
    per_seq_s: float
    # Measured iteration time over the model's, for iterations with prompt
    # tokens (the model is fitted on an idle replica at start).
    slowdown: float = 1.0


def prefill_load(jobs: Iterable[Job], cfg_batch_size: int, cfg_batch_tokens: int,
                 cost: LinearCost, slowdown: float = 1.0) -> PrefillLoad:
    prefill = decodes = count = 0
    for job in jobs:
        count += 1
        if job.num_output_tokens:
            decodes += 1
            # The last sampled token is the next decode's input, not prefill.
            prefill += max(0, job.num_uncomputed_tokens - 1)
        else:
            prefill += job.num_uncomputed_tokens
    return PrefillLoad(prefill, decodes, count, cfg_batch_size, cfg_batch_tokens,
                       cost.base_s, cost.prefill_per_token_s, cost.decode_per_seq_s,
                       slowdown)


def ttft_estimate(load: PrefillLoad, prompt_tokens: int, ahead_tokens: int = 0,
                  extra_jobs: int = 0) -> float:
    """Seconds until a newcomer's prompt of `prompt_tokens` is computed,
    with `ahead_tokens` more prompt tokens and `extra_jobs` more jobs placed
    since `load` was reported.  The slot wait is the caller's."""
    d = min(load.decodes + extra_jobs, load.max_batch_size - 1)
    room = max(1, load.max_batch_tokens - d)
    total = load.prefill_tokens + ahead_tokens + prompt_tokens
    iterations = -(-total // room)
    per_iteration = load.base_s + load.per_seq_s * d
    # One more iteration: the one under way when the request lands.
    return load.slowdown * ((iterations + 1) * per_iteration + load.per_token_s * total)


class MeanOutput:
    """Running mean of finished jobs' output lengths (exponential, so it
    follows a workload that changes)."""

    def __init__(self, initial: float, weight: float = 0.05) -> None:
        self.value = initial
        self.weight = weight
        self.samples = 0

    def add(self, num_tokens: int) -> None:
        # The first samples replace the prior faster than the EWMA would.
        w = max(self.weight, 1.0 / (self.samples + 1))
        self.value += w * (num_tokens - self.value)
        self.samples += 1


def load_report(jobs: list[Job], batch: Collection[str], mean_output_len: float,
                tokens_per_s: float | None, bound: AdmissionBound,
                max_batch_size: int, max_batch_tokens: int,
                cost: LinearCost | None = None, slowdown: float = 1.0,
                levels: list[NewcomerLevel] | None = None) -> dict[str, Any]:
    """What a replica reports for admission (the keyword arguments of
    `Placement.report`), over its bounded `jobs`; the TTFT estimate's
    figures only when it has a cost model and no fixed bound is set, with
    the policy's `levels` (`Policy.newcomer_levels`) where it has them."""
    out: dict[str, Any] = {
        "waiting_tokens": queued_work(jobs, batch, mean_output_len),
        "capacity_tokens": bound.capacity(tokens_per_s),
        "tokens_per_s": tokens_per_s, "mean_output_len": mean_output_len}
    if cost is not None and bound.max_queued_tokens is None:
        out["prefill"] = asdict(prefill_load(jobs, max_batch_size, max_batch_tokens, cost,
                                             slowdown))
        out["ttft_slo_s"] = bound.ttft_slo_s
        if levels and bound.max_backlog_s is not None:
            out["levels"] = [[lv.max_prompt_tokens, lv.jobs, lv.ahead_tokens] for lv in levels]
            if tokens_per_s:
                out["backlog_capacity_tokens"] = bound.max_backlog_s * tokens_per_s
    return out
