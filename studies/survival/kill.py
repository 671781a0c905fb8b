"""Kill one engine replica of the running application `llm` (`ray.kill`, as
a crashed process would die); or, with --stats, print the Scheduler's and
the engines' figures.  Prints JSON with the time (time.time()) it acted."""

from __future__ import annotations

import json
import sys
import time

import ray
from ray import serve
from ray.util import list_named_actors


def engines() -> list[str]:
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and "SERVE_REPLICA::llm#Engine#" in a["name"])


def main() -> None:
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    if "--stats" in sys.argv:
        sched = serve.get_deployment_handle("Scheduler", app_name="llm").stats.remote().result()
        print(json.dumps({"time": time.time(), "engines": engines(),
                          "resumed": sched.get("resumed"), "outcomes": sched.get("outcomes"),
                          "engine_stats": _engine_stats()}))
        return
    victims = engines()
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=False)
    print(json.dumps({"time": time.time(), "killed": victims[0], "engines": victims}))


def _engine_stats() -> list[dict[str, object]]:
    """Each live engine replica's resume figures (Serve routes each call to
    some replica: enough calls reach both)."""
    handle = serve.get_deployment_handle("Engine", app_name="llm")
    seen: dict[str, dict[str, object]] = {}
    for _ in range(16):
        st = handle.stats.remote().result()
        seen[str(st["replica"])] = {"replica": st["replica"], "resumed": st.get("resumed"),
                                    "tokens_out": st.get("tokens_out")}
    return list(seen.values())


if __name__ == "__main__":
    main()
