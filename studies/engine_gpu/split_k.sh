#!/usr/bin/env bash
# On a GPU machine without Ray (the lent H200s): the batch-invariant GEMM split
# over K (engine/models/matmul_triton.py, TileConfig.split_to), then the whole
# deterministic step with it against the tree before it, the CUDA tests, and
# the serving loop with the replica's young-collection threshold against
# Python's default (deployments/gc_heap.py).  Writes at most 8 files to $OUT.
#
#   OUT=/tmp/out OLD=<a tree of the commit before> bash studies/engine_gpu/split_k.sh
#
# TOK and WHEELS: see device_env.sh.
. studies/engine_gpu/device_env.sh
stamp() { echo "$(date +%T) $*" | tee -a "$OUT/main.log"; }

stamp sweep
timeout 120 python3 -m studies.engine_gpu.invariant_matmul --splits-only \
    --out "$OUT/invariant_matmul_split.json" > "$OUT/sweep.log" 2>&1
stamp "sweep rc=$?"

# The whole step: this tree (split) and the tree before it (no split), default
# and deterministic, decode and prefill, no Hugging Face reference.
STEP=(--no-hf --backends triton,triton-det)
timeout 140 python3 -m bench.gpu_step --out "$OUT/gpu_step_split.json" "${STEP[@]}" \
    > "$OUT/step.log" 2>&1
stamp "step rc=$?"
if [ -n "${OLD:-}" ]; then
    (cd "$OLD" && timeout 120 python3 -m bench.gpu_step --out /tmp/gpu_step_old.json \
        --no-hf --backends triton-det > /tmp/step_old.log 2>&1)
    stamp "step old rc=$?"
    { echo "== before the split"; cat /tmp/step_old.log; } >> "$OUT/step.log"
fi

cuda_tests 150
stamp "pytest rc=$?"
tail -2 "$OUT/pytest.log"

# 2,000 requests at once, Llama-3.2-1B shape in bf16, FCFS, async scheduling:
# the replica's young threshold (the study's default) against Python's 700.
LOOP=(--requests 2000 --timeout 75 --policy fcfs --swap-mode recompute --ahead
      --tokenizer "$TOK")
for name in serving 700; do
    extra=()
    [ "$name" = 700 ] && extra=(--gc-young 700)
    timeout 70 python3 -m studies.engine_gpu.engine_loop --out "/tmp/loop_$name.json" \
        "${LOOP[@]}" "${extra[@]}" > "/tmp/loop_$name.log" 2>&1
    stamp "loop $name rc=$?"
done
python3 - "$OUT" /tmp/loop_serving.json /tmp/loop_700.json <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sys.argv[2:]:
    p = pathlib.Path(f)
    if p.exists():
        rows[p.stem] = json.loads(p.read_text())
(out / "loops.json").write_text(json.dumps(rows, indent=1))
keys = ("output_tokens_per_s", "wall_s", "iterations", "all_finished", "free_blocks_after",
        "num_blocks", "gc_thresholds", "gc")
for name, d in rows.items():
    print(name, {k: round(d[k], 2) if isinstance(d.get(k), float) else d.get(k) for k in keys},
          "ttft", {k: round(v, 2) for k, v in d["ttft_s"].items()})
EOF
tail -20 "$OUT/sweep.log"
grep -E "graphs|prefill|copy" "$OUT/step.log" | tail -40
