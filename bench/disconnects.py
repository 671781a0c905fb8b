"""`python -m bench disconnects`: a storm of clients that hang up.

Opens `--streams` streaming requests at once, each with a long output
(max_tokens + ignore_eos), and drops every one of them at a random point:
a share right after the request is written (`--share-after-send`), a share
once the response has started but before its first token
(`--share-before-first`), the rest after a random number of streamed chunks
(1 to `--max-drop-chunks`; a chunk holds up to the server's
`stream_interval` tokens).  Then it waits for the server to go idle and
checks that every engine's free KV blocks, its host-tier blocks and the
host KV tier's used bytes are back to the values read before the storm
(bench/server_stats.py), and that a last short request still completes.

Exit status 1 if a request failed, anything leaked by `--idle-timeout`, or
the server no longer serves; the JSON result holds the before / after
figures and how many streams were dropped at each phase.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bench.checks import (
    IdleCheckedResult, add_check_output_args, finish_check, save_check, with_model,
)
from bench.cli_args import _add_live_args
from bench.client import ClientConfig, RequestVariant, run_requests
from bench.metrics import summarize
from bench.records import DROP_PHASES
from bench.server_stats import StatsSource, add_stats_args, idle_start, stats_source
from bench.workload import RequestSpec, filler_prompt

class DisconnectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    streams: int = Field(200, ge=1)
    input_len: int = Field(64, ge=1)
    output_len: int = Field(512, ge=2)
    share_after_send: float = Field(0.2, ge=0, le=1)
    share_before_first: float = Field(0.2, ge=0, le=1)
    # Mid-stream drops happen after 1 .. this many streamed chunks (so the
    # storm does not wait for long generations on a slow server).
    max_drop_chunks: int = Field(32, ge=1)
    seed: int = 0
    idle_timeout: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _shares(self) -> "DisconnectConfig":
        if self.share_after_send + self.share_before_first > 1:
            raise ValueError("--share-after-send + --share-before-first must be <= 1")
        return self


class DisconnectResult(IdleCheckedResult):
    kind: Literal["disconnects"] = "disconnects"
    config: DisconnectConfig
    planned: dict[str, int]
    # Where streams were actually dropped; a stream can also have ended
    # before its drop point (completed), been refused (429) or failed.
    dropped: dict[str, int]
    completed: int
    rejected: int
    failed: int
    errors_by_kind: dict[str, int]


def plan_drops(dc: DisconnectConfig) -> tuple[list[RequestSpec], dict[str, RequestVariant]]:
    """The requests (all at t = 0) and where each one hangs up."""
    rng = np.random.default_rng(dc.seed)
    u = rng.random(dc.streams)
    top = min(dc.max_drop_chunks, dc.output_len - 1)
    chunks = rng.integers(1, top + 1, size=dc.streams)
    prompt = filler_prompt(dc.input_len)
    reqs: list[RequestSpec] = []
    variants: dict[str, RequestVariant] = {}
    for i in range(dc.streams):
        rid = f"drop-{i}"
        reqs.append(RequestSpec(request_id=rid, arrival_time=0.0, prompt=prompt,
                                prompt_tokens=dc.input_len, output_tokens=dc.output_len))
        if u[i] < dc.share_after_send:
            variants[rid] = RequestVariant(drop="after_send")
        elif u[i] < dc.share_after_send + dc.share_before_first:
            variants[rid] = RequestVariant(drop="before_first_chunk")
        else:
            variants[rid] = RequestVariant(drop="mid_stream", drop_after_chunks=int(chunks[i]))
    return reqs, variants


def run_disconnects(dc: DisconnectConfig, cfg: ClientConfig,
                    stats: StatsSource | None) -> DisconnectResult:
    cfg = with_model(cfg)
    problems: list[str] = []
    before = idle_start(stats, dc.idle_timeout, "storm")
    if before is not None:
        tier = ("not reported" if before.host_used_bytes is None
                else f"{before.host_used_bytes} bytes used")
        print(f"idle before: {before.num_blocks - before.used_blocks}/{before.num_blocks} "
              f"blocks free on {len(before.engines)} engine(s); host tier {tier}", flush=True)
    reqs, variants = plan_drops(dc)
    live = run_requests(reqs, cfg, variants)
    s = summarize(live.records)
    planned = {p: sum(v.drop == p for v in variants.values()) for p in DROP_PHASES}
    dropped = {p: sum(r.dropped == p for r in live.records) for p in DROP_PHASES}
    print(f"{len(reqs)} streams: dropped {dropped}, {s.num_completed} completed before "
          f"their drop point, {s.num_rejected} rejected, {s.num_failed} failed", flush=True)
    if s.num_failed:
        problems.append(f"{s.num_failed} requests failed: {s.errors_by_kind}")
    kv, health = finish_check(cfg, stats, before, dc.idle_timeout, problems)
    return DisconnectResult(
        base_url=cfg.base_url, model=cfg.model or "", config=dc, planned=planned,
        dropped=dropped, completed=s.num_completed, rejected=s.num_rejected,
        failed=s.num_failed, errors_by_kind=s.errors_by_kind, kv=kv,
        health_check_error=health, problems=problems, records=live.records,
    )


def format_disconnects(r: DisconnectResult) -> str:
    lines = [f"planned drops {r.planned}", f"dropped       {r.dropped}",
             f"completed {r.completed}, rejected (429) {r.rejected}, failed {r.failed} "
             f"{r.errors_by_kind or ''}"]
    if r.kv is not None:
        b, a = r.kv.before, r.kv.after
        lines.append(f"KV blocks free: before {b.num_blocks - b.used_blocks}/{b.num_blocks}, "
                     f"after {a.num_blocks - a.used_blocks}/{a.num_blocks} "
                     f"(waited {r.kv.waited_s:.1f} s)")
        lines.append(f"host-tier blocks: before {b.host_used_blocks}, after {a.host_used_blocks}; "
                     f"host tier bytes: before {b.host_used_bytes}, after {a.host_used_bytes}")
    else:
        lines.append("no server stats: leak check skipped")
    lines.append(f"health check: {'ok' if r.health_check_error is None else r.health_check_error}")
    lines += [f"PROBLEM: {p}" for p in r.problems]
    lines.append("OK: nothing leaked" if r.ok else "FAILED")
    return "\n".join(lines)


def cmd_disconnects(a: argparse.Namespace) -> int:
    from bench.cli_workload import _client_config

    dc = DisconnectConfig(streams=a.streams, input_len=a.input_len, output_len=a.output_len,
                          share_after_send=a.share_after_send,
                          share_before_first=a.share_before_first,
                          max_drop_chunks=a.max_drop_chunks, seed=a.seed,
                          idle_timeout=a.idle_timeout)
    res = run_disconnects(dc, _client_config(a), stats_source(a))
    print(format_disconnects(res))
    save_check(res, a.out, a.save_records)
    return 0 if res.ok else 1


def add_disconnects_parser(sub: Any) -> None:
    q = sub.add_parser("disconnects", help="open many streams, drop them all; check that the "
                                           "server frees every KV block")
    _add_live_args(q)
    add_stats_args(q)
    g = q.add_argument_group("disconnect storm")
    g.add_argument("--streams", type=int, default=200, help="streams opened at once")
    g.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=512, help="max_tokens (with ignore_eos)")
    g.add_argument("--share-after-send", type=float, default=0.2,
                   help="share dropped right after the request is written")
    g.add_argument("--share-before-first", type=float, default=0.2,
                   help="share dropped after the response starts, before the first token")
    g.add_argument("--max-drop-chunks", type=int, default=32,
                   help="the rest drop after 1 .. this many streamed chunks (a chunk holds `stream_interval` tokens)")
    g.add_argument("--seed", type=int, default=0)
    add_check_output_args(q, idle_timeout=60.0)
    q.set_defaults(func=cmd_disconnects)
