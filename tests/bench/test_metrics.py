"""Metric definitions against hand-computed examples."""

from __future__ import annotations

import json

import pytest

from bench.metrics import Dist, SLOSpec, error_kind, format_summary, meets_slo, summarize, tpot
from bench.records import RequestRecord


def rec(rid, send, tokens, end, out=None, **kw) -> RequestRecord:
    return RequestRecord(request_id=rid, scheduled_time=send, send_time=send,
                         token_times=tokens, end_time=end,
                         output_tokens=len(tokens) if out is None else out,
                         prompt_tokens=kw.pop("prompt", 10), **kw)


# A: sent at 0, tokens at 1, 2, 4, ends at 4  -> TTFT 1, E2E 4, TPOT 1.5, NL 4/3
# B: sent at 1, tokens at 3, 3.5, ends at 4   -> TTFT 2, E2E 3, TPOT 1.0, NL 1.5
# C: sent at 2, failed                         -> counted in attainment only
A = rec("a", 0.0, [1.0, 2.0, 4.0], 4.0, queueing_time=0.5, execution_time=3.5, swap_time=0.0,
        num_preemptions=1)
B = rec("b", 1.0, [3.0, 3.5], 4.0, queueing_time=1.0, execution_time=1.5, swap_time=0.5,
        num_preemptions=0, swap_bytes=1024)
C = rec("c", 2.0, [], None, error="HTTP 500")


def test_per_request_definitions():
    assert A.ttft == 1.0 and A.e2e == 4.0
    assert tpot(A) == pytest.approx((4.0 - 1.0) / 2)
    assert tpot(B) == pytest.approx((3.0 - 2.0) / 1)
    assert tpot(rec("one", 0, [1.0], 1.0)) is None  # one token: no TPOT


def test_summary_by_hand():
    s = summarize([A, B, C])
    assert (s.num_requests, s.num_completed, s.num_failed) == (3, 2, 1)
    assert s.duration == 4.0  # first scheduled arrival 0 -> last end 4
    assert s.request_throughput == pytest.approx(2 / 4)
    assert s.output_token_throughput == pytest.approx(5 / 4)
    assert s.total_token_throughput == pytest.approx((5 + 20) / 4)
    assert s.ttft.mean == pytest.approx(1.5) and s.ttft.median == pytest.approx(1.5)
    assert s.tpot.mean == pytest.approx(1.25)
    # ITL pools the gaps 1, 2 (A) and 0.5 (B).
    assert s.itl.count == 3
    assert s.itl.mean == pytest.approx(3.5 / 3)
    assert s.itl.median == pytest.approx(1.0)
    assert s.e2e.mean == pytest.approx(3.5)
    assert s.normalized_latency.mean == pytest.approx((4 / 3 + 1.5) / 2)
    assert s.num_preemptions == 1
    assert s.swap_bytes == 1024
    b = s.breakdown
    assert b is not None and b.count == 2
    assert b.queueing_share == pytest.approx(1.5 / 7)
    assert b.execution_share == pytest.approx(5.0 / 7)
    assert b.swap_share == pytest.approx(0.5 / 7)
    assert b.mean_queueing == pytest.approx(0.75)


def test_percentiles_linear_interpolation():
    d = Dist.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert d.median == 3.0
    # numpy linear: position 0.95 * 4 = 3.8 -> 4 + 0.8 * 96
    assert d.p95 == pytest.approx(4 + 0.8 * 96)
    assert d.p99 == pytest.approx(4 + 0.96 * 96)
    assert Dist.of([]).mean is None


def test_slo_attainment_and_goodput():
    slo = SLOSpec(ttft=1.5, tpot=1.6)
    assert meets_slo(A, slo)  # TTFT 1 <= 1.5, TPOT 1.5 <= 1.6
    assert not meets_slo(B, slo)  # TTFT 2 > 1.5
    assert not meets_slo(C, slo)  # failed
    s = summarize([A, B, C], slo)
    assert s.num_meeting_slo == 1
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.goodput == pytest.approx(1 / 4)
    s2 = summarize([A, B, C], SLOSpec(normalized_latency=1.4))
    assert s2.num_meeting_slo == 1  # A: 1.333 ok, B: 1.5 not
    s3 = summarize([A, B], SLOSpec(e2e=3.0))
    assert s3.slo_attainment == pytest.approx(0.5)
    # One-token outputs have no TPOT and cannot violate a TPOT SLO.
    assert meets_slo(rec("one", 0, [0.1], 0.2), SLOSpec(tpot=0.001))


def test_by_class():
    off = rec("o", 0.0, [2.0, 3.0], 3.0, job_class="offline")
    s = summarize([A, off])
    assert set(s.by_class) == {"online", "offline"}
    assert s.by_class["offline"].ttft.mean == pytest.approx(2.0)
    assert s.by_class["online"].num_completed == 1
    # Per-class throughput is over the whole run's duration.
    assert s.by_class["offline"].duration == s.duration == 4.0


def test_no_server_metadata_means_no_breakdown():
    plain = rec("p", 0.0, [1.0], 1.0)
    s = summarize([plain])
    assert s.breakdown is None and s.num_preemptions is None and s.swap_bytes is None


def test_rejections_and_drops_are_apart_from_admitted_latency():
    # R: refused with 429 after 0.01 s, asked to retry in 2 s; D: the client
    # hung up after one token; C failed; A and B completed.
    R = RequestRecord(request_id="r", scheduled_time=0.5, send_time=0.5, end_time=0.51,
                      rejected=True, retry_after=2.0)
    R2 = RequestRecord(request_id="r2", scheduled_time=0.6, send_time=0.6, end_time=0.63,
                       rejected=True, retry_after=4.0)
    D = rec("d", 0.0, [9.0], 9.5, dropped="mid_stream")
    s = summarize([A, B, C, R, R2, D])
    assert (s.num_requests, s.num_completed, s.num_failed) == (6, 2, 1)
    assert (s.num_rejected, s.num_dropped) == (2, 1)
    assert s.rejected_share == pytest.approx(2 / 6)
    assert s.errors_by_kind == {"HTTP 500": 1}
    # Percentiles over A and B only, as without R, R2, C and D.
    ref = summarize([A, B])
    assert s.ttft == ref.ttft and s.tpot == ref.tpot and s.e2e == ref.e2e
    assert s.itl == ref.itl and s.normalized_latency == ref.normalized_latency
    assert s.rejection_latency.count == 2
    assert s.rejection_latency.mean == pytest.approx(0.02)
    assert s.retry_after.mean == pytest.approx(3.0) and s.retry_after.max == 4.0
    assert not R.ok and not D.ok
    # Refusals are SLO misses: attainment is over every request.
    assert summarize([A, R], SLOSpec(ttft=5.0)).slo_attainment == 0.5
    text = format_summary(s)
    assert "Rejected (429):" in text and "33.3%" in text and "HTTP 500" in text


def test_error_kinds():
    assert error_kind("HTTPStatusError: HTTP 503: overloaded") == "HTTP 503"
    assert error_kind("timeout") == "timeout"
    assert error_kind("ReadError: ") == "ReadError"
    assert error_kind("not sent: past max_duration") == "not sent"
    assert error_kind("IncompleteStream: stream ended without [DONE]") == "IncompleteStream"


def test_results_written_before_admission_control_still_load(tmp_path):
    from bench.results import RunMeta, RunResult, load_result
    from bench.workload import WorkloadSpec

    run = RunResult(meta=RunMeta(mode="live", system="old", workload=WorkloadSpec()),
                    summary=summarize([A, B, C]), records=[A, B, C])
    data = run.model_dump(mode="json")
    for key in ("num_rejected", "rejected_share", "num_dropped", "errors_by_kind",
                "rejection_latency", "retry_after"):
        del data["summary"][key]
    for r in data["records"]:
        for key in ("rejected", "retry_after", "dropped"):
            del r[key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_result(tmp_path / "old.json")
    assert isinstance(old, RunResult)
    assert old.summary.num_rejected == 0 and old.summary.num_failed == 1
    assert [r.ok for r in old.records] == [True, True, False]
    assert summarize(old.records) == run.summary


def test_tokens_per_s_while_the_online_stream_lasts():
    from bench.metrics import tokens_per_s_while
    from bench.records import RequestRecord

    def rec(rid: str, cls: str, times: list[float]) -> RequestRecord:
        return RequestRecord(request_id=rid, job_class=cls, scheduled_time=0.0, send_time=0.0,
                             token_times=times, end_time=times[-1], prompt_tokens=4,
                             output_tokens=len(times), expected_output_tokens=len(times))

    off = [rec("a", "offline", [1.0, 2.0, 3.0, 9.0]), rec("b", "offline", [4.0, 5.0])]
    on = [rec("c", "online", [0.5, 6.0])]
    # Five offline tokens by t = 5, the end of the window.
    assert tokens_per_s_while(off + on, "offline", 5.0) == (1.0, 5.0)
    # A backlog that runs out first: its own span.
    assert tokens_per_s_while(off, "offline", 20.0) == (6 / 9.0, 9.0)
    assert tokens_per_s_while(on, "offline", 5.0) == (0.0, 0.0)
    # From t = 2.5 (the warm-up left out): the tokens at 3, 4 and 5.
    assert tokens_per_s_while(off + on, "offline", 5.0, start=2.5) == (3 / 2.5, 2.5)
    # A window that starts after the last token holds nothing.
    assert tokens_per_s_while(off, "offline", 20.0, start=9.5) == (0.0, 0.0)
