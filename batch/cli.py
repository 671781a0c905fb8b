"""`preempt-serve batch`: batch files run as Ray Jobs on a running cluster.

    preempt-serve batch submit FILE [--wait]    store FILE, start its Ray Job
    preempt-serve batch status BATCH_ID         the Batch object (JSON)
    preempt-serve batch resume BATCH_ID [--wait]
                                                a new run: only lines without a result
    preempt-serve batch cancel BATCH_ID         stop its Ray Job (results so far stay)

The application (`--app`) and the storage directory come from the Serve
config file (`--config`, default serve_config.yaml: its first application,
and that application's `batch.storage_dir`) unless given.  The Ray Jobs API
is `--address`: default $RAY_ADDRESS, else the local cluster's dashboard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from api.batch import BATCH_ENDPOINTS
from api.config import BatchSettings
from batch.jobs import TERMINAL, JobsUnavailable, RayJobs
from batch.service import BatchConflict, Batches
from batch.store import BatchRecord, BatchStore, TooLarge

DEFAULT_CONFIG = "serve_config.yaml"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"


class BatchCLIError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def _config_app(path: str, explicit: bool) -> tuple[str | None, dict[str, Any]]:
    """The first application of a Serve config file: its name and its
    `batch` settings; nothing when the default file is absent."""
    import yaml

    p = Path(path)
    if not p.is_file():
        if explicit:
            raise BatchCLIError(f"config file not found: {path}")
        return None, {}
    apps = (yaml.safe_load(p.read_text()) or {}).get("applications") or []
    if not apps:
        return None, {}
    return apps[0].get("name"), (apps[0].get("args") or {}).get("batch") or {}


class _Context:
    def __init__(self, args: argparse.Namespace) -> None:
        name, settings = _config_app(args.config or DEFAULT_CONFIG, args.config is not None)
        if args.storage_dir is not None:
            settings = {**settings, "storage_dir": args.storage_dir}
        self.settings = BatchSettings(**settings)
        self.app = args.app or name
        self.address = (args.address or self.settings.jobs_address
                        or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS)
        self.batches = Batches(BatchStore(self.settings.storage_path()), RayJobs(self.address))

    def record(self, batch_id: str) -> BatchRecord:
        record = self.batches.store.batch(batch_id)
        if record is None:
            raise BatchCLIError(f"no batch {batch_id!r} in {self.batches.store.root}")
        return record


def _submit(ctx: _Context, args: argparse.Namespace) -> int:
    if ctx.app is None:
        raise BatchCLIError("no --app, and no application in the Serve config file")
    path = Path(args.file)
    if not path.is_file():
        raise BatchCLIError(f"no file {args.file}")
    ctx.batches.jobs.check()  # before the file is copied in
    try:
        input_file = ctx.batches.store.copy_input(path, ctx.settings.max_file_bytes,
                                                  ctx.settings.upload_expiry_s())
    except TooLarge as e:
        raise BatchCLIError(f"{args.file}: {e}") from None
    metadata = dict(_pair(m) for m in args.metadata) or None
    record = ctx.batches.create(input_file, args.endpoint, ctx.app,
                                args.max_concurrency or ctx.settings.max_concurrency,
                                metadata=metadata, window_s=ctx.settings.window_s())
    print(f"batch {record.id}: {record.total} lines for app {record.app!r} "
          f"({record.endpoint}); Ray Job {record.jobs[-1]}", flush=True)
    return _wait(ctx, record) if args.wait else 0


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise BatchCLIError(f"--metadata takes KEY=VALUE, not {text!r}")
    return key, value


def _status(ctx: _Context, args: argparse.Namespace) -> int:
    record = ctx.record(args.batch_id)
    obj = ctx.batches.describe(record)
    out, err = ctx.batches.result_paths(record)
    print(json.dumps({**obj.model_dump(), "output_path": str(out), "error_path": str(err)},
                     indent=2))
    return 0


def _resume(ctx: _Context, args: argparse.Namespace) -> int:
    record = ctx.batches.resume(ctx.record(args.batch_id), args.max_concurrency)
    print(f"batch {record.id}: resumed as Ray Job {record.jobs[-1]}", flush=True)
    return _wait(ctx, record) if args.wait else 0


def _cancel(ctx: _Context, args: argparse.Namespace) -> int:
    record = ctx.batches.cancel(ctx.record(args.batch_id))
    print(f"batch {record.id}: stop requested; `preempt-serve batch resume {record.id}` "
          "continues it", flush=True)
    return 0


def _wait(ctx: _Context, record: BatchRecord, poll_s: float = 1.0) -> int:
    """Until the run ends, a line each time the counts move; then the
    result paths.  Status 0 when the batch completed."""
    last = None
    while True:
        # Read again: the run writes its expiry there.
        record = ctx.batches.store.batch(record.id) or record
        job = ctx.batches.latest_job(record)
        obj = ctx.batches.describe(record, job, known=True)
        c = obj.request_counts
        now = (obj.status, c.completed, c.failed)
        if now != last:
            print(f"{obj.status}: {c.completed} completed, {c.failed} failed of {c.total}",
                  flush=True)
            last = now
        if job is None or job.status in TERMINAL:
            break
        time.sleep(poll_s)
    out, err = ctx.batches.result_paths(record)
    print(f"output: {out}\nerrors: {err}", flush=True)
    if obj.status != "completed":
        why = obj.errors.data[0].message if obj.errors and obj.errors.data else obj.status
        print(f"batch {record.id} {obj.status}: {why}", file=sys.stderr, flush=True)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None,
                        help="Ray Jobs API: dashboard URL or cluster address (default: the "
                             f"app's batch.jobs_address, else $RAY_ADDRESS, else "
                             f"{DEFAULT_ADDRESS})")
    common.add_argument("--config", default=None,
                        help=f"Serve config file naming the app and its batch settings "
                             f"(default: {DEFAULT_CONFIG} if present)")
    common.add_argument("--storage-dir", default=None,
                        help="batch storage directory (default: the app's batch.storage_dir, "
                             "else `batches` in the cache directory: $PREEMPT_SERVE_CACHE, "
                             "$XDG_CACHE_HOME/preempt-serve or ~/.cache/preempt-serve); the "
                             "server's own")
    p = argparse.ArgumentParser(prog="preempt-serve batch", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("submit", parents=[common],
                       help="store an OpenAI Batch JSONL file and start its Ray Job")
    s.add_argument("file", help="JSONL: one {custom_id, method, url, body} per line")
    s.add_argument("--app", default=None, help="Serve application (default: the config's first)")
    s.add_argument("--endpoint", choices=BATCH_ENDPOINTS, default=None,
                   help="the url every line must name (default: the first line's)")
    s.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="requests in flight at once (default: the app's batch.max_concurrency)")
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true",
                   help="wait for the job, then print the output and error file paths")
    s.set_defaults(func=_submit)
    s = sub.add_parser("status", parents=[common], help="the Batch object, as JSON")
    s.add_argument("batch_id")
    s.set_defaults(func=_status, app=None)
    s = sub.add_parser("resume", parents=[common],
                       help="run a batch again, only its lines without a result (refused "
                            "while it runs, and once expired)")
    s.add_argument("batch_id")
    s.add_argument("--max-concurrency", type=int, default=None, metavar="N")
    s.add_argument("--wait", action="store_true")
    s.set_defaults(func=_resume, app=None)
    s = sub.add_parser("cancel", parents=[common], help="stop a batch's Ray Job")
    s.add_argument("batch_id")
    s.set_defaults(func=_cancel, app=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_concurrency", None) is not None and args.max_concurrency < 1:
        print("preempt-serve batch: error: --max-concurrency must be at least 1",
              file=sys.stderr)
        return 2
    try:
        return int(args.func(_Context(args), args))
    except (BatchCLIError, BatchConflict) as e:
        print(f"preempt-serve batch: error: {e}", file=sys.stderr)
        return 2
    except JobsUnavailable as e:
        print(f"preempt-serve batch: error: {e} (is the cluster's dashboard up? --address)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
