"""The `preempt-serve` console script, run as installed (`pip install -e .`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import cli

REPO = Path(__file__).resolve().parents[2]


def script() -> str:
    path = shutil.which("preempt-serve")
    assert path, "the preempt-serve console script is not installed: run `pip install -e .`"
    return path


def run(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def test_help_lists_the_subcommands():
    out = run(script(), "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: preempt-serve")
    for command in ("serve", "bench", "predictor", "batch"):
        assert f"    {command}" in out.stdout


def test_batch_help_is_the_batch_commands():
    out = run(script(), "batch", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: preempt-serve batch")
    for command in ("submit", "status", "resume", "cancel"):
        assert f"    {command}" in out.stdout


def test_no_subcommand_prints_usage_and_fails():
    out = run(script())
    assert out.returncode == 2
    assert "usage: preempt-serve" in out.stderr


def test_serve_help():
    out = run(script(), "serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: preempt-serve serve" in out.stdout
    assert "serve_config.yaml" in out.stdout and "SIGTERM" in out.stdout


@pytest.mark.parametrize("command", ["bench", "predictor"])
def test_delegated_help_is_the_modules_own(command: str):
    ours = run(script(), command, "--help")
    theirs = run(sys.executable, "-m", command, "--help")
    assert ours.returncode == theirs.returncode == 0, ours.stderr
    assert ours.stdout == theirs.stdout


# The predictor's help above already shows it is delegated to; its exit
# status goes the same way as the bench's (4 s of imports a process).
@pytest.mark.parametrize("command", ["bench"])
def test_delegated_exit_status_is_the_modules_own(command: str):
    ours = run(script(), command, "no-such-subcommand")
    theirs = run(sys.executable, "-m", command, "no-such-subcommand")
    assert ours.returncode == theirs.returncode == 2
    assert ours.stderr == theirs.stderr


def test_bench_runs_with_the_remaining_arguments(tmp_path: Path):
    args = ["workload", "--dataset", "fixed", "-n", "6", "--input-len", "8",
            "--output-len", "4", "--rate", "2", "--seed", "11"]
    ours = run(script(), "bench", *args, "--out", str(tmp_path / "ours.jsonl"))
    theirs = run(sys.executable, "-m", "bench", *args, "--out", str(tmp_path / "theirs.jsonl"))
    assert ours.returncode == theirs.returncode == 0, ours.stderr
    written = (tmp_path / "ours.jsonl").read_text()
    assert written == (tmp_path / "theirs.jsonl").read_text()
    assert len(written.splitlines()) >= 6


def test_serve_refuses_a_missing_config_before_starting_anything(tmp_path: Path):
    out = run(script(), "serve", cwd=tmp_path)  # no serve_config.yaml there
    assert out.returncode == 2
    assert "config file not found: serve_config.yaml" in out.stderr


def test_serve_refuses_what_it_would_not_apply(tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "applications:\n"
        "  - name: llm\n"
        "    import_path: app.builder:build_app\n"
        "    deployments:\n"
        "      - name: Ingress\n"
        "        num_replicas: 2\n")
    out = run(script(), "serve", str(cfg))
    assert out.returncode == 2
    assert "sets deployments" in out.stderr and "serve run" in out.stderr

    cfg.write_text("applications: 3\n")
    out = run(script(), "serve", str(cfg))
    assert out.returncode == 2 and "is not a valid Serve config" in out.stderr


class _RayInitCalled(Exception):
    pass


@pytest.mark.parametrize("preset", [None, ("token", "0")])
def test_serve_disables_ray_auth_and_sends_the_proxy_over_grpc_unless_the_user_set_them(
        monkeypatch, preset: tuple[str, str] | None):
    import ray

    if preset is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        monkeypatch.delenv("RAY_SERVE_PROXY_USE_GRPC", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", preset[0])
        monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", preset[1])
    seen: dict[str, str | None] = {}

    def fake_init(**kwargs: object) -> None:
        seen["mode"] = os.environ.get("RAY_AUTH_MODE")
        seen["grpc"] = os.environ.get("RAY_SERVE_PROXY_USE_GRPC")
        raise _RayInitCalled

    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(_RayInitCalled):
        cli.main(["serve", str(REPO / "serve_config.yaml")])
    assert (seen["mode"], seen["grpc"]) == (preset or ("disabled", "1"))


BUILT: list[dict[str, object]] = []  # each tiny_builder call's args


def tiny_builder(args: dict[str, object]):  # type: ignore[no-untyped-def]
    from ray import serve

    BUILT.append(args)

    @serve.deployment
    class Echo:
        def __call__(self) -> object:
            return args

    return Echo.bind()


def test_build_application_calls_a_builder_with_the_args():
    from ray.serve import Application

    app = cli.build_application("tests.app.test_cli:tiny_builder", {"k": 1})
    assert isinstance(app, Application) and BUILT[-1] == {"k": 1}
    with pytest.raises(cli.CLIError, match="takes no args"):
        cli.build_application("tests.app.test_cli:TINY_APP", {"k": 1})
    assert isinstance(cli.build_application("tests.app.test_cli.TINY_APP", {}), Application)
    with pytest.raises(cli.CLIError, match="cannot import"):
        cli.build_application("tests.app.test_cli:nothing_here", {})


TINY_APP = tiny_builder({})
