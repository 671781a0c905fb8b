"""Batch jobs live: a batch file submitted as a Ray Job while chat streams
run, stopped part-way, resumed; then the same through `/v1/files` and
`/v1/batches` with the official `openai` client, for completions and for
Responses, and the files listed and deleted; a batch whose completion
window ends while it runs expires.

Ray Jobs need the dashboard, which the session's Ray (conftest.py) runs
without, and this process may already be connected to that one.  So the
module starts its own single-node cluster in a subprocess (`ray start
--head --block` on loopback, its own ports and temp dir, so no `ray.init()`
elsewhere finds it), deploys the application from a driver subprocess that
exits, and from here speaks only HTTP to it: the Jobs API (directly and
through `preempt-serve batch`) and the Serve proxy.  Every process of that
cluster goes when the module ends."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.integration.conftest import SMALL_CONFIG, _free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "batchapp"
# Admission control is not under test: on a busy 2-core machine its
# measured bound can refuse the chat streams that run beside the batch.
CONFIG = {**SMALL_CONFIG, "policy": "conserve", "max_batch_size": 4,
          "admission": {"enabled": False}}


DEPLOY = """
import time

import ray
from ray import serve

from app.builder import build_app

deadline = time.monotonic() + 120
while True:
    try:
        ray.init(address="{gcs}", log_to_driver=False)
        break
    except ConnectionError:
        if time.monotonic() > deadline:
            raise
        time.sleep(1)
serve.start(http_options={{"host": "127.0.0.1", "port": {port}}})
serve.run(build_app({args}), name={app}, route_prefix="/")
"""


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.storage = tmp / "storage"
        self.dashboard = f"http://127.0.0.1:{_free_port()}"
        self.base = f"http://127.0.0.1:{_free_port()}"
        # Workers, job drivers and the CLI import this checkout.
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled",
                    "RAY_ADDRESS": self.dashboard, "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_API_SERVER_ADDRESS", None)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ports = {name: str(_free_port()) for name in (
            "port", "ray-client-server-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
            "node-manager-port", "object-manager-port")}
        args = ["ray", "start", "--head", "--block", "--num-cpus=4",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard.rsplit(':', 1)[1]}",
                f"--temp-dir={self.tmp / 'ray'}", "--disable-usage-stats",
                *(f"--{k}={v}" for k, v in ports.items())]
        log = open(self.tmp / "ray_start.log", "wb")
        self.process = subprocess.Popen(args, env={**self.env, "RAY_ADDRESS": ""},
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        app_args = {**CONFIG, "batch": {"storage_dir": str(self.storage),
                                        "max_concurrency": 2}}
        self.config = self.tmp / "serve.yaml"
        self.config.write_text(yaml.safe_dump({"applications": [{
            "name": APP, "import_path": "app.builder:build_app", "args": app_args}]}))
        # A driver that deploys the application and exits (Serve keeps it).
        # Started at once, its imports overlap the cluster's start; it
        # connects once the cluster takes it.
        (self.tmp / "deploy.py").write_text(DEPLOY.format(
            gcs=f"127.0.0.1:{ports['port']}", port=self.base.rsplit(":", 1)[1],
            args=repr(app_args), app=repr(APP)))
        deploy = subprocess.run([sys.executable, "deploy.py"], env=self.env, cwd=self.tmp,
                                capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stderr[-3000:]
        for url in (f"{self.base}/health", f"{self.dashboard}/api/version"):
            self._until(lambda: httpx.get(url, timeout=2).status_code == 200, 90,
                        f"{url} does not answer")

    @staticmethod
    def _until(ok: Any, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ok():
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, message
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None:
            return
        # `ray start --block` takes its cluster down with it; what is still
        # there after a while (replicas draining) is killed, found by the
        # temp dir every process of this cluster names.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for pid in self._processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)

    def _processes(self) -> list[int]:
        mine = str(self.tmp).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and entry.name != str(os.getpid()):
                try:
                    if mine in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    def cli(self, *args: str, config: Path | None = None) -> tuple[int, str]:
        """`preempt-serve batch ARGS` (in this process: it only speaks HTTP
        to the Jobs API); its exit status and output.  `config`: another
        Serve config file for the command's settings."""
        from app.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = main(["batch", *args, "--config", str(config or self.config),
                           "--address", self.dashboard])
        return status, out.getvalue()

    def jobs(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # A Ray process may still write its session's logs for a moment after
    # `ray stop` returns: a file landing during the removal is no failure.
    with tempfile.TemporaryDirectory(prefix="rb", dir="/tmp", ignore_cleanup_errors=True) as tmp:
        c = Cluster(Path(tmp))
        saved = os.environ.get("RAY_ADDRESS")
        try:
            c.start()
            # The Jobs SDK reads RAY_ADDRESS before its argument.
            os.environ["RAY_ADDRESS"] = c.dashboard
            yield c
        finally:
            if saved is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = saved
            c.stop()


def chat_body(i: int) -> dict[str, Any]:
    return {"model": "smollm2", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": f"Give me fact number {i} about the sea."}]}


def batch_lines() -> tuple[list[str], dict[str, dict[str, Any]]]:
    """14 lines: 11 requests, one the server refuses, a line that is not
    JSON and one for an endpoint that is not served."""
    bodies = {f"req-{i}": chat_body(i) for i in range(11)}
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                         "body": body}) for cid, body in bodies.items()]
    lines.insert(4, '{"custom_id": "torn", "method": "POST", "url": "/v1/chat/com')
    lines.insert(8, json.dumps({"custom_id": "embed", "method": "POST",
                                "url": "/v1/embeddings", "body": {"input": "x"}}))
    lines.append(json.dumps({"custom_id": "too-hot", "method": "POST",
                             "url": "/v1/chat/completions", "body": {**chat_body(0),
                                                                     "temperature": 5}}))
    return lines, bodies


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def online_texts(base: str, url: str, bodies: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each body's answer as an online request, a few at a time."""
    def one(body: dict[str, Any]) -> str:
        r = httpx.post(f"{base}{url}", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(bodies, pool.map(one, bodies.values())))


def stream_chat(base: str, results: list[Any], i: int) -> None:
    body = {**chat_body(100 + i), "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    results.append((r.status_code, events))


def test_batch_job_stops_resumes_and_matches_online_answers(cluster: Cluster) -> None:
    started = time.monotonic()
    lines, bodies = batch_lines()
    source = cluster.tmp / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    status, out = cluster.cli("submit", str(source))
    assert status == 0, out
    batch_id = out.split()[1].rstrip(":")
    batch_dir = cluster.storage / "batches" / batch_id
    output, errors = batch_dir / "output.jsonl", batch_dir / "errors.jsonl"

    # Once the job runs, two chat streams beside it; then stop the job with
    # some answers in and others not.
    jobs = cluster.jobs()
    streams: list[Any] = []
    chats = [threading.Thread(target=stream_chat, args=(cluster.base, streams, i))
             for i in range(2)]
    deadline = time.monotonic() + 120
    for answers, then in ((1, chats), (3, [])):
        while len(records(output)) < answers:
            assert time.monotonic() < deadline, jobs.get_job_logs(f"{batch_id}-1")[-3000:]
            time.sleep(0.05)
        for t in then:
            t.start()
    jobs.stop_job(f"{batch_id}-1")
    while jobs.get_job_status(f"{batch_id}-1").value != "STOPPED":
        time.sleep(0.2)
    done_before, errors_before = records(output), records(errors)
    assert 3 <= len(done_before) < len(bodies), "the job finished before it was stopped"
    # The batch the command line submitted is the ingress's too.
    status = httpx.get(f"{cluster.base}/v1/batches/{batch_id}", timeout=30).json()
    assert status["status"] == "cancelled"
    assert status["request_counts"]["completed"] == len(done_before)
    for t in chats:
        t.join(timeout=300)

    status, out = cluster.cli("resume", batch_id, "--wait")
    assert status == 0, out
    assert f"output: {output}" in out and f"errors: {errors}" in out
    # The resumed run skipped every line the first one had written.
    skipped = len(done_before) + len(errors_before)
    logs = jobs.get_job_logs(f"{batch_id}-2")
    assert f"14 lines, {skipped} done before" in logs
    assert f"{batch_id}: 100%" in logs  # the progress bar, finished
    outputs, failures = records(output), records(errors)
    assert Counter(o["custom_id"] for o in outputs) == Counter(list(bodies)), \
        "missing or duplicated"
    assert {o["custom_id"] for o in done_before} <= {o["custom_id"] for o in outputs}
    for o in outputs:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    by_id = {f["custom_id"]: f for f in failures}
    assert Counter(f["custom_id"] for f in failures) == {None: 1, "embed": 1, "too-hot": 1}
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["line"] == 5
    assert by_id["embed"]["error"]["param"] == "url" and by_id["embed"]["error"]["line"] == 9
    assert by_id["too-hot"]["response"]["status_code"] == 400
    assert by_id["too-hot"]["response"]["body"]["error"]["param"] == "temperature"
    status = json.loads(cluster.cli("status", batch_id)[1])
    assert status["status"] == "completed"
    assert status["request_counts"] == {"total": 14, "completed": 11, "failed": 3}

    # The chat streams ran beside the batch and ended cleanly.
    assert len(streams) == 2
    for code, events in streams:
        assert code == 200 and events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
    # Offline, stopped and resumed, each answer is the online one (greedy).
    online = online_texts(cluster.base, "/v1/chat/completions", bodies)
    for o in outputs:
        answer = o["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == online[o["custom_id"]], o["custom_id"]
    print(f"batch through Ray Jobs with a stop and a resume: {time.monotonic() - started:.1f} s")


def test_openai_client_files_and_batches(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0,
                    timeout=60)
    bodies = {f"c{i}": {"model": "smollm2", "prompt": f"Count to {i + 3}:", "max_tokens": 8,
                        "temperature": 0} for i in range(3)}
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                               "body": b}) + "\n" for cid, b in bodies.items())
    f = client.files.create(file=("in.jsonl", data.encode()), purpose="batch")
    assert f.bytes == len(data) and f.purpose == "batch"
    assert client.files.content(f.id).content == data.encode()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="24h", metadata={"suite": "integration"})
    assert b.status in ("validating", "in_progress") and b.request_counts.total == 3
    deadline = time.monotonic() + 180
    while b.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.5)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (3, 0)
    assert b.error_file_id is None and b.completed_at and b.metadata == {"suite": "integration"}
    assert b.id in [x.id for x in client.batches.list(limit=10).data]
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(bodies)
    online = online_texts(cluster.base, "/v1/completions", bodies)
    for x in lines:
        assert x["response"]["body"]["choices"][0]["text"] == online[x["custom_id"]]
    # Listed, then deleted: the batch keeps its counts.
    listed = {x.id: x for x in client.files.list(purpose="batch_output")}
    assert b.output_file_id in listed and listed[b.output_file_id].bytes > 0
    gone = client.files.delete(b.output_file_id)
    assert gone.deleted and gone.id == b.output_file_id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(b.output_file_id)
    assert b.output_file_id not in {x.id for x in client.files.list()}
    after = client.batches.retrieve(b.id)
    assert (after.status, after.request_counts, after.usage) == (
        "completed", b.request_counts, b.usage)


def test_openai_client_batch_of_responses(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    bodies = {f"r{i}": {"model": "smollm2", "input": f"Name {i + 2} colours.",
                        "max_output_tokens": 8, "temperature": 0} for i in range(2)}
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/responses",
                               "body": b}) + "\n" for cid, b in bodies.items())
    f = client.files.create(file=("responses.jsonl", data.encode()), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                              completion_window="24h")
    deadline = time.monotonic() + 180
    while b.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.5)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == 2, b
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert b.usage is not None and b.usage.output_tokens == sum(
        x["response"]["body"]["usage"]["output_tokens"] for x in lines)
    for x in lines:
        body = x["response"]["body"]
        online = client.responses.create(**bodies[x["custom_id"]], store=False)
        assert body["object"] == "response" and body["store"] is False
        assert body["output"][0]["content"][0]["text"] == online.output_text


def test_a_batch_still_running_when_its_window_ends_expires(cluster: Cluster) -> None:
    """Submitted with a 7 s window (the command's config sets
    `batch.completion_window_hours`): answers longer than the window
    leaves; the run cancels what is in flight, writes the rest as
    `batch_expired`, and the batch says `expired`."""
    config = yaml.safe_load(cluster.config.read_text())
    config["applications"][0]["args"]["batch"]["completion_window_hours"] = 0.002
    short = cluster.tmp / "short_window.yaml"
    short.write_text(yaml.safe_dump(config))
    bodies = {f"long-{i}": {"model": "smollm2", "prompt": f"Story {i}:", "max_tokens": 300,
                            "ignore_eos": True} for i in range(12)}
    source = cluster.tmp / "long.jsonl"
    source.write_text("".join(json.dumps({"custom_id": cid, "method": "POST",
                                          "url": "/v1/completions", "body": b}) + "\n"
                              for cid, b in bodies.items()))
    status, out = cluster.cli("submit", str(source), "--wait", config=short)
    assert status == 1 and " expired" in out, out
    batch_id = out.split()[1].rstrip(":")
    obj = json.loads(cluster.cli("status", batch_id)[1])
    assert obj["status"] == "expired" and obj["expired_at"] >= obj["expires_at"] - 1
    assert obj["expires_at"] - obj["created_at"] == 7
    batch_dir = cluster.storage / "batches" / batch_id
    outputs, errors = records(batch_dir / "output.jsonl"), records(batch_dir / "errors.jsonl")
    assert len(outputs) + len(errors) == 12 and errors
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    for o in outputs:  # what finished in time is whole
        assert o["response"]["body"]["usage"]["completion_tokens"] == 300
    # An expired batch does not run again.
    status, out = cluster.cli("resume", batch_id, config=short)
    assert status != 0 and "has expired" in out, out
