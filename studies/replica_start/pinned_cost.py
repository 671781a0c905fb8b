"""An application's start with its iteration cost timed against pinned.

Deploys the same one-replica application (the embedded SmolLM2 in float32,
FCFS with admission control, which reads the cost model) again and again in
one Ray session, alternating a config without `iteration_cost` (the engine
replica times its model at start, engine/profiler.py) and one with the
figures the first start timed, pinned; each start timed from `serve.run` to
the application's readiness, then the application deleted.

    python -m studies.replica_start.pinned_cost --out studies/replica_start/pinned_cost.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from bench.report import machine_meta, write_report

CONFIG: dict[str, Any] = {
    "model": "embedded:smollm2", "dtype": "float32", "block_size": 16,
    "kv_cache_tokens": 4096, "max_batch_size": 16, "max_batch_tokens": 256,
    "max_model_len": 1024,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.replica_start.pinned_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed and pinned starts each")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from app.builder import build_app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    pin: dict[str, float] | None = None
    starts: list[dict[str, Any]] = []
    # A first start warms the caches (the converted model, the C++
    # operators' build) and gives the figures to pin; it is not counted.
    for i, mode in enumerate(["warm-up"] + ["timed", "pinned"] * a.rounds):
        cfg = dict(CONFIG)
        if mode == "pinned":
            cfg["iteration_cost"] = pin
        t0 = time.monotonic()
        serve.run(build_app(cfg), name=f"s{i}", route_prefix=f"/s{i}")
        seconds = time.monotonic() - t0
        engine = serve.get_deployment_handle("Engine", app_name=f"s{i}").stats.remote().result()
        pin = pin or engine["engine"]["iteration_cost"]
        starts.append({"mode": mode, "seconds": seconds,
                       "source": engine["engine"]["iteration_cost_source"]})
        print(f"{mode:>8}: {seconds:6.1f} s ({starts[-1]['source']})", flush=True)
        serve.delete(f"s{i}")
    serve.shutdown()
    ray.shutdown()
    summary = {m: statistics.median(s["seconds"] for s in starts if s["mode"] == m)
               for m in ("timed", "pinned")}
    print(f"median: timed {summary['timed']:.1f} s, pinned {summary['pinned']:.1f} s")
    write_report({"meta": {**machine_meta(), "config": CONFIG, "pinned": pin},
                  "starts": starts, "median_s": summary}, a.out)


if __name__ == "__main__":
    main()
