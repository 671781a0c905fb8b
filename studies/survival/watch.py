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

from studies.survival.kill import replica_stats


def main() -> None:
    out = sys.argv[1]
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    with open(out, "a") as f:
        while True:
            t = time.time()
            # Six calls: enough to reach both replicas most samples.
            for r, st in replica_stats(6, timeout_s=10).items():
                f.write(json.dumps({
                    "t": t, "replica": r, "running": st["num_running"],
                    "waiting": st["num_waiting"],
                    "kv_use": round(1 - st["free_blocks"] / st["num_blocks"], 4),
                    "host_used_blocks": st["swap"]["host_used_blocks"],
                    **(st.get("survival") or {})}) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.time() - t)))


if __name__ == "__main__":
    main()
