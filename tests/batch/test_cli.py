"""`preempt-serve batch` without a cluster: the Ray Jobs API is a fake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import batch.cli as cli
from api.batch import BatchResponse
from batch.journal import Journal
from batch.lines import Request
from batch.store import BatchStore
from tests.batch.fakes import FakeJobs

LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                   "body": {"prompt": "hi"}})


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> FakeJobs:
    fake = FakeJobs()
    addresses: list[str | None] = []

    def make(address: str | None) -> FakeJobs:
        addresses.append(address)
        return fake

    monkeypatch.setattr(cli, "RayJobs", make)
    fake.addresses = addresses  # type: ignore[attr-defined]
    return fake


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(f"applications:\n  - name: myapp\n    import_path: app.builder:build_app\n"
                    f"    args:\n      batch:\n        storage_dir: {tmp_path / 'store'}\n"
                    f"        max_concurrency: 5\n")
    return path


def submit(tmp_path: Path, config: Path, *extra: str) -> str:
    """The id of the batch submitted (the newest in the config's store,
    or in `--storage-dir`'s)."""
    data = tmp_path / "in.jsonl"
    data.write_text(LINE + "\n")
    assert cli.main(["submit", str(data), "--config", str(config), "--address",
                     "http://head:8265", *extra]) == 0
    store = extra[extra.index("--storage-dir") + 1] if "--storage-dir" in extra \
        else tmp_path / "store"
    return BatchStore(Path(store)).batches()[0].id


def test_submit_takes_app_and_storage_from_the_config(
        tmp_path: Path, config: Path, jobs: FakeJobs, capsys: pytest.CaptureFixture[str]) -> None:
    batch_id = submit(tmp_path, config, "--metadata", "team=a")
    record = BatchStore(tmp_path / "store").batch(batch_id)
    assert record is not None
    assert (record.app, record.max_concurrency, record.total) == ("myapp", 5, 1)
    assert record.metadata == {"team": "a"} and record.endpoint == "/v1/completions"
    assert jobs.submitted[0][0] == f"{batch_id}-1"
    assert jobs.addresses == ["http://head:8265"]  # type: ignore[attr-defined]
    assert batch_id in capsys.readouterr().out
    # The input is a stored copy: editing the original changes nothing.
    assert record.input_file_id.startswith("file-")


def test_flags_win_over_the_config(tmp_path: Path, config: Path, jobs: FakeJobs) -> None:
    other = tmp_path / "other"
    batch_id = submit(tmp_path, config, "--app", "x", "--max-concurrency", "2",
                      "--storage-dir", str(other))
    record = BatchStore(other).batch(batch_id)
    assert record is not None and (record.app, record.max_concurrency) == ("x", 2)


def test_the_jobs_address_is_the_flags_else_the_configs_else_the_environments(
        tmp_path: Path, config: Path, jobs: FakeJobs, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text(LINE + "\n")
    monkeypatch.setenv("RAY_ADDRESS", "http://env:8265")
    assert cli.main(["submit", str(data), "--config", str(config)]) == 0
    configured = tmp_path / "jobs.yaml"
    configured.write_text(config.read_text() + "        jobs_address: http://configured:8265\n")
    assert cli.main(["submit", str(data), "--config", str(configured)]) == 0
    assert cli.main(["submit", str(data), "--config", str(configured),
                     "--address", "http://flag:8265"]) == 0
    assert jobs.addresses == [  # type: ignore[attr-defined]
        "http://env:8265", "http://configured:8265", "http://flag:8265"]


def test_status_resume_cancel_and_wait(tmp_path: Path, config: Path, jobs: FakeJobs,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    batch_id = submit(tmp_path, config)
    common = ["--config", str(config)]
    assert cli.main(["resume", batch_id, *common]) == 2  # still running
    assert "still running" in capsys.readouterr().err
    assert cli.main(["cancel", batch_id, *common]) == 0
    assert cli.main(["status", batch_id, *common]) == 0
    status = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert status["status"] == "cancelled"
    assert status["output_path"].endswith(f"{batch_id}/output.jsonl")
    # Resumed; the run writes its line and succeeds: --wait prints the paths.
    store = BatchStore(tmp_path / "store")
    record = store.batch(batch_id)
    journal = Journal(store.output_path(record), store.errors_path(record))
    journal.open()
    journal.record_response(Request(1, "a", "/v1/completions", {}),
                            BatchResponse(status_code=200, body={}))
    journal.close()
    jobs.submit = lambda sid, e, m: jobs.status.__setitem__(sid, "SUCCEEDED")  # type: ignore
    assert cli.main(["resume", batch_id, "--wait", *common]) == 0
    out = capsys.readouterr().out
    assert "completed: 1 completed, 0 failed of 1" in out
    assert f"output: {store.output_path(record)}" in out
    assert f"errors: {store.errors_path(record)}" in out


def test_a_failed_run_waits_to_status_1(tmp_path: Path, config: Path, jobs: FakeJobs,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    jobs.submit = lambda sid, e, m: jobs.status.__setitem__(sid, "FAILED")  # type: ignore
    data = tmp_path / "in.jsonl"
    data.write_text(LINE + "\n")
    assert cli.main(["submit", str(data), "--config", str(config), "--wait"]) == 1
    assert "failed: job message" in capsys.readouterr().err


def test_user_errors_exit_2(tmp_path: Path, config: Path, jobs: FakeJobs,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "batch_nope", "--config", str(config)]) == 2
    assert cli.main(["submit", str(tmp_path / "missing"), "--config", str(config)]) == 2
    assert cli.main(["status", "x", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert cli.main(["submit", str(config), "--config", str(config),
                     "--max-concurrency", "0"]) == 2
    err = capsys.readouterr().err
    assert "no batch 'batch_nope'" in err and "config file not found" in err


def test_without_a_jobs_api_the_command_fails_with_1(
        tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text(LINE + "\n")
    # Nothing listens on the discard port of loopback.
    assert cli.main(["submit", str(data), "--config", str(config),
                     "--address", "http://127.0.0.1:9"]) == 1
    assert "cannot be reached" in capsys.readouterr().err
    # Nothing was stored for a batch that could not start.
    assert not (tmp_path / "store").exists()
