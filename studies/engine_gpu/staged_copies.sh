#!/usr/bin/env bash
# On a GPU machine without Ray (the lent H200s), one call: whether the host
# still waits for the pass in flight now that small host lists go through
# page-locked memory (engine/device_lists.py) and top-k / top-p cut rows chosen
# on the host (engine/top_k_top_p.py, top_k_top_p_without_waiting); the cost of
# that cut on the device, searched and sorted; and the whole deterministic step
# with the larger tile for large batches (InvariantLinear). Writes at most 8
# files to $OUT.
#
#   OUT=/tmp/out bash studies/engine_gpu/staged_copies.sh
#
# TOK and WHEELS: see device_env.sh.
. studies/engine_gpu/device_env.sh

cuda_tests 150
stamp "pytest rc=$?"
tail -2 "$OUT/pytest.log"

# The rule that gained nothing from async scheduling on the H200 (MLFQ with
# proactive swaps), without and with it; 2,000 requests, Llama-3.2-1B shape.
LOOP=(--requests 2000 --timeout 75 --policy mlfq --swap-mode proactive --tokenizer "$TOK")
serving_loop sync 80 "${LOOP[@]}"
serving_loop ahead 80 "${LOOP[@]}" --ahead
loops_summary sync ahead

# The sampler on the device: the cut chosen on the host against the candidate
# cut that reads back which rows need a sort, and the top-k / top-p cut alone
# searched (engine/top_k_top_p_triton.py) against sorted (Llama 3's and SmolLM2's
# vocabularies).
for vocab in 128256 49152; do
    timeout 75 python3 -m bench.sampling_bench --device cuda --batch 1,8,32,128 --vocab "$vocab" \
        --scales 3 --reps 21 --out "$OUT/sampling_$vocab.json" > "/tmp/sampling_$vocab.log" 2>&1
    stamp "sampling $vocab rc=$?"
    cat "/tmp/sampling_$vocab.log" >> "$OUT/sampling.log"
done

# The whole step, default and deterministic, decode and prefill.
timeout 150 python3 -m bench.gpu_step --out "$OUT/gpu_step.json" --no-hf \
    --backends triton,triton-det > "$OUT/step.log" 2>&1
stamp "step rc=$?"
grep -E "graphs|prefill|copy" "$OUT/step.log" | tail -40
cat "$OUT/sampling.log"
