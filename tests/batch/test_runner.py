"""Running a batch without Ray (batch/runner.py, batch/journal.py): a fake
sender answers as `Ingress.batch_request` does."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from api.batch import BatchResponse
from batch.journal import Journal, read_results
from batch.lines import parse_batch
from batch.runner import RetriesExhausted, RetryPolicy, run_batch
from tests.batch.fakes import FakeSender

# 12 lines: 9 requests, one the server refuses (max_tokens 0), a malformed
# line, and one with a bad method.
REQUESTS = [f"r{i}" for i in range(9)]


def input_file() -> bytes:
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"prompt {cid}", "max_tokens": 4}})
             for cid in REQUESTS]
    lines.insert(3, '{"custom_id": "broken", "method": "POST"')
    lines.insert(6, json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions",
                                "body": {}}))
    lines.append(json.dumps({"custom_id": "refused", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "prompt refused", "max_tokens": 0}}))
    return ("\n".join(lines) + "\n").encode()


def journal(tmp_path: Path) -> Journal:
    j = Journal(tmp_path / "output.jsonl", tmp_path / "errors.jsonl")
    j.open()
    return j


def run(tmp_path: Path, sender: FakeSender, concurrency: int = 3, **kwargs: Any) -> Any:
    j = journal(tmp_path)
    try:
        return asyncio.run(run_batch(parse_batch(input_file()), j, sender,
                                     max_concurrency=concurrency, **kwargs))
    finally:
        j.close()


def results(tmp_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def load(name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
    return load("output.jsonl"), load("errors.jsonl")


def test_every_line_gets_one_result_in_openai_format(tmp_path: Path) -> None:
    sender = FakeSender()
    summary = run(tmp_path, sender)
    output, errors = results(tmp_path)
    assert (summary.total, summary.completed, summary.failed) == (12, 9, 3)
    assert sorted(o["custom_id"] for o in output) == sorted(REQUESTS)
    for o in output:
        assert set(o) == {"id", "custom_id", "response", "error"}
        assert o["id"].startswith("batch_req_") and o["error"] is None
        resp = o["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        # The answer is the one to this line's body.
        assert resp["body"]["choices"][0]["text"] == f"echo: prompt {o['custom_id']}"
    assert len({o["id"] for o in output + errors}) == 12
    by_id = {e["custom_id"]: e for e in errors}
    assert set(by_id) == {None, "get", "refused"}
    # The server's refusal keeps its status and OpenAI error body.
    refused = by_id["refused"]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "max_tokens"
    # Lines never sent carry the reason and their line number.
    assert by_id[None]["response"] is None
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["line"] == 4
    assert by_id["get"]["error"]["param"] == "method" and by_id["get"]["error"]["line"] == 7
    # Only well-formed lines reach the server, each once.
    assert sorted(sender.sent_ids()) == sorted(REQUESTS + ["refused"])


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_concurrency_is_bounded(tmp_path: Path, concurrency: int) -> None:
    sender = FakeSender(delay_s=0.01)
    run(tmp_path, sender, concurrency=concurrency)
    assert sender.max_in_flight == concurrency


def test_429_and_503_and_lost_replicas_are_retried_with_backoff(tmp_path: Path) -> None:
    # r1: two 429s; r2: a 503 then a raised error (handle to a dead replica).
    sender = FakeSender(script={"prompt r1": [429, 429], "prompt r2": [503, "raise"]})
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    summary = run(tmp_path, sender, sleep=sleep, rng=random.Random(0),
                  retry=RetryPolicy(base_s=1.0, cap_s=3.0))
    output, errors = results(tmp_path)
    assert summary.retries == 4 and len(sleeps) == 4
    # Doubling from 1 s, capped at 3 s, jittered within the upper half.
    by_attempt = sorted(sleeps)
    assert 0.5 <= by_attempt[0] <= 1.0 and 0.5 <= by_attempt[1] <= 1.0
    assert 1.0 <= by_attempt[2] <= 2.0 and 1.0 <= by_attempt[3] <= 2.0
    assert Counter(sender.sent_ids())["r1"] == 3 and Counter(sender.sent_ids())["r2"] == 3
    # Retried requests end in the output, never in the error file.
    assert {"r1", "r2"} <= {o["custom_id"] for o in output}
    assert all(e["response"] is None or e["response"]["status_code"] not in (429, 503)
               for e in errors)


def test_a_request_refused_past_the_budget_stops_the_run_unwritten(tmp_path: Path) -> None:
    sender = FakeSender(script={"prompt r4": [503] * 100})
    clock = [0.0]

    async def sleep(s: float) -> None:
        clock[0] += s

    with pytest.raises(RetriesExhausted, match="r4"):
        run(tmp_path, sender, concurrency=1, sleep=sleep, clock=lambda: clock[0],
            retry=RetryPolicy(base_s=1.0, cap_s=4.0, timeout_s=20.0))
    assert clock[0] <= 20.0
    output, errors = results(tmp_path)
    assert "r4" not in {r["custom_id"] for r in output + errors}
    # A resumed run with the server back sends it, and only what is missing.
    resumed = FakeSender()
    run(tmp_path, resumed)
    output, _ = results(tmp_path)
    assert sorted(o["custom_id"] for o in output) == sorted(REQUESTS)
    assert "r4" in resumed.sent_ids() and "r0" not in resumed.sent_ids()


async def _stop_after(tmp_path: Path, sender: FakeSender, results_wanted: int) -> None:
    """Run until the output holds `results_wanted` lines, then cancel (the
    job stopped mid-batch, requests in flight)."""
    j = journal(tmp_path)
    task = asyncio.ensure_future(run_batch(parse_batch(input_file()), j, sender,
                                           max_concurrency=3))
    while j.completed < results_wanted:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    j.close()


def test_resume_after_a_stop_skips_done_lines_and_duplicates_none(tmp_path: Path) -> None:
    first = FakeSender(delay_s=0.01)
    asyncio.run(_stop_after(tmp_path, first, 4))
    output, errors = results(tmp_path)
    assert 4 <= len(output) < 9
    done_before = {o["custom_id"] for o in output} | {e["custom_id"] for e in errors}
    second = FakeSender()
    summary = run(tmp_path, second)
    assert summary.skipped == len(output) + len(errors)
    assert not set(second.sent_ids()) & (done_before - {None})
    output, errors = results(tmp_path)
    assert sorted(o["custom_id"] for o in output) == sorted(REQUESTS)
    assert Counter(e["custom_id"] for e in errors) == {None: 1, "get": 1, "refused": 1}
    # A third run finds nothing to do.
    third = FakeSender()
    assert run(tmp_path, third).skipped == 12 and third.sent_ids() == []


def test_resume_drops_a_partially_written_last_line(tmp_path: Path) -> None:
    asyncio.run(_stop_after(tmp_path, FakeSender(delay_s=0.01), 3))
    out = tmp_path / "output.jsonl"
    lines = out.read_bytes().splitlines(keepends=True)
    cut = lines[-1]
    # The job was killed in the middle of its last write.
    out.write_bytes(b"".join(lines[:-1]) + cut[:len(cut) // 2])
    lost = json.loads(cut)["custom_id"]
    # A reader (the ingress) sees only complete lines meanwhile.
    assert len(read_results(out)) == len(lines) - 1
    sender = FakeSender()
    run(tmp_path, sender)
    assert lost in sender.sent_ids()
    output, _ = results(tmp_path)
    assert sorted(o["custom_id"] for o in output) == sorted(REQUESTS)


def test_the_sender_sees_the_line_body_unchanged(tmp_path: Path) -> None:
    sender = FakeSender()
    run(tmp_path, sender, concurrency=1)
    assert sender.calls[0] == ("/v1/completions", {"prompt": "prompt r0", "max_tokens": 4})


def test_batch_response_is_the_line_response() -> None:
    r = BatchResponse(status_code=200, request_id="x", body={"id": "x"})
    assert r.model_dump() == {"status_code": 200, "request_id": "x", "body": {"id": "x"}}


def test_the_window_s_end_cancels_what_is_in_flight_and_expires_the_rest(
        tmp_path: Path) -> None:
    import time

    sender = FakeSender(delay_s=0.05)
    summary = run(tmp_path, sender, concurrency=1, expires_at=time.time() + 0.13)
    output, errors = results(tmp_path)
    expired = [e for e in errors if e["error"] and e["error"]["code"] == "batch_expired"]
    assert summary.expired == len(expired) >= 1 and output
    assert (summary.completed, summary.failed) == (len(output), len(errors))
    assert len(output) + len(errors) == 12  # every line has exactly one result
    assert len({e["error"]["line"] for e in expired}) == len(expired)
    assert sender.in_flight == 0  # the one in flight was cancelled
    # Those sent and answered keep their answers.
    assert {o["custom_id"] for o in output} <= set(REQUESTS)
    assert len(sender.calls) == len(output) + 1  # the last one never answered


def test_a_run_that_starts_after_its_window_sends_nothing(tmp_path: Path) -> None:
    import time

    class Seen:
        def __init__(self) -> None:
            self.left = 0

        def start(self, total: int, done: int) -> None:
            self.left = total - done

        def finished(self, ok: bool) -> None:
            self.left -= 1

        def retried(self) -> None:
            pass

    sender, seen = FakeSender(), Seen()
    summary = run(tmp_path, sender, expires_at=time.time() - 1, progress=seen)
    assert summary.failed == 12 and summary.completed == 0
    assert seen.left == 0  # the dashboard's `batch_requests_remaining` reaches 0
    errors = read_results(tmp_path / "errors.jsonl")
    assert sender.calls == [] and read_results(tmp_path / "output.jsonl") == []
    assert {e.error.code for e in errors if e.error} == {"batch_expired", "invalid_json",
                                                         "invalid_request"}
    assert summary.expired == 10 and len(errors) == 12  # 10 requests, 2 bad lines
