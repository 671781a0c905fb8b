"""Sample every engine replica's survival figures while a run goes on: the
tokens of its resident jobs past their last checkpoint (what its death at
that moment would make the other replica recompute) and the host copies
still queued on its tier's thread.  One JSON line per replica and sample.

    python -m studies.survival.watch OUT.jsonl [INTERVAL_S]

Runs until killed (replica_kill.sh starts and stops it).
"""

from __future__ import annotations

import json
import sys
import time

import ray
from ray import serve


def main() -> None:
    out = sys.argv[1]
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    handle = serve.get_deployment_handle("Engine", app_name="llm")
    with open(out, "a") as f:
        while True:
            t = time.time()
            seen: dict[str, dict[str, object]] = {}
            # Serve routes each call to some replica: a few calls reach both.
            for _ in range(6):
                try:
                    st = handle.stats.remote().result(timeout_s=10)
                except Exception:  # a replica dying or starting: next sample
                    continue
                seen[str(st["replica"])] = {
                    "t": t, "replica": st["replica"], "running": st["num_running"],
                    "waiting": st["num_waiting"],
                    "kv_use": round(1 - st["free_blocks"] / st["num_blocks"], 4),
                    "host_used_blocks": st["swap"]["host_used_blocks"],
                    **(st.get("survival") or {})}
            for row in seen.values():
                f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.time() - t)))


if __name__ == "__main__":
    main()
