"""Log the Engine deployment's running replicas once a second (JSON lines
of time and count) until killed; for studies/autoscale/bursty.sh."""

from __future__ import annotations

import json
import sys
import time

import ray
from ray import serve


def main() -> None:
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    with open(sys.argv[1], "a") as f:
        while True:
            try:
                dep = serve.status().applications["llm"].deployments["Engine"]
                n = dep.replica_states.get("RUNNING", 0)
            except Exception:  # the application is not up (yet, or any more)
                n = -1
            f.write(json.dumps({"time": time.time(), "running": n}) + "\n")
            f.flush()
            time.sleep(1.0)


if __name__ == "__main__":
    main()
