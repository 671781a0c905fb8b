"""`python -m bench transparency`: does sharing the server change a request's tokens?

A preemptive scheduler stops a running job whenever another needs its batch
slot or its KV blocks (FastServe §4.2), and the job resumes later from KV
swapped back in or recomputed.  What a client is promised is that none of
this shows: a request's tokens are the ones it would have got alone.  This
check sends `--probes` requests one at a time, each greedy or seeded, and
keeps their generated token ids (`return_token_ids`); then sends them all
again, arriving over `--probe-spread` seconds, beside `--disruptors` long
streams that crowd the batch and the KV cache (a share of them hanging up
mid-stream), and compares each probe's tokens with its lone run, token by token; with
`--shared-prefix` every probe's prompt begins the same way, so that probes
hold the same cached blocks while others are preempted.  The server
says how often each probe was preempted (`metrics.num_preemptions`): a run
in which none was says nothing about preemption (`--require-preemption`
makes that a failure).  Afterwards every KV block and host-tier byte must
be back (`bench/server_stats.py`) and a last request must complete.

Deterministic mode guarantees identical tokens (README, "Deterministic
mode"); without it the requests sharing an iteration can change a logit's
last bits, in bfloat16 above all, and with them a token.  The result names
each engine replica's dtype and mode where the server's stats can be read.

Exit status 1 on a differing probe, a failed request, a leak or a server
that no longer serves.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.checks import (
    IdleCheckedResult, add_check_output_args, finish_check, save_check, with_model,
)
from bench.cli_args import _add_live_args
from bench.client import ClientConfig, RequestVariant, run_requests
from bench.metrics import summarize
from bench.server_stats import StatsSource, add_stats_args, idle_start, stats_source
from bench.workload import RequestSpec, filler_prompt


class TransparencyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    probes: int = Field(16, ge=1)
    probe_min_input: int = Field(16, ge=1)
    probe_max_input: int = Field(256, ge=1)
    probe_output_len: int = Field(64, ge=1)
    # Tokens every probe's prompt begins with: their KV found in the prefix
    # cache and shared by the probes that hold it while others are preempted.
    shared_prefix: int = Field(0, ge=0)
    # Probes drawn at this temperature, each with its own seed; the rest greedy.
    sampled_share: float = Field(0.5, ge=0, le=1)
    sampled_temperature: float = Field(0.8, gt=0, le=2)
    # The shared run's probes arrive evenly over this many seconds, so that
    # later ones arrive while earlier ones run (and may preempt them).
    probe_spread_s: float = Field(1.0, ge=0)
    disruptors: int = Field(16, ge=0)
    disruptor_input_len: int = Field(256, ge=1)
    disruptor_output_len: int = Field(256, ge=2)
    # Share of disruptors that hang up after 1 .. output_len / 2 tokens.
    drop_share: float = Field(0.5, ge=0, le=1)
    require_preemption: bool = False
    seed: int = 0
    idle_timeout: float = Field(60.0, gt=0)


class ProbeOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str
    prompt_tokens: int
    temperature: float
    seed: int | None
    alone_tokens: int
    shared_tokens: int
    # Index of the first generated token that differs (the shorter length
    # where one run's tokens are a prefix of the other's); None: identical.
    first_difference: int | None
    # The server's counts for the shared run (None where it does not say).
    preemptions: int | None
    cached_tokens: int | None


class TransparencyResult(IdleCheckedResult):
    kind: Literal["transparency"] = "transparency"
    config: TransparencyConfig
    probes: list[ProbeOutcome]
    identical: int
    differing: int
    preempted_probes: int
    probe_preemptions: int
    probe_cached_tokens: int
    disruptors_dropped: int
    failed: int
    errors_by_kind: dict[str, int]
    # Per engine replica, where the server's stats were read: its dtype and
    # whether it runs in deterministic mode.
    engines: list[dict[str, Any]] = Field(default_factory=list)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token sequences first disagree; None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def plan_probes(tc: TransparencyConfig) -> tuple[list[RequestSpec], dict[str, RequestVariant]]:
    """The probes (arrival times for the shared run) and their sampling:
    distinct prompts (past the shared prefix, if any), greedy or seeded."""
    if tc.probe_max_input < tc.probe_min_input:
        raise ValueError("--probe-max-input must be at least --probe-min-input")
    rng = np.random.default_rng(tc.seed)
    lens = rng.integers(tc.probe_min_input, tc.probe_max_input + 1, size=tc.probes)
    sampled = rng.random(tc.probes) < tc.sampled_share
    seeds = rng.integers(0, 2**31 - 1, size=tc.probes)
    prefix = filler_prompt(tc.shared_prefix) + " " if tc.shared_prefix else ""
    reqs: list[RequestSpec] = []
    variants: dict[str, RequestVariant] = {}
    for i in range(tc.probes):
        rid = f"probe-{i}"
        at = tc.probe_spread_s * i / tc.probes
        reqs.append(RequestSpec(request_id=rid, arrival_time=at,
                                prompt=prefix + filler_prompt(int(lens[i]), salt=i),
                                prompt_tokens=tc.shared_prefix + int(lens[i]),
                                output_tokens=tc.probe_output_len))
        extra: dict[str, Any] = {"return_token_ids": True, "temperature": 0.0}
        if sampled[i]:
            extra.update(temperature=tc.sampled_temperature, seed=int(seeds[i]))
        variants[rid] = RequestVariant(extra_body=extra)
    return reqs, variants


def plan_disruptors(tc: TransparencyConfig) -> tuple[list[RequestSpec], dict[str, RequestVariant]]:
    """Long streams, all at the start of the shared run; a share hang up."""
    rng = np.random.default_rng(tc.seed + 1)
    drops = rng.random(tc.disruptors) < tc.drop_share
    after = rng.integers(1, max(tc.disruptor_output_len // 2, 1) + 1, size=tc.disruptors)
    reqs: list[RequestSpec] = []
    variants: dict[str, RequestVariant] = {}
    for i in range(tc.disruptors):
        rid = f"disruptor-{i}"
        reqs.append(RequestSpec(request_id=rid, arrival_time=0.0,
                                prompt=filler_prompt(tc.disruptor_input_len, salt=10_000 + i),
                                prompt_tokens=tc.disruptor_input_len,
                                output_tokens=tc.disruptor_output_len))
        if drops[i]:
            variants[rid] = RequestVariant(drop="mid_stream", drop_after_chunks=int(after[i]))
    return reqs, variants


def _engine_modes(stats: StatsSource | None) -> list[dict[str, Any]]:
    if stats is None:
        return []
    out = []
    for s in stats.engines():
        eng = s.get("engine") or {}
        out.append({"replica": s.get("replica"), "dtype": eng.get("dtype"),
                    "deterministic": eng.get("deterministic")})
    return out


def run_transparency(tc: TransparencyConfig, cfg: ClientConfig,
                     stats: StatsSource | None) -> TransparencyResult:
    # Refused requests are sent again after their Retry-After: admission
    # control is not what this checks.
    cfg = with_model(cfg).model_copy(update={"retry_rejected": True})
    problems: list[str] = []
    before = idle_start(stats, tc.idle_timeout, "the probes")
    probes, probe_variants = plan_probes(tc)
    at_once = [p.model_copy(update={"arrival_time": 0.0}) for p in probes]
    alone = run_requests(at_once, cfg.model_copy(update={"max_concurrency": 1}),
                         probe_variants).records
    print(f"{len(alone)} probes alone: "
          f"{sum(r.ok for r in alone)} completed", flush=True)
    disruptors, disruptor_variants = plan_disruptors(tc)
    shared = run_requests(disruptors + probes, cfg,
                          {**probe_variants, **disruptor_variants}).records
    by_id = {r.request_id: r for r in shared}
    outcomes: list[ProbeOutcome] = []
    unfinished: list[str] = []
    for spec, lone in zip(probes, alone):
        other = by_id[spec.request_id]
        extra = probe_variants[spec.request_id].extra_body
        if not (lone.ok and other.ok):
            unfinished.append(spec.request_id)
            continue
        if lone.token_ids is None or other.token_ids is None:
            problems.append(f"{spec.request_id}: the server returned no token ids "
                            "(`return_token_ids`)")
            continue
        outcomes.append(ProbeOutcome(
            request_id=spec.request_id, prompt_tokens=spec.prompt_tokens,
            temperature=extra["temperature"], seed=extra.get("seed"),
            alone_tokens=len(lone.token_ids), shared_tokens=len(other.token_ids),
            first_difference=first_difference(lone.token_ids, other.token_ids),
            preemptions=other.num_preemptions, cached_tokens=other.cached_tokens))
    if unfinished:
        problems.append(f"probes not served to the end in both runs: {', '.join(unfinished)}")
    s = summarize(alone + shared)
    if s.num_failed:
        problems.append(f"{s.num_failed} requests failed: {s.errors_by_kind}")
    differing = [o for o in outcomes if o.first_difference is not None]
    for o in differing:
        problems.append(f"{o.request_id} (temperature {o.temperature}) differs from its lone "
                        f"run at generated token {o.first_difference}")
    preempted = sum(1 for o in outcomes if o.preemptions)
    if tc.require_preemption and not preempted:
        problems.append("no probe was preempted in the shared run")
    engines = _engine_modes(stats)
    kv, health = finish_check(cfg, stats, before, tc.idle_timeout, problems)
    return TransparencyResult(
        base_url=cfg.base_url, model=cfg.model or "", config=tc, probes=outcomes,
        identical=len(outcomes) - len(differing), differing=len(differing),
        preempted_probes=preempted,
        probe_preemptions=sum(o.preemptions or 0 for o in outcomes),
        probe_cached_tokens=sum(o.cached_tokens or 0 for o in outcomes),
        disruptors_dropped=sum(1 for r in shared if r.dropped is not None),
        failed=s.num_failed, errors_by_kind=s.errors_by_kind, engines=engines, kv=kv,
        health_check_error=health, problems=problems, records=alone + shared,
    )


def format_transparency(r: TransparencyResult) -> str:
    sampled = sum(1 for o in r.probes if o.seed is not None)
    lines = [f"probes compared {len(r.probes)} ({sampled} seeded at temperature "
             f"{r.config.sampled_temperature}, the rest greedy): {r.identical} identical, "
             f"{r.differing} differing",
             f"in the shared run: {r.preempted_probes} probes preempted "
             f"({r.probe_preemptions} preemptions), {r.probe_cached_tokens} of their prompt "
             f"tokens found cached",
             f"disruptors {r.config.disruptors}, {r.disruptors_dropped} hung up; failed "
             f"{r.failed} {r.errors_by_kind or ''}"]
    for e in r.engines:
        lines.append(f"engine {e['replica']}: dtype {e['dtype']}, "
                     f"deterministic {e['deterministic']}")
    if not r.preempted_probes:
        lines.append("no probe was preempted: this run says nothing about preemption "
                     "(more --disruptors, or a smaller KV cache)")
    if r.kv is not None:
        lines.append(f"KV back to idle: {'yes' if not r.kv.problems else 'no'} "
                     f"(waited {r.kv.waited_s:.1f} s)")
    else:
        lines.append("no server stats: leak check and engine modes skipped")
    lines.append(f"health check: {'ok' if r.health_check_error is None else r.health_check_error}")
    lines += [f"PROBLEM: {p}" for p in r.problems]
    lines.append("OK: every probe's tokens as alone" if r.ok else "FAILED")
    return "\n".join(lines)


def cmd_transparency(a: argparse.Namespace) -> int:
    from bench.cli_workload import _client_config

    # Every field of the config has its option, under the field's name.
    tc = TransparencyConfig(**{f: getattr(a, f) for f in TransparencyConfig.model_fields})
    res = run_transparency(tc, _client_config(a), stats_source(a))
    print(format_transparency(res))
    save_check(res, a.out, a.save_records)
    return 0 if res.ok else 1


def add_transparency_parser(sub: Any) -> None:
    q = sub.add_parser("transparency", help="probes alone, then beside long streams: the same "
                                            "tokens, preempted or not")
    _add_live_args(q)
    add_stats_args(q)
    d = TransparencyConfig()  # the defaults, from the config alone
    g = q.add_argument_group("probes and disruptors")
    g.add_argument("--probes", type=int, default=d.probes)
    g.add_argument("--probe-min-input", type=int, default=d.probe_min_input,
                   help="prompt tokens, at least")
    g.add_argument("--probe-max-input", type=int, default=d.probe_max_input,
                   help="prompt tokens, at most")
    g.add_argument("--probe-output-len", type=int, default=d.probe_output_len,
                   help="max_tokens of a probe")
    g.add_argument("--shared-prefix", type=int, default=d.shared_prefix,
                   help="tokens every probe's prompt begins with (found in the prefix cache)")
    g.add_argument("--sampled-share", type=float, default=d.sampled_share,
                   help="share of probes sampled with a seed of their own (the rest greedy)")
    g.add_argument("--sampled-temperature", type=float, default=d.sampled_temperature)
    g.add_argument("--probe-spread", dest="probe_spread_s", type=float,
                   default=d.probe_spread_s,
                   help="seconds over which the shared run's probes arrive")
    g.add_argument("--disruptors", type=int, default=d.disruptors,
                   help="long streams beside the probes")
    g.add_argument("--disruptor-input-len", type=int, default=d.disruptor_input_len)
    g.add_argument("--disruptor-output-len", type=int, default=d.disruptor_output_len)
    g.add_argument("--drop-share", type=float, default=d.drop_share,
                   help="share of disruptors that hang up mid-stream")
    g.add_argument("--require-preemption", action="store_true",
                   help="fail if no probe was preempted in the shared run")
    g.add_argument("--seed", type=int, default=d.seed)
    add_check_output_args(q, idle_timeout=d.idle_timeout)
    q.set_defaults(func=cmd_transparency)
