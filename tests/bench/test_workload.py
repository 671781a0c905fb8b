"""Workloads: determinism under a seed, ShareGPT handling, arrivals, mixes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.arrivals import ArrivalSpec, arrival_times
from bench.dataset import LengthFilter, load_pool
from bench.workload import (
    LengthSpec,
    StreamSpec,
    Workload,
    WorkloadSpec,
    build_workload,
    filler_prompt,
    rescale_io_ratio,
)


def words(texts):  # a whitespace "tokenizer"
    return [len(t.split()) for t in texts]


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    """A ShareGPT-shaped JSON array cut off inside its last record."""
    rng = np.random.default_rng(1)
    recs = []
    for i in range(60):
        p, o = int(rng.integers(1, 40)), int(rng.integers(1, 60))
        recs.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": " ".join(["w"] * p)},
            {"from": "gpt", "value": " ".join(["x"] * o)},
        ]})
    recs.append({"id": "system-first", "conversations": [
        {"from": "system", "value": "be nice"},
        {"from": "human", "value": "a b c d e"},
        {"from": "gpt", "value": "f g h i j k"},
    ]})
    recs.append({"id": "no-answer", "conversations": [{"from": "human", "value": "hello there"}]})
    text = json.dumps(recs, indent=1)
    text = text[: -40]  # truncate the last record, as the shipped file is
    path = tmp_path_factory.mktemp("sg") / "sharegpt.json"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def pool(sharegpt_file):
    return load_pool(path=sharegpt_file, counter=words, length_filter=LengthFilter(
        min_len=4, max_prompt_len=30, max_total_len=70), need_text=True)


def test_pool_counts_and_filter(sharegpt_file, pool):
    # 62 records written, the last one cut off: 61 complete, 60 with an exchange
    # (the truncated "no-answer" is the dropped one).
    assert pool.num_records == 61
    assert pool.truncated_bytes > 0
    assert pool.num_with_exchange == 61
    assert ((pool.prompt_tokens >= 4) & (pool.output_tokens >= 4)).all()
    assert (pool.prompt_tokens <= 30).all()
    assert (pool.prompt_tokens + pool.output_tokens <= 70).all()
    # The prompt is the human turn even after a system turn.
    assert "a b c d e" in pool.prompts
    i = pool.prompts.index("a b c d e")
    assert (pool.prompt_tokens[i], pool.output_tokens[i]) == (5, 6)


def spec(seed: int, n: int = 20, **lengths) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, streams=[StreamSpec(
        num_requests=n, lengths=LengthSpec(**lengths), arrivals=ArrivalSpec(rate=4.0))])


def test_same_seed_same_workload(pool):
    a = build_workload(spec(7), pool)
    b = build_workload(spec(7), pool)
    assert a.model_dump() == b.model_dump()
    c = build_workload(spec(8), pool)
    assert [r.arrival_time for r in a.requests] != [r.arrival_time for r in c.requests]
    assert [r.output_tokens for r in a.requests] != [r.output_tokens for r in c.requests]


def test_sharegpt_requests_come_from_pool(pool):
    wl = build_workload(spec(0, n=10), pool)
    pairs = set(zip(pool.prompt_tokens.tolist(), pool.output_tokens.tolist()))
    for r in wl.requests:
        assert (r.prompt_tokens, r.output_tokens) in pairs
        assert len(r.prompt.split()) == r.prompt_tokens
    # Without replacement when the pool is large enough.
    wl = build_workload(spec(0, n=len(pool)), pool)
    assert sorted(r.prompt for r in wl.requests) == sorted(pool.prompts)


def test_fixed_lengths_need_no_pool():
    wl = build_workload(spec(0, dataset="fixed", input_len=7, output_len=3))
    assert {(r.prompt_tokens, r.output_tokens) for r in wl.requests} == {(7, 3)}
    assert wl.requests[0].prompt == filler_prompt(7, salt=0)
    assert all(len(r.prompt.split()) == 7 for r in wl.requests)
    # No two prompts begin alike: a prefix cache finds nothing to share.
    assert len({r.prompt.split()[0] + r.prompt.split()[1] for r in wl.requests}) == len(
        wl.requests)


def test_salted_filler_prompts_keep_one_token_per_word():
    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("embedded:smollm2"))
    for n, salt in ((1, 3), (4, 10**6), (40, 12_345)):
        text = filler_prompt(n, salt)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == n
    assert filler_prompt(40, 1) != filler_prompt(40, 2)


def test_rescaled_ratio_keeps_total_length(pool):
    base = build_workload(spec(3), pool)
    for ratio in (0.25, 1.0, 16.0):
        wl = build_workload(spec(3, io_ratio=ratio), pool)
        for r0, r in zip(base.requests, wl.requests):
            assert r.prompt_tokens + r.output_tokens == r0.prompt_tokens + r0.output_tokens
            assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        p = np.array([r.prompt_tokens for r in wl.requests])
        o = np.array([r.output_tokens for r in wl.requests])
        assert abs(p.sum() / o.sum() - ratio) / ratio < 0.25


def test_rescale_exact():
    p, o = rescale_io_ratio(np.array([10, 3]), np.array([30, 1]), 3.0)
    assert p.tolist() == [30, 3] and o.tolist() == [10, 1]


def test_poisson_and_gamma_arrivals():
    rng = np.random.default_rng(0)
    t = arrival_times(ArrivalSpec(rate=5.0), 20000, rng)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.2) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05
    g = np.diff(arrival_times(ArrivalSpec(process="gamma", rate=5.0, cv=3.0), 20000, rng))
    assert abs(g.mean() - 0.2) < 0.02
    assert abs(g.std() / g.mean() - 3.0) < 0.3
    assert (arrival_times(ArrivalSpec(rate=math.inf), 5, rng) == 0).all()
    with pytest.raises(ValueError):
        ArrivalSpec(process="poisson", cv=2.0)


def test_online_offline_mix_and_jsonl(tmp_path, pool):
    s = WorkloadSpec(seed=1, streams=[
        StreamSpec(name="online", num_requests=8, arrivals=ArrivalSpec(rate=2.0)),
        StreamSpec(name="offline", job_class="offline", num_requests=4,
                   lengths=LengthSpec(dataset="fixed", input_len=5, output_len=9),
                   arrivals=ArrivalSpec(rate=math.inf)),
    ])
    wl = build_workload(s, pool)
    assert len(wl.requests) == 12
    off = [r for r in wl.requests if r.job_class == "offline"]
    assert len(off) == 4 and all(r.arrival_time == 0 for r in off)
    assert [r.arrival_time for r in wl.requests] == sorted(r.arrival_time for r in wl.requests)
    assert len({r.request_id for r in wl.requests}) == 12
    # Adding a stream leaves the first stream's draws unchanged.
    only = build_workload(WorkloadSpec(seed=1, streams=[s.streams[0]]), pool)
    on = [r for r in wl.requests if r.job_class == "online"]
    assert [(r.arrival_time, r.output_tokens) for r in on] == [
        (r.arrival_time, r.output_tokens) for r in only.requests]
    path = tmp_path / "wl.jsonl"
    wl.save_jsonl(path)
    assert Workload.load_jsonl(path).model_dump() == wl.model_dump()


def test_with_rate_changes_only_rate():
    s = spec(0).with_rate(9.0)
    assert s.streams[0].arrivals.rate == 9.0
    assert s.streams[0].num_requests == 20


def test_a_run_with_an_offline_backlog_reads_back(tmp_path):
    """An infinite rate (a backlog sent at once) survives JSON, and results
    written with null there still load."""
    import json
    import math

    from bench.arrivals import ArrivalSpec
    from bench.workload import StreamSpec, WorkloadSpec

    spec = WorkloadSpec(streams=[StreamSpec(), StreamSpec(name="offline", job_class="offline",
                                                          arrivals=ArrivalSpec(rate=math.inf))])
    text = spec.model_dump_json()
    assert WorkloadSpec.model_validate_json(text) == spec
    legacy = json.loads(text)
    legacy["streams"][1]["arrivals"]["rate"] = None
    assert WorkloadSpec.model_validate(legacy).streams[1].arrivals.rate == math.inf
