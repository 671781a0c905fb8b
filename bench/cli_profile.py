"""`python -m bench profile` and `profile-live`: cost tables of our engine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def cmd_profile(a: argparse.Namespace) -> int:
    from bench.profiler import ProfileConfig, profile, quick_config

    kw: dict[str, Any] = dict(model=a.model, dtype=a.dtype, device=a.device, num_threads=a.threads,
                              block_size=a.block_size, repeats=a.repeats)
    for k in ("prefill_lens", "decode_batches", "contexts"):
        if getattr(a, k):
            kw[k] = getattr(a, k)
    cfg = quick_config(**kw) if a.quick else ProfileConfig(**kw)
    _write(profile(cfg), a.out)
    print(f"wrote {a.out}")
    return 0


def _write(table: Any, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table.model_dump_json(indent=1))


def engine_handle(a: argparse.Namespace) -> Any:
    """The `Engine` deployment of a running server (`add_server_args`)."""
    import ray
    from ray import serve

    ray.init(address=a.address, logging_level="ERROR")
    return serve.get_deployment_handle("Engine", app_name=a.app)


def answer(response: Any, what: str, timeout_s: float) -> Any:
    """A handle call's result, or an exit that says what to check. A driver
    whose RAY_AUTH_MODE differs from the cluster's reaches the replicas, but
    the answers to its actor-task calls never reach it: without a bound the
    command would hang."""
    try:
        return response.result(timeout_s=timeout_s)
    except TimeoutError:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        raise SystemExit(
            f"bench: no answer to {what} in {timeout_s:g} s. Run this command with the "
            f"RAY_AUTH_MODE the server's Ray started with (here it is {mode}): answers "
            "cannot reach a process whose mode differs. Or the replica is busy: raise "
            "--call-timeout.") from None


def add_server_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--address", default="auto", help="Ray cluster of the server")
    q.add_argument("--app", default="llm", help="Serve application name")


def add_call_args(q: argparse.ArgumentParser) -> None:
    """`add_server_args` for a command that calls the engine replica itself."""
    add_server_args(q)
    q.add_argument("--call-timeout", type=float, default=120.0,
                   help="seconds to wait for each answer from the engine replica")


def cmd_profile_live(a: argparse.Namespace) -> int:
    from bench.costtable import CostTable
    from bench.profiler import table_from_iterations

    rows = answer(engine_handle(a).iteration_log.remote(), "Engine.iteration_log",
                  a.call_timeout)
    swaps = []
    if a.swaps_from is not None:
        swaps = CostTable.model_validate_json(a.swaps_from.read_text()).swaps
    table = table_from_iterations(rows, model=a.model, device=a.device, dtype=a.dtype,
                                  num_threads=a.threads, block_size=a.block_size, swaps=swaps)
    _write(table, a.out)
    print(f"{len(rows)} iterations; fit error {table.fit_error:.3f}; wrote {a.out}")
    return 0


def _add_engine_args(q: argparse.ArgumentParser) -> None:
    """What the table describes (the engine as the server runs it)."""
    q.add_argument("--model", default="embedded:smollm2")
    q.add_argument("--dtype", default="auto", help="auto: as the server resolves it")
    q.add_argument("--device", default="cpu")
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--block-size", type=int, default=16)


def add_profile_parsers(sub: Any) -> None:
    q = sub.add_parser("profile", help="measure our engine; write a cost table JSON")
    _add_engine_args(q)
    q.add_argument("--repeats", type=int, default=3)
    q.add_argument("--prefill-lens", type=int, nargs="+", default=None)
    q.add_argument("--decode-batches", type=int, nargs="+", default=None)
    q.add_argument("--contexts", type=int, nargs="+", default=None)
    q.add_argument("--quick", action="store_true", help="small grid")
    q.add_argument("--out", type=Path, default=Path("runs/cost_table.json"))
    q.set_defaults(func=cmd_profile)

    q = sub.add_parser("profile-live", help="a cost table from the iterations a running server "
                                             "recorded (one engine replica)")
    add_call_args(q)
    _add_engine_args(q)
    q.add_argument("--swaps-from", type=Path, default=None,
                   help="take the swap measurements of this cost table (`profile`)")
    q.add_argument("--out", type=Path, default=Path("runs/cost_table_live.json"))
    q.set_defaults(func=cmd_profile_live)
