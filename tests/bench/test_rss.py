"""Server RSS: which processes count, their summed RSS, the sampler, the trend."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import psutil
import pytest

from bench.rss import (
    MB, PeriodicSampler, RssSample, RssSampler, RssSeries, RssStats, is_ray_process,
    server_processes, total_rss,
)

# A parent holding 60 MB with a child holding 40 MB, both sleeping; argv[1]
# tags the parent's command line only (a stand-in for a Ray session folder
# name, which the raylet's carries and its workers' do not).  The
# launcher starts the parent in a new session and exits, so the tree is not
# this test process's descendant (which the session lookup leaves out); the
# parent reaps its child when that is killed.
_CHILD = "import time; buf = bytearray(40 * 2**20); print('ready', flush=True); time.sleep(60)"
_PARENT = f"""
import subprocess, sys, threading, time
buf = bytearray(60 * 2**20)
kid = subprocess.Popen([sys.executable, "-c", {_CHILD!r}],
                       stdout=subprocess.PIPE, text=True)
kid.stdout.readline()
threading.Thread(target=kid.wait, daemon=True).start()
print(kid.pid, flush=True)
time.sleep(60)
"""
_LAUNCHER = f"""
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", {_PARENT!r}, sys.argv[1]],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                     start_new_session=True)
print(p.pid, p.stdout.readline().strip(), flush=True)
"""


@pytest.fixture
def tree():
    tag = f"session_bench_test_{uuid.uuid4().hex}"
    out = subprocess.run([sys.executable, "-c", _LAUNCHER, tag],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    parent, child = (int(x) for x in out.split())
    yield parent, child, tag
    for pid in (child, parent):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_process_tree_of_a_pid(tree):
    parent, child, _ = tree
    procs = server_processes(parent)
    assert {p.pid for p in procs} == {parent, child}
    rss, n = total_rss(procs)
    assert n == 2 and rss >= 100 * MB  # the 60 + 40 MB the two processes touched


def test_session_processes_and_their_descendants(tree):
    parent, child, tag = tree
    found = {p.pid for p in server_processes(session=tag)}
    assert found == {parent, child}
    assert server_processes(session="session_nobody_has") == []


def test_ray_process_names():
    assert is_ray_process("raylet", [])
    assert is_ray_process("gcs_server", ["/x/gcs_server", "--log_dir=/tmp/ray/s"])
    assert is_ray_process("python3", ["ray::ServeReplica:llm:Engine"])
    assert is_ray_process("python3", ["python", "/x/ray/_private/workers/default_worker.py"])
    assert not is_ray_process("python3", ["python", "-m", "bench", "soak"])
    assert not is_ray_process("bash", ["bash"])


def test_sampler_follows_the_tree(tree):
    parent, child, _ = tree
    sampler = RssSampler(parent, interval=0.05)
    with sampler:
        time.sleep(0.3)
        psutil.Process(child).kill()
        time.sleep(0.4)
    s = sampler.series
    assert s.source == f"pid {parent} and descendants"
    assert len(s.samples) >= 6
    assert [x.t for x in s.samples] == sorted(x.t for x in s.samples)
    assert s.samples[0].num_procs == 2 and s.samples[-1].num_procs == 1
    # The 40 MB child is gone by the end.
    assert s.start_mb - s.end_mb >= 30
    assert s.peak_mb == max(x.rss_mb for x in s.samples)
    stats = RssStats.of(s)
    assert (stats.start_mb, stats.end_mb, stats.num_samples) == (s.start_mb, s.end_mb,
                                                                 len(s.samples))


def test_slope_in_mb_per_hour():
    # 10 MB per minute after a 60 s warm-up that jumps by 500 MB.
    samples = [RssSample(t=t, rss_mb=100.0 + (500 if t >= 60 else 0) + t / 6, num_procs=3)
               for t in range(0, 600, 5)]
    s = RssSeries(source="test", interval_s=5, samples=samples)
    assert s.slope_mb_per_hour(since=60) == pytest.approx(600.0)
    assert s.slope_mb_per_hour(since=10_000) is None
    assert s.after(60)[0].t == 60


def test_periodic_sampler_survives_a_failing_probe():
    seen: list[float] = []

    def probe(t: float) -> None:
        seen.append(t)
        if len(seen) == 2:
            raise RuntimeError("one bad sample")

    sampler = PeriodicSampler(probe, 0.02)
    with sampler:
        time.sleep(0.15)
    assert len(seen) >= 5 and sampler.errors == 1
