"""Log the Engine deployment's running replicas once a second (JSON lines
of time and count) until killed; for studies/autoscale/bursty.sh and
coserve.sh.  With `--tokens`, also each line's tokens generated so far by
job class, summed over the replicas that answer (a replica let go takes
its counts with it)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
from ray import serve


def _tokens(source: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in source.engines():
        for cls, n in (st.get("tokens_by_class") or {}).items():
            out[cls] = out.get(cls, 0) + int(n)
    return out


def main() -> None:
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    source = None
    if "--tokens" in sys.argv[2:]:
        from bench.server_stats import RayStatsSource

        source = RayStatsSource(timeout_s=5.0)
    with open(sys.argv[1], "a") as f:
        while True:
            line: dict[str, Any] = {"time": time.time()}
            try:
                dep = serve.status().applications["llm"].deployments["Engine"]
                line["running"] = dep.replica_states.get("RUNNING", 0)
                if source is not None:
                    line["tokens_by_class"] = _tokens(source)
            except Exception:  # the application is not up (yet, or any more)
                line.setdefault("running", -1)
            f.write(json.dumps(line) + "\n")
            f.flush()
            time.sleep(1.0)


if __name__ == "__main__":
    main()
