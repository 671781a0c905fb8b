"""The `preempt-serve` command line.

    preempt-serve serve [CONFIG]     run the applications of a Serve config file
                                     (default serve_config.yaml) until Ctrl-C / SIGTERM
    preempt-serve bench ...          the benchmark harness (`python -m bench ...`)
    preempt-serve predictor ...      the response-length predictor (`python -m predictor ...`)
    preempt-serve batch ...          batch files as Ray Jobs on a running cluster (batch/cli.py)

`serve` starts the applications as `serve run CONFIG` does (a local Ray
instance unless `--address` or RAY_ADDRESS names a cluster) and differs in
how it stops.  `serve run` ends open streams abruptly: Ray Serve kills the
HTTP proxy at the same time as the replicas, so clients see a truncated
response, and on SIGTERM the `serve run` process itself aborts.  Here both
Ctrl-C and SIGTERM first have every engine replica end its jobs with an
error (`Scheduler.shutdown_engines`), which the still-running proxy
delivers as each stream's last event.  Only then are Serve and Ray stopped,
and the command exits with status 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Sequence

DEFAULT_CONFIG = "serve_config.yaml"
SHUTDOWN_REASON = "the server is shutting down"

# Fields of a Serve config application that `serve` does not apply; it
# refuses them rather than run something other than the file says.
_UNSUPPORTED_APP_FIELDS = ("runtime_env", "deployments", "autoscaling_policy",
                           "external_scaler_enabled")


class CLIError(Exception):
    """A user error: printed without a traceback, exit status 2."""


# Delegated subcommands ---------------------------------------------------


def _bench(argv: list[str]) -> int:
    from bench.__main__ import main

    return int(main(argv) or 0)


def _predictor(argv: list[str]) -> int:
    from predictor.__main__ import main

    main(argv)
    return 0


def _batch(argv: list[str]) -> int:
    from batch.cli import main

    return main(argv)


DELEGATES: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "bench": (_bench, "workloads, load client, simulator, profiler, reports "
                      "(`python -m bench`; `preempt-serve bench --help`)"),
    "predictor": (_predictor, "response-length predictor: dataset, training, evaluation "
                              "(`python -m predictor`; `preempt-serve predictor --help`)"),
    "batch": (_batch, "OpenAI Batch files run as Ray Jobs: submit, status, resume, cancel "
                      "(`preempt-serve batch --help`)"),
}


# serve -------------------------------------------------------------------


def load_config(path: str) -> Any:
    """The Serve config file as Ray's `ServeDeploySchema`, checked before
    anything starts."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    p = Path(path)
    if not p.is_file():
        raise CLIError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(p.read_text())
        config = ServeDeploySchema.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as e:
        raise CLIError(f"{path} is not a valid Serve config: {e}") from None
    for app in config.applications:
        used = [f for f in _UNSUPPORTED_APP_FIELDS if f in app.model_fields_set
                and getattr(app, f)]
        if used:
            raise CLIError(
                f"{path}: application {app.name!r} sets {', '.join(used)}, which "
                "`preempt-serve serve` does not apply; use `serve run` for this config")
    return config


def build_application(import_path: str, args: dict[str, Any]) -> Any:
    """The Serve application an `import_path` names: a builder called with
    `args` (as `app.builder:build_app`), or an application object."""
    from ray.serve import Application

    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise CLIError(f"import_path {import_path!r} must be 'module:attribute'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise CLIError(f"cannot import {import_path!r}: {e}") from None
    if isinstance(target, Application):
        if args:
            raise CLIError(f"{import_path!r} is an application, not a builder: it takes no args")
        return target
    if not callable(target):
        raise CLIError(f"{import_path!r} is neither an application nor a builder")
    app = target(args)
    if not isinstance(app, Application):
        raise CLIError(f"{import_path!r} returned {type(app).__name__}, not an application")
    return app


class _Signals:
    """SIGINT and SIGTERM become KeyboardInterrupt in the main thread, once:
    the graceful stop then runs to its end; a second signal during it
    stops the process at once."""

    def __init__(self) -> None:
        self.stopping = False

    def install(self) -> None:
        # After ray.init(), which installs its own SIGTERM handler: that one
        # tears the local Ray node down under the running replicas.
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            print("preempt-serve: second signal, stopping at once", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.stopping = True
        raise KeyboardInterrupt


def stop_applications(names: Sequence[str], reason: str, timeout_s: float) -> None:
    """End every open stream of our applications with an error event while
    the HTTP proxy still runs, then wait (up to `timeout_s`) for the
    ingress to have closed them."""
    from ray import serve

    schedulers = {}
    for name in names:
        try:
            h = serve.get_deployment_handle("Scheduler", name)
            ended = h.shutdown_engines.remote(reason).result(timeout_s=timeout_s)
            print(f"preempt-serve: app {name!r}: jobs ended per engine replica: {ended}",
                  flush=True)
            schedulers[name] = h
        except Exception as e:  # not one of ours, or not up yet
            first = str(e).strip().splitlines()[-1:] or [""]
            print(f"preempt-serve: app {name!r}: open streams not ended: "
                  f"{type(e).__name__} {first[0]}", flush=True)
    deadline = time.monotonic() + timeout_s
    for name, h in schedulers.items():
        while time.monotonic() < deadline:
            try:
                if h.stats.remote().result(timeout_s=5)["active_jobs"] == 0:
                    break
            except Exception:
                break
            time.sleep(0.2)


def _serving(names: Sequence[str]) -> bool:
    """Whether any of our applications is still deployed: `serve shutdown`
    from another shell deletes them, and then there is nothing to wait for."""
    from ray import serve

    try:
        apps = serve.status().applications
    except Exception:  # the controller is gone
        return False
    return any(n in apps for n in names)


def serve_main(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    # Before Ray is imported: `serve run` otherwise turns on token auth
    # (README, "Set-up"); a value the user set is kept.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The HTTP proxy's calls to the ingress over Serve's gRPC data plane, as
    # the ingress's own calls go (deployments/handles.py); read by the proxy
    # a local Ray starts from here, so a cluster named by --address keeps its
    # own setting. A value the user set is kept.
    os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    # Import paths resolve against the working directory, as with `serve run`.
    sys.path.insert(0, os.getcwd())

    import ray
    from ray import serve

    ray.init(address=args.address, namespace="serve")
    signals = _Signals()
    signals.install()
    deployed: list[str] = []
    status = 0
    try:
        serve.start(proxy_location=config.proxy_location,
                    http_options=config.http_options.model_dump(),
                    grpc_options=config.grpc_options.model_dump(),
                    logging_config=config.logging_config,
                    controller_options=config.controller_options)
        for app in config.applications:
            target = build_application(app.import_path, app.args)
            deployed.append(app.name)
            serve.run(target, name=app.name, route_prefix=app.route_prefix,
                      logging_config=app.logging_config)
            print(f"preempt-serve: deployed app {app.name!r} successfully", flush=True)
        host, port = config.http_options.host, config.http_options.port
        print(f"preempt-serve: serving on http://{host}:{port} (Ctrl-C to stop)", flush=True)
        while _serving(deployed):
            time.sleep(args.poll_s)
        print("preempt-serve: the applications were deleted from outside "
              "(`serve shutdown`?); stopping", flush=True)
        deployed = []  # nothing of ours left to stop
    except KeyboardInterrupt:
        signals.stopping = True
        print("preempt-serve: stopping", flush=True)
    except CLIError:  # reported by main() once everything is stopped
        signals.stopping = True
        raise
    except Exception as e:
        signals.stopping = True
        print(f"preempt-serve: failed: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        try:
            stop_applications(deployed, SHUTDOWN_REASON, args.shutdown_timeout)
            stop_serve(deployed)
        finally:
            ray.shutdown()  # on a cluster this attached to: only disconnects
    if status == 0:
        print("preempt-serve: stopped", flush=True)
    return status


def stop_serve(ours: Sequence[str]) -> None:
    """Delete our applications; shut Serve down too unless it runs others'
    (on a cluster this command attached to), which keep running."""
    from ray import serve

    others = [name for name in serve.status().applications if name not in ours]
    if not others:
        serve.shutdown()
        return
    for name in ours:
        serve.delete(name)
    print(f"preempt-serve: Serve left running for {', '.join(others)}", flush=True)


# Parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preempt-serve",
        description="Preemptive LLM serving on Ray Serve (FastServe, EconoServe, ConServe).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser(
        "serve", help="run the applications of a Serve config file until Ctrl-C / SIGTERM",
        description="Start the applications of a Serve config file (as `serve run CONFIG` "
                    "does) and block.  Ctrl-C or SIGTERM ends open streams with an error "
                    "event, then deletes the applications and stops Serve (unless it runs "
                    "other applications) and a Ray it started; the exit status is 0.  "
                    "RAY_AUTH_MODE defaults to 'disabled'.")
    s.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                   help=f"Serve config file (default: {DEFAULT_CONFIG})")
    s.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to run on (default: $RAY_ADDRESS, else the local "
                        "cluster running on this machine, else a new local one)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for open streams to end when stopping (default: 10)")
    s.add_argument("--poll-s", type=float, default=5.0, help=argparse.SUPPRESS)
    s.set_defaults(func=serve_main)
    for name, (_, help_) in DELEGATES.items():
        # Parsed by the delegate itself (see main); listed here for --help.
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATES:
        return DELEGATES[argv[0]][0](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except CLIError as e:
        print(f"preempt-serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
