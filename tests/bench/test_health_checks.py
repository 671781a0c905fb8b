"""The overload, disconnect and soak commands against the fake server, and
the KV leak check against a fake stats source."""

from __future__ import annotations

import json
import os

import pytest

from bench.__main__ import main
from bench.client import ClientConfig
from bench.disconnects import DisconnectConfig, plan_drops, run_disconnects
from bench.server_stats import EngineKV, KVSnapshot, compare, read_snapshot, wait_for_idle
from bench.soak import SoakConfig, SoakMix, mix_variants, run_soak
from bench.workload import WorkloadSpec, build_workload

from tests.bench.fake_openai import (
    BLOCKS_PER_STREAM, NUM_BLOCKS, FakeEngine, FakeServer, FakeStats,
)


def test_drop_plan():
    dc = DisconnectConfig(streams=400, share_after_send=0.25, share_before_first=0.25,
                          max_drop_chunks=7, output_len=100)
    reqs, variants = plan_drops(dc)
    assert len(reqs) == 400 and all(r.arrival_time == 0.0 for r in reqs)
    assert all(r.output_tokens == 100 for r in reqs)
    phases = [variants[r.request_id].drop for r in reqs]
    for phase, share in (("after_send", 0.25), ("before_first_chunk", 0.25),
                         ("mid_stream", 0.5)):
        assert abs(phases.count(phase) / 400 - share) < 0.08
    mids = [v.drop_after_chunks for v in variants.values() if v.drop == "mid_stream"]
    assert min(mids) >= 1 and max(mids) <= 7 and len(set(mids)) > 3
    assert plan_drops(dc)[1] == variants  # the seed fixes the plan
    with pytest.raises(ValueError):
        DisconnectConfig(share_after_send=0.7, share_before_first=0.5)


def test_disconnect_storm_leaves_nothing_behind():
    eng = FakeEngine()
    with FakeServer(eng) as srv:
        dc = DisconnectConfig(streams=30, output_len=300, max_drop_chunks=5, idle_timeout=5)
        res = run_disconnects(dc, ClientConfig(base_url=srv.base_url), FakeStats(eng))
    assert res.ok, res.problems
    assert res.model == "fake-model"
    # Every stream was dropped where planned; none ran to its 300 tokens.
    assert res.dropped == res.planned and sum(res.dropped.values()) == 30
    assert res.completed == 0 and res.failed == 0
    assert res.planned["mid_stream"] > 0 and res.planned["after_send"] > 0
    # The server saw the mid-stream hang-ups as disconnects, and only the
    # health check ran to completion.
    assert eng.ended["disconnected"] >= res.dropped["mid_stream"]
    assert eng.ended["completed"] == 1 and res.health_check_error is None
    kv = res.kv
    assert kv is not None and kv.idle and not kv.leaked_blocks
    assert kv.before.engines["fake-0"].free_blocks == kv.after.engines["fake-0"].free_blocks
    assert kv.after.host_used_bytes == 0
    mids = [r for r in res.records if r.dropped == "mid_stream"]
    assert all(1 <= len(r.token_times) <= 5 for r in mids)


def test_disconnect_leak_is_caught():
    eng = FakeEngine(leak_on_disconnect=True)
    with FakeServer(eng) as srv:
        dc = DisconnectConfig(streams=12, output_len=300, max_drop_chunks=3, idle_timeout=0.5)
        res = run_disconnects(dc, ClientConfig(base_url=srv.base_url), FakeStats(eng))
    assert not res.ok
    leaked = eng.ended["disconnected"] * BLOCKS_PER_STREAM
    assert leaked > 0 and res.kv is not None
    assert res.kv.leaked_blocks == {"fake-0": leaked}
    assert res.kv.after.engines["fake-0"].free_blocks == NUM_BLOCKS - leaked
    assert any("KV blocks not freed" in p for p in res.problems)


class _Scripted:
    """A stats source that plays back a list of states, then holds the last."""

    def __init__(self, states: list[tuple[list[dict], dict | None]]) -> None:
        self.states = states
        self.i = -1

    def engines(self) -> list[dict]:
        self.i = min(self.i + 1, len(self.states) - 1)
        return self.states[self.i][0]

    def scheduler(self) -> dict | None:
        return self.states[self.i][1]


def _eng(rid: str, free: int, running: int = 0, host: int = 0) -> dict:
    return {"replica": rid, "free_blocks": free, "num_blocks": 100, "open_streams": running,
            "num_running": running, "num_waiting": 0, "swap": {"host_used_blocks": host}}


def test_leak_check_waits_for_idle_and_compares_every_replica():
    idle = ([_eng("a", 100), _eng("b", 90)], {"kv_tier": {"used_bytes": 0}})
    before = read_snapshot(_Scripted([idle]))
    assert before.idle and before.used_blocks == 10 and before.host_used_bytes == 0
    # Busy for two polls, then back to the idle figures: no leak.
    busy = ([_eng("a", 50, running=3, host=4), _eng("b", 90)], {"kv_tier": {"used_bytes": 64}})
    rep = wait_for_idle(_Scripted([busy, busy, idle]), before, timeout_s=5, poll_s=0.01)
    assert rep.ok and rep.idle
    # Idle again but one replica short of blocks, host blocks and tier bytes
    # still held, and without a scheduler tier figure: only what is known
    # is compared.
    leaky = ([_eng("a", 97, host=2), _eng("b", 90)], {"kv_tier": {"used_bytes": 128}})
    rep = wait_for_idle(_Scripted([leaky]), before, timeout_s=0.05, poll_s=0.01)
    assert not rep.ok and rep.idle
    assert rep.leaked_blocks == {"a": 3} and rep.leaked_host_blocks == {"a": 2}
    assert rep.leaked_host_bytes == 128
    no_tier = read_snapshot(_Scripted([([_eng("a", 100), _eng("b", 90)], {})]))
    assert no_tier.host_used_bytes is None and compare(before, no_tier).ok
    # Admitted requests the Scheduler never saw end are a leak too.
    counted = read_snapshot(_Scripted([([_eng("a", 100), _eng("b", 90)], {"active_jobs": 0})]))
    unreleased = read_snapshot(_Scripted([([_eng("a", 100), _eng("b", 90)],
                                           {"active_jobs": 5})]))
    rep = compare(counted, unreleased)
    assert rep.leaked_scheduler_jobs == 5 and not rep.ok
    # A replica that died is a problem; one that appeared idle is not.
    gone = KVSnapshot(engines={"a": EngineKV(free_blocks=100, num_blocks=100),
                               "c": EngineKV(free_blocks=100, num_blocks=100)})
    rep = compare(before, gone)
    assert rep.missing_replicas == ["b"] and rep.new_replicas == ["c"]
    assert rep.problems == ["engine replica b is gone"]


def _fixed(n: int, rate: float, out: int) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"seed": 3, "streams": [{
        "num_requests": n, "lengths": {"dataset": "fixed", "input_len": 4, "output_len": out},
        "arrivals": {"rate": rate}}]})


def test_soak_mix_kinds():
    wl = build_workload(_fixed(2000, 10.0, 8))
    mix = SoakMix(share_n=0.1, share_stop=0.2, share_logprobs=0.1, share_disconnect=0.2)
    variants, counts = mix_variants(wl.requests, mix, "chat", seed=0)
    assert sum(counts.values()) == 2000
    for kind, share in (("n", 0.1), ("stop", 0.2), ("logprobs", 0.1), ("disconnect", 0.2),
                        ("plain", 0.4)):
        assert abs(counts[kind] / 2000 - share) < 0.04
    kinds = list(variants.values())
    assert sum(v.extra_body.get("logprobs") is True for v in kinds) == counts["logprobs"]
    assert all(v.drop_after_chunks <= 7 for v in kinds if v.drop == "mid_stream")
    with pytest.raises(ValueError):
        SoakMix(share_n=0.5, share_stop=0.6)


def test_soak_short_run_against_the_fake():
    eng = FakeEngine()
    with FakeServer(eng) as srv:
        sc = SoakConfig(duration=1.0, warmup=0.2, sample_interval=0.1, idle_timeout=5,
                        server_pid=os.getpid(),
                        mix=SoakMix(share_n=0.15, share_stop=0.15, share_logprobs=0.15,
                                    share_disconnect=0.15, max_drop_chunks=3))
        res = run_soak(_fixed(100, 25.0, 10), build_workload, ClientConfig(base_url=srv.base_url),
                       sc, FakeStats(eng))
        bodies = list(srv.bodies)
    assert not res.problems, res.problems
    assert 10 <= res.num_requests <= 60  # arrivals within the second only
    assert sum(res.mix_counts.values()) == res.num_requests
    assert res.num_failed == 0 and res.num_rejected == 0
    assert res.num_completed + res.num_dropped == res.num_requests
    assert res.num_dropped <= res.mix_counts["disconnect"]
    assert any(b.get("n") == 2 for b in bodies)
    assert any("stop" in b and "min_tokens" not in b for b in bodies)
    assert any(b.get("logprobs") == 5 for b in bodies)
    # Samples every 0.1 s over the run and the idle wait, RSS and KV alike.
    assert len(res.rss_series.samples) >= 8 and len(res.kv_samples) >= 8
    assert res.rss.start_after_warmup_mb is not None and res.rss.slope_mb_per_hour is not None
    assert res.rss.growth_mb == pytest.approx(res.rss.end_mb - res.rss.start_after_warmup_mb)
    assert max(s.used_blocks for s in res.kv_samples) > 0  # it saw streams hold blocks
    assert res.kv is not None and res.kv.ok and res.kv.after.used_blocks == 0


def test_soak_cli_writes_json_and_plot(tmp_path):
    with FakeServer() as srv:
        out = tmp_path / "soak.json"
        rc = main(["soak", "--dataset", "fixed", "--input-len", "3", "--output-len", "5",
                   "--rate", "20", "--duration", "0.5", "--warmup", "0", "--sample-interval",
                   "0.1", "--base-url", srv.base_url, "--no-server-stats",
                   "--server-pid", str(os.getpid()), "--share-disconnect", "0.2",
                   "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "soak" and data["kv"] is None and data["records"] is None
    assert data["num_completed"] + data["num_dropped"] == data["num_requests"] > 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_overload_with_probe_against_admission_control(tmp_path):
    # The fake admits 4 streams at a time and refuses the rest with 429; each
    # stream of 20 tokens takes about 0.2 s, so it serves about 20 req/s.
    # The probe sends the refused half again after its Retry-After (1 s).
    with FakeServer(FakeEngine(max_active=4)) as srv:
        out = tmp_path / "overload.json"
        rc = main(["overload", "--dataset", "fixed", "--input-len", "3", "--output-len", "20",
                   "--factor", "3", "--duration", "1.5", "--probe-requests", "8",
                   "--server-pid", str(os.getpid()), "--rss-interval", "0.1",
                   "--base-url", srv.base_url, "--out", str(out), "--save-records"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "overload" and data["capacity_source"] == "probe"
    probe = data["probe"]
    assert probe["num_completed"] == 8 and probe["num_rejected"] == 0
    assert probe["num_retried"] >= 4
    cap = data["capacity_req_per_s"]
    assert cap == pytest.approx(probe["req_per_s"]) and 3 < cap < 40
    assert data["target_rate"] == pytest.approx(3 * cap)
    assert data["num_failed"] == 0 and data["num_rejected"] > 0
    assert data["rejected_share"] == pytest.approx(data["num_rejected"] / data["num_requests"])
    # Admitted work runs at about capacity; the rest is refused.
    assert data["completed_rate"] < 0.8 * data["offered_rate"]
    assert data["ttft"]["p50"] is not None and data["tpot"]["p99"] is not None
    rss = data["rss"]
    assert rss["num_samples"] >= 10 and rss["peak_mb"] >= rss["start_mb"] > 0
    tl = data["timeline"]
    assert sum(tl["rejected"]) * tl["bin_s"] == data["num_rejected"]
    recs = data["records"]
    assert all(r["retry_after"] == 1.0 for r in recs if r["rejected"])
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_overload_with_given_capacity_counts_failures(tmp_path):
    spec = _fixed(50, 1.0, 3)
    # Every prompt is "fail": the fake answers HTTP 500; the command exits 1.
    wl_build = lambda s: build_workload(s).model_copy(update={"requests": [  # noqa: E731
        r.model_copy(update={"prompt": "fail"}) for r in build_workload(s).requests]})
    from bench.overload import OverloadConfig, run_overload

    with FakeServer() as srv:
        res = run_overload(spec, wl_build, ClientConfig(base_url=srv.base_url),
                           OverloadConfig(capacity=10.0, factor=2.0, duration=0.5,
                                          rss_interval=0.1, server_pid=os.getpid()))
    assert res.capacity_source == "given" and res.probe is None
    assert res.target_rate == 20.0
    assert res.num_failed == res.num_requests > 0 and res.errors_by_kind == {
        "HTTP 500": res.num_requests}
    assert res.problems and res.ttft.p50 is None


def test_requests_are_cut_to_the_window():
    from bench.checks import spec_for_duration, within

    spec = spec_for_duration(_fixed(5, 1.0, 3), 40.0, 10.0)
    reqs = within(build_workload(spec).requests, 10.0)
    assert spec.streams[0].arrivals.rate == 40.0
    assert reqs[-1].arrival_time < 10.0 and 300 < len(reqs) < 500
    # The margin leaves arrivals past the window to cut.
    assert build_workload(spec).requests[-1].arrival_time >= 10.0
