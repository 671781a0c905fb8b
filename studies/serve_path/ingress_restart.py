"""Whether a server comes back after its ingress replica dies, on each HTTP entry.

Each round sends `--requests` one-token completions to `--port` (urllib: one connection each,
closed by the server, which leaves the port's side of each in TIME_WAIT), kills the ingress
replica's actor (`ray.kill`, as a crash would end it; Serve starts another), then polls
/health on every entry until each answers 200 or `--wait-s` passes. Run it with the server's
RAY_AUTH_MODE.

    python -m studies.serve_path.ingress_restart --port 8100 --entries proxy=8000,direct=8100 \\
        --out studies/serve_path/direct_ingress/restart.json   # direct_ingress.sh runs it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from studies.serve_path.idle_hops import parse_entries, send


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def kill_ingress(app: str) -> str:
    import ray
    from ray.util.state import list_actors

    if not ray.is_initialized():
        ray.init(address="auto", namespace="serve", logging_level="ERROR")
    name = next(a.name for a in list_actors(filters=[("state", "=", "ALIVE")])
                if (a.name or "").startswith(f"SERVE_REPLICA::{app}#Ingress#"))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
    return name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.serve_path.ingress_restart",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8100, help="the entry the requests go to")
    ap.add_argument("--entries", default="proxy=8000,direct=8100", help="NAME=PORT,…")
    ap.add_argument("--app", default="llm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--wait-s", type=float, default=90.0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    entries = parse_entries(a.entries)
    rounds: list[dict[str, Any]] = []
    for i in range(a.rounds):
        if not all(healthy(p) for p in entries.values()):
            rounds.append({"round": i + 1, "skipped": "not every entry was healthy"})
            break
        for _ in range(a.requests):
            send(a.port, [1000, 2000, 3000])
        killed, start = kill_ingress(a.app), time.monotonic()
        time.sleep(1.0)  # the actor is gone before the first poll
        back: dict[str, float | None] = {name: None for name in entries}
        while time.monotonic() - start < a.wait_s and None in back.values():
            for name, port in entries.items():
                if back[name] is None and healthy(port):
                    back[name] = round(time.monotonic() - start, 1)
            time.sleep(0.5)
        rounds.append({"round": i + 1, "killed": killed, "back_after_s": back})
        print(f"round {i + 1}: killed {killed}; back after (s): {back}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "command": "python -m studies.serve_path.ingress_restart " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "wait_s": a.wait_s, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
