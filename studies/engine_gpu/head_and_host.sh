#!/usr/bin/env bash
# On a GPU machine without Ray (the lent H200s): the serving loop with and
# without the length head (engine/length_head.py) and with the start-up heap
# left to the garbage collector (engine/gc_heap.py), a py-spy profile of
# the loop's host side, then the CUDA tests.  Writes at most 8 files to $OUT.
#
#   OUT=/tmp/out bash studies/engine_gpu/head_and_host.sh
#
# Optional: OLD=<folder> holding another tree of the packages (the commit
# before a change) runs the length-head loop there too, for a side-by-side
# pair; PYSPY=<path of py-spy>; TOK and WHEELS: see device_env.sh.
ROOT=$PWD
. studies/engine_gpu/device_env.sh

# 2,000 requests at once, Llama-3.2-1B shape in bf16, FCFS, async scheduling.
LOOP=(--requests 2000 --timeout 75 --policy fcfs --swap-mode recompute --ahead
      --tokenizer "$TOK")
loop() {  # name, tree, extra args
    local name=$1 tree=$2
    shift 2
    (cd "$tree" && timeout 130 python3 -m studies.engine_gpu.engine_loop \
        --out "$OUT/$name.json" "${LOOP[@]}" "$@" > "/tmp/$name.log" 2>&1)
    echo "$name rc=$?" | tee -a "$OUT/main.log"
    tail -3 "/tmp/$name.log" >> "$OUT/main.log"
}
# Interleaved with the other tree's runs, where there is one.
loop loop_nohead "$ROOT"
if [ -n "${OLD:-}" ]; then loop loop_nohead_old "$OLD"; fi
loop loop_head "$ROOT" --length-head
if [ -n "${OLD:-}" ]; then loop loop_head_old "$OLD" --length-head; fi
loop loop_nohead_nofreeze "$ROOT" --no-gc-freeze

if [ -n "${PYSPY:-}" ]; then
    timeout 130 "$PYSPY" record --nonblocking --threads --rate 250 --format raw \
        -o "$OUT/pyspy_loop.txt" -- python3 -m studies.engine_gpu.engine_loop \
        --out /tmp/pyspy_loop.json "${LOOP[@]}" > /tmp/pyspy.log 2>&1
    echo "py-spy rc=$?" | tee -a "$OUT/main.log"
    tail -5 /tmp/pyspy.log >> "$OUT/main.log"
    cp /tmp/pyspy_loop.json "$OUT/" 2>/dev/null
fi

cuda_tests 200 tests/predictor/test_service.py tests/predictor/test_train.py
echo "pytest rc=$?" | tee -a "$OUT/main.log"
tail -3 "$OUT/pytest.log"

python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
keys = ("output_tokens_per_s", "wall_s", "iterations", "passes_op_by_op", "all_finished",
        "free_blocks_after", "num_blocks", "gc")
for f in sorted(out.glob("*.json")):
    d = json.loads(f.read_text())
    print(f.stem, {k: round(d[k], 2) if isinstance(d.get(k), float) else d.get(k) for k in keys},
          "ttft", {k: round(v, 2) for k, v in d["ttft_s"].items()})
EOF
