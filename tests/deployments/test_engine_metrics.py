"""What an engine replica puts in the Ray dashboard, from its snapshots and
its finished jobs (deployments/engine_metrics.py), recorded by fake metric
objects in place of ray.util.metrics."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import deployments.engine_metrics as em
from deployments.job_metrics import FinishedJob

Tags = tuple[tuple[str, str], ...]
ROOT = Path(__file__).resolve().parents[2]


class _Metric:
    def __init__(self, name: str, description: str = "", boundaries: Any = None,
                 tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.tag_keys = name, tuple(tag_keys)
        self.default: dict[str, str] = {}
        self.values: dict[Tags, float] = defaultdict(float)
        self.observed: dict[Tags, list[float]] = defaultdict(list)

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.default = dict(tags)

    def _key(self, tags: dict[str, str] | None) -> Tags:
        full = {**self.default, **(tags or {})}
        assert set(full) == set(self.tag_keys), (self.name, full)
        return tuple(sorted(full.items()))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value > 0, (self.name, value)
        self.values[self._key(tags)] += value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.observed[self._key(tags)].append(value)


class _FakeMetrics:
    Gauge = Counter = Histogram = _Metric


@pytest.fixture
def dash(monkeypatch: pytest.MonkeyPatch) -> em.EngineMetrics:
    monkeypatch.setattr(em, "metrics", _FakeMetrics)
    return em.EngineMetrics("r1")


def _snapshot(tokens_out: int, preemptions: int, free: int) -> dict[str, Any]:
    return {"num_running": 3, "num_waiting": 2, "free_blocks": free, "num_blocks": 100,
            "num_preemptions": preemptions, "tokens_out": tokens_out,
            "swap": {"host_used_blocks": 7, "blocks_out": 4, "blocks_in": 4,
                     "recompute_fallbacks": 0},
            "policy": {"queue_lengths": [2, 0, 1], "demotions": 5},
            "speculative": {"drafted": tokens_out // 2, "accepted": tokens_out // 4},
            "tokens_by_class": {"online": tokens_out}}


def _only(m: _Metric, **tags: str) -> float:
    return m.values[tuple(sorted({"replica": "r1", **tags}.items()))]


def test_counters_advance_by_the_difference_since_the_last_update(dash: em.EngineMetrics) -> None:
    dash.update(_snapshot(tokens_out=40, preemptions=1, free=75))
    dash.update(_snapshot(tokens_out=40, preemptions=1, free=75))  # nothing new
    dash.update(_snapshot(tokens_out=65, preemptions=3, free=60))
    assert _only(dash.counters["tokens_out"]) == 65
    assert _only(dash.counters["num_preemptions"]) == 3
    assert _only(dash.counters["demotions"]) == 5
    assert (_only(dash.counters["drafted"]), _only(dash.counters["accepted"])) == (32, 16)
    assert _only(dash.class_tokens, job_class="online") == 65
    assert _only(dash.gauges["kv_utilization"]) == pytest.approx(0.4)
    assert _only(dash.gauges["num_running"]) == 3
    assert [_only(dash.queues, queue=q) for q in ("1", "2", "3")] == [2, 0, 1]
    # A figure the snapshot lacks (no prefix cache here) is left unset, not zeroed.
    assert not dash.gauges["cached_blocks"].values


def test_finished_jobs_fill_the_latency_histograms_and_counts(dash: em.EngineMetrics) -> None:
    dash.observe([
        FinishedJob("online", "stop", 0.01, 0.05, 0.02, 1.05, prompt_tokens=30, output_tokens=51),
        FinishedJob("offline", "length", 2.0, 2.5, None, 2.5, prompt_tokens=12, output_tokens=1),
        # The client went away before the first token.
        FinishedJob("online", "abort", 0.3, None, None, 0.3, prompt_tokens=8, output_tokens=0),
    ])
    on, off = {"job_class": "online"}, {"job_class": "offline"}
    assert _only(dash.finished, **on, finish_reason="stop") == 1
    assert _only(dash.finished, **on, finish_reason="abort") == 1
    assert _only(dash.finished, **off, finish_reason="length") == 1
    assert _only(dash.prompt_tokens, **on) == 38 and _only(dash.prompt_tokens, **off) == 12
    key = lambda tags: tuple(sorted({"replica": "r1", **tags}.items()))  # noqa: E731
    assert dash.ttft.observed[key(on)] == [0.05] and dash.ttft.observed[key(off)] == [2.5]
    assert dash.tpot.observed[key(on)] == [0.02] and key(off) not in dash.tpot.observed
    assert sorted(dash.e2e.observed[key(on)]) == [0.3, 1.05]
    assert sorted(dash.queue_time.observed[key(on)]) == [0.01, 0.3]


def test_the_readme_lists_every_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    class Recording(_Metric):
        def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(name, *args, **kwargs)
            made.append(name)

    class Fake:
        Gauge = Counter = Histogram = Recording

    monkeypatch.setattr(em, "metrics", Fake)
    em.EngineMetrics("r1")
    # The ingress's and batch jobs' figures, as their sources create them.
    for path in ("deployments/ingress_metrics.py", "batch/job.py"):
        source = (ROOT / path).read_text()
        made += re.findall(r'(?:Gauge|Counter|Histogram)\(\s*"(\w+)"', source)
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Metrics\n", 1)[1].split("\n## ", 1)[0]
    assert len(made) > 30
    assert [m for m in made if f"`{m}`" not in section] == []
