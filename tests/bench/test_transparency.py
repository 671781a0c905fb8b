"""`bench transparency` against the fake server: probes whose tokens do not
depend on what runs beside them pass; a batch-variant engine fails."""

from __future__ import annotations

import json

from bench.__main__ import main
from bench.client import ClientConfig
from bench.transparency import (
    TransparencyConfig, first_difference, plan_disruptors, plan_probes, run_transparency,
)

from tests.bench.fake_openai import FakeEngine, FakeServer, FakeStats


def small(**kw) -> TransparencyConfig:
    base = dict(probes=6, probe_min_input=4, probe_max_input=12, probe_output_len=8,
                probe_spread_s=0.05, disruptors=4, disruptor_input_len=8,
                disruptor_output_len=40, idle_timeout=5)
    return TransparencyConfig(**{**base, **kw})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix is not the same answer
    assert first_difference([], []) is None


def test_probe_plan():
    tc = TransparencyConfig(probes=200, probe_min_input=16, probe_max_input=64,
                            sampled_share=0.25, probe_spread_s=2.0)
    reqs, variants = plan_probes(tc)
    assert len({r.prompt for r in reqs}) == 200  # distinct prompts
    assert all(16 <= r.prompt_tokens <= 64 for r in reqs)
    arrivals = [r.arrival_time for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] < 2.0
    bodies = [variants[r.request_id].extra_body for r in reqs]
    assert all(b["return_token_ids"] for b in bodies)
    seeded = [b for b in bodies if "seed" in b]
    assert abs(len(seeded) / 200 - 0.25) < 0.1
    assert all(b["temperature"] == 0.8 for b in seeded)
    assert all(b["temperature"] == 0.0 for b in bodies if "seed" not in b)
    assert len({b["seed"] for b in seeded}) == len(seeded)
    assert plan_probes(tc)[1] == variants  # the seed fixes the plan
    d_reqs, d_variants = plan_disruptors(TransparencyConfig(disruptors=100, drop_share=0.5,
                                                            disruptor_output_len=20))
    drops = [v.drop_after_chunks for v in d_variants.values()]
    assert 30 < len(drops) < 70 and all(1 <= n <= 10 for n in drops)
    assert not set(r.prompt for r in d_reqs) & set(r.prompt for r in reqs)


def test_a_shared_prefix_begins_every_probe():
    reqs, _ = plan_probes(TransparencyConfig(probes=20, probe_min_input=8, probe_max_input=30,
                                             shared_prefix=48))
    head = reqs[0].prompt.split()[:48]
    assert all(r.prompt.split()[:48] == head for r in reqs)
    assert len({tuple(r.prompt.split()[48:]) for r in reqs}) == 20  # distinct after it
    assert all(r.prompt_tokens == 48 + len(r.prompt.split()[48:]) for r in reqs)
    assert all(r.prompt_tokens == len(r.prompt.split()) for r in reqs)


def test_a_server_whose_tokens_do_not_depend_on_the_batch_passes():
    eng = FakeEngine(cached_tokens=3)
    with FakeServer(eng) as srv:
        res = run_transparency(small(), ClientConfig(base_url=srv.base_url), FakeStats(eng))
    assert res.ok, res.problems
    assert res.probe_cached_tokens == 18 and all(p.cached_tokens == 3 for p in res.probes)
    assert res.identical == 6 and res.differing == 0 and len(res.probes) == 6
    assert all(p.alone_tokens == p.shared_tokens == 8 for p in res.probes)
    # The fake reports two preemptions for every request.
    assert res.preempted_probes == 6 and res.probe_preemptions == 12
    assert res.disruptors_dropped > 0
    assert res.engines == [{"replica": "fake-0", "dtype": "float32", "deterministic": True}]
    assert res.kv is not None and not res.kv.problems
    # Probes ran one at a time first, then beside the disruptors.
    probe_bodies = [b for b in srv.bodies if b.get("return_token_ids")]
    assert len(probe_bodies) == 12
    assert eng.ended["completed"] >= 12 + 1  # the probes twice, and the health check


def test_tokens_that_change_beside_other_streams_fail():
    eng = FakeEngine(perturb_shared=True)
    with FakeServer(eng) as srv:
        res = run_transparency(small(), ClientConfig(base_url=srv.base_url), FakeStats(eng))
    assert not res.ok
    # Alone nothing runs beside a probe; in the shared run the disruptors do.
    assert res.differing > 0
    bad = [p for p in res.probes if p.first_difference is not None]
    assert all(0 <= p.first_difference < 8 for p in bad)
    assert any("differs from its lone run" in p for p in res.problems)


def test_no_preemption_fails_only_when_required():
    eng = FakeEngine(num_preemptions=0)
    with FakeServer(eng) as srv:
        lax = run_transparency(small(), ClientConfig(base_url=srv.base_url), FakeStats(eng))
        strict = run_transparency(small(require_preemption=True),
                                  ClientConfig(base_url=srv.base_url), FakeStats(eng))
    assert lax.ok and lax.preempted_probes == 0
    assert not strict.ok and strict.problems == ["no probe was preempted in the shared run"]


def test_cli_exit_status_and_json(tmp_path):
    out = tmp_path / "t.json"
    args = ["transparency", "--probes", "3", "--probe-min-input", "4", "--probe-max-input",
            "8", "--probe-output-len", "5", "--disruptors", "2", "--disruptor-output-len",
            "20", "--probe-spread", "0.05", "--no-server-stats", "--out", str(out)]
    with FakeServer() as srv:
        assert main([*args, "--base-url", srv.base_url]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "transparency" and data["identical"] == 3
    assert data["kv"] is None and data["records"] is None
    with FakeServer(FakeEngine(perturb_shared=True)) as srv:
        assert main([*args, "--base-url", srv.base_url]) == 1
