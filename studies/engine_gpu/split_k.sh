#!/usr/bin/env bash
# On a GPU machine without Ray (the lent H200s): the batch-invariant GEMM split
# over K (engine/models/matmul_triton.py, TileConfig.split_to), then the whole
# deterministic step with it against the tree before it, the CUDA tests, and
# the serving loop with the replica's young-collection threshold against
# Python's default (engine/gc_heap.py).  Writes at most 8 files to $OUT.
#
#   OUT=/tmp/out OLD=<a tree of the commit before> bash studies/engine_gpu/split_k.sh
#
# TOK and WHEELS: see device_env.sh.
. studies/engine_gpu/device_env.sh

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
serving_loop serving 70 "${LOOP[@]}"
serving_loop 700 70 "${LOOP[@]}" --gc-young 700
loops_summary serving 700
tail -20 "$OUT/sweep.log"
grep -E "graphs|prefill|copy" "$OUT/step.log" | tail -40
