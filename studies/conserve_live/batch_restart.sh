#!/usr/bin/env bash
# A batch job survives the death of the engine replica (issue 17: "resumes
# after a replica restart"): the conserve configuration, the 40-line batch
# file of batch.sh submitted with --wait, and the Engine replica's actor
# killed KILL_AFTER seconds in.  Serve starts a new replica; the job retries
# the requests that failed with it (503) and must end with every line
# answered once.  Writes $OUT/batch-restart.{log,kill.log,output.jsonl,check.json}.
# Usage: bash studies/conserve_live/batch_restart.sh   (env OUT, KILL_AFTER)
set -euo pipefail
cd "$(dirname "$0")/../.."
export RAY_AUTH_MODE=disabled
OUT=${OUT:-studies/conserve_live}; KILL_AFTER=${KILL_AFTER:-40}
CFG=studies/configs/coserve_conserve.yaml
source studies/serve_lib.sh
trap stop_server EXIT
[ -f "$OUT/conserve-batch.input.jsonl" ] ||
  python -m studies.conserve_live.batch make-file "$OUT/conserve-batch.input.jsonl" 40
start_server "$CFG" "$OUT/batch-restart.server.log"
preempt-serve batch submit "$OUT/conserve-batch.input.jsonl" --config "$CFG" --wait \
  > "$OUT/batch-restart.log" 2>&1 &
submit=$!
sleep "$KILL_AFTER"
python - <<'EOF' > "$OUT/batch-restart.kill.log" 2>&1
import ray
from ray.util.state import list_actors

ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
engines = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
           if "ServeReplica:llm:Engine" in (a.class_name or "")]
assert len(engines) == 1, engines
ray.kill(ray.get_actor(engines[0].name, namespace=engines[0].ray_namespace), no_restart=True)
print("killed the Engine replica", engines[0].name, flush=True)
EOF
wait "$submit" || true
cat "$OUT/batch-restart.kill.log" "$OUT/batch-restart.log"
grep -a "failed in the engine: ActorDied" "$OUT/batch-restart.server.log" | wc -l |
  xargs echo "requests that failed with the replica:"
out=$(grep -o '/[^ ]*output.jsonl' "$OUT/batch-restart.log" | tail -1)
cp "$out" "$OUT/batch-restart.output.jsonl"
python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
lines = [json.loads(x) for x in (out / "batch-restart.output.jsonl").read_text().splitlines()
         if x.strip()]
wanted = [json.loads(x)["custom_id"] for x in
          (out / "conserve-batch.input.jsonl").read_text().splitlines() if x.strip()]
ids = [o["custom_id"] for o in lines]
ok = [o for o in lines if o["response"] and o["response"]["status_code"] == 200]
check = {"lines": len(lines), "answered_200": len(ok), "unique_custom_ids": len(set(ids)),
         "all_answered_once": sorted(ids) == sorted(wanted) and len(ok) == len(wanted)}
ref = out / "conserve-batch.output.jsonl"  # batch.sh's run, never interrupted
if ref.exists():
    def texts(p):
        return {o["custom_id"]: o["response"]["body"]["choices"][0]["text"]
                for o in map(json.loads, p.read_text().splitlines()) if o.get("response")}
    a, b = texts(out / "batch-restart.output.jsonl"), texts(ref)
    check["texts_equal_to_the_uninterrupted_batch"] = sum(1 for k in a if a[k] == b.get(k))
(out / "batch-restart.check.json").write_text(json.dumps(check, indent=1))
print(json.dumps(check))
EOF
