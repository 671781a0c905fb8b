"""Kill one engine replica of the running application `llm` (`ray.kill`, as
a crashed process would die); or, with --stats, print the Scheduler's and
the engines' figures.  Prints JSON with the time (time.time()) it acted."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
from ray import serve
from ray.util import list_named_actors


def engines() -> list[str]:
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and "SERVE_REPLICA::llm#Engine#" in a["name"])


def main() -> None:
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    if "--stats" in sys.argv:
        # Bounded: a driver whose RAY_AUTH_MODE is not the server's gets no
        # answer (README.md, the live bench commands' auth mode).
        sched = serve.get_deployment_handle("Scheduler", app_name="llm").stats.remote().result(
            timeout_s=60.0)
        print(json.dumps({"time": time.time(), "engines": engines(),
                          "resumed": sched.get("resumed"), "outcomes": sched.get("outcomes"),
                          "engine_stats": _engine_stats()}))
        return
    victims = engines()
    # What the victim's death is about to cost: its resident jobs' tokens
    # past their last checkpoint, read a moment before the kill.  The
    # victim is a replica whose figures came back (Serve may route every
    # call to one of them).
    before = {r: st.get("survival") for r, st in replica_stats(16).items()}
    victim = next((v for v in victims if _replica_id(v) in before), victims[0])
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
    print(json.dumps({"time": time.time(), "killed": victim, "engines": victims,
                      "exposure": before.get(_replica_id(victim)),
                      "exposure_by_replica": before}))


def _replica_id(actor_name: str) -> str:
    """`SERVE_REPLICA::llm#Engine#<id>` -> `<id>`, as `Engine.stats()` names it."""
    return actor_name.rsplit("#", 1)[-1]


def replica_stats(calls: int, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """`Engine.stats()` of each live engine replica that `calls` calls
    reached (Serve routes each call to some replica: enough calls reach
    each); a call that fails (a replica dying or starting) is skipped."""
    handle = serve.get_deployment_handle("Engine", app_name="llm")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(calls):
        try:
            st = handle.stats.remote().result(timeout_s=timeout_s)
        except Exception:
            continue
        seen[str(st["replica"])] = st
    return seen


def _engine_stats() -> list[dict[str, object]]:
    """Each live engine replica's resume and survival figures."""
    return [{"replica": st["replica"], "resumed": st.get("resumed"),
             "tokens_out": st.get("tokens_out"), "survival": st.get("survival")}
            for st in replica_stats(16).values()]


if __name__ == "__main__":
    main()
