"""What a simulated replay takes from a live run's records (`bench simulate
--workload-spec RUN.json` with `--predictions-from` / `--lengths-from`):
each request's response-length prediction and when it landed, and each
answer's own length where it ended by itself below its cap.  The workload
itself (prompts drawn, arrival times) is rebuilt from the run's spec, so
the requests are matched by id."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.records import RequestRecord
from bench.results import RunResult, load_result
from bench.workload import RequestSpec, Workload


def _records(run_path: Path, wl: Workload) -> tuple[RunResult, dict[str, RequestRecord]]:
    run = load_result(run_path)
    if not isinstance(run, RunResult) or not run.records:
        raise SystemExit(f"{run_path}: not a run with its records (bench run --save-records)")
    recs = {r.request_id: r for r in run.records}
    if not recs.keys() & {r.request_id for r in wl.requests}:
        raise SystemExit(f"{run_path}: none of its requests are in this workload")
    return run, recs


def with_recorded_predictions(wl: Workload, run_path: Path) -> Workload:
    """`wl` with each request's response-length prediction as the live run
    at `run_path` recorded it (None where it recorded none).  The simulator
    gives a job its prediction that long after its arrival where the run
    recorded when it landed (`prediction_delay_s`), else on arrival."""
    _, recs = _records(run_path, wl)

    def pred(r: RequestSpec) -> dict[str, Any]:
        rec = recs.get(r.request_id)
        if rec is None:
            return {"predicted_output_tokens": None, "prediction_delay_s": None}
        return {"predicted_output_tokens": rec.predicted_output_tokens,
                "prediction_delay_s": rec.prediction_delay_s}

    return Workload(spec=wl.spec, source=wl.source,
                    requests=[r.model_copy(update=pred(r)) for r in wl.requests])


def recorded_cap(run: RunResult) -> tuple[bool, int | None]:
    """(known, cap): the `max_tokens` every request of the run was sent, as
    its client recorded it (`details.client`, live runs since it is kept);
    None: each request was sent its workload length."""
    client = run.meta.details.get("client")
    if client is None:
        return False, None
    return True, client.get("extra_body", {}).get("max_tokens", client.get("max_tokens"))


def _finished(rec: RequestRecord) -> bool:
    return (rec.error is None and not rec.rejected and rec.dropped is None
            and rec.output_tokens > 0)


def with_recorded_lengths(wl: Workload, run_path: Path, cap: int | None = None) -> Workload:
    """`wl` with each request's prompt and answer as long as the run at
    `run_path` served them: the prompt as the server counted it (a chat
    template's tokens included) and the answer as long as it came out.  An
    answer that ended by itself below what the request asked for keeps that
    as its `max_tokens`: the simulated job ends by end-of-sequence there, as
    the live one did, unknown to the scheduler.

    What each request asked for is the run's recorded client cap; `cap`
    gives it for a run that did not record it (older runs), and may be left
    out where every answer came out at its workload length (`ignore_eos`
    runs).  A request the run did not finish (an error, a refusal, a hang-up)
    keeps its workload lengths, cut at the cap."""
    run, recs = _records(run_path, wl)
    known, recorded = recorded_cap(run)
    if known and cap is not None and cap != recorded:
        raise SystemExit(f"--lengths-cap {cap}: {run_path} records that its requests were "
                         f"sent max_tokens {recorded or 'of their workload lengths'}")
    if known:
        cap = recorded
    elif cap is None:
        workload_len = {r.request_id: r.output_tokens for r in wl.requests}
        if any(_finished(rec) and rec.output_tokens != workload_len.get(rec.request_id)
               for rec in recs.values()):
            raise SystemExit(f"{run_path}: answers of other lengths than the workload's, and "
                             "the run does not record the max_tokens its requests were sent: "
                             "give it as --lengths-cap")
    replayed = kept = 0
    out: list[RequestSpec] = []
    for r in wl.requests:
        asked = cap if cap is not None else r.output_tokens
        rec = recs.get(r.request_id)
        if rec is None or not _finished(rec):
            kept += 1
            n = min(r.output_tokens, asked)
            out.append(r.model_copy(update={"output_tokens": n,
                                            "max_tokens": asked if asked > n else None}))
            continue
        if rec.output_tokens > asked:
            raise SystemExit(f"{run_path}: {r.request_id} answered {rec.output_tokens} tokens, "
                             f"more than the {asked} it asked for")
        replayed += 1
        out.append(r.model_copy(update={
            "prompt_tokens": rec.prompt_tokens or r.prompt_tokens,
            "output_tokens": rec.output_tokens,
            "max_tokens": asked if asked > rec.output_tokens else None}))
    source: dict[str, float | int | str] = {
        **wl.source, "lengths_from": str(run_path), "lengths_replayed": replayed,
        "lengths_kept_from_workload": kept}
    if cap is not None:
        source["lengths_cap"] = cap
    return Workload(spec=wl.spec, source=source, requests=out)


def add_replay_args(q: argparse.ArgumentParser) -> None:
    """The options that replay what a run recorded (`simulate`, `simulate-sweep`)."""
    q.add_argument("--predictions-from", type=Path, default=None, metavar="RUN.json",
                   help="give each request the response-length prediction the live run "
                        "recorded for it (replaying a predictor-driven run), landing as "
                        "long after the request's arrival as it did live where the run "
                        "recorded when")
    q.add_argument("--lengths-from", type=Path, default=None, metavar="RUN.json",
                   help="give each request the prompt and answer lengths the run served it "
                        "(a live run's answers that ended by themselves below their cap end "
                        "there by end-of-sequence, unknown to the scheduler)")
    q.add_argument("--lengths-cap", type=int, default=None, metavar="N",
                   help="with --lengths-from, for a run that does not record it: the "
                        "max_tokens its requests were sent")
    q.add_argument("--prediction-at-first-token", action="store_true",
                   help="the replayed predictions are the engine's length head's: each lands "
                        "with its request's first token, however late that comes")
    q.add_argument("--prediction-delay", type=float, default=None, metavar="S",
                   help="every prediction lands S seconds after its request arrives "
                        "(default: each request's recorded delay, else on arrival)")


def replayed(wl: Workload, a: argparse.Namespace) -> Workload:
    """`wl` with what `add_replay_args`'s options take from a run."""
    if a.lengths_from is not None:
        wl = with_recorded_lengths(wl, a.lengths_from, a.lengths_cap)
    elif a.lengths_cap is not None:
        raise SystemExit("--lengths-cap: with --lengths-from")
    if a.prediction_at_first_token and (a.predictions_from is None
                                        or a.prediction_delay is not None):
        raise SystemExit("--prediction-at-first-token: with --predictions-from, without "
                         "--prediction-delay")
    if a.predictions_from is not None:
        wl = with_recorded_predictions(wl, a.predictions_from)
    return wl
