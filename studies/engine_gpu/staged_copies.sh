#!/usr/bin/env bash
# On a GPU machine without Ray (the lent H200s), one call, most wanted first:
# the CUDA tests (among them whether the host still waits for the pass in
# flight now that small host lists go through page-locked memory,
# engine/device_lists.py, and top-k / top-p rows are cut without a read-back,
# engine/top_k_top_p.py); the cost of that cut on the device, searched and
# sorted; the whole step, default and deterministic, with deterministic
# attention's query tiles of 16 and of 64 rows, prefills up to 8,192 tokens;
# from how many rows the deterministic GEMM's larger tile pays; then where the
# loop still makes the host wait for the GPU (engine_loop --sync-sites,
# sync_sites.py), and MLFQ with proactive swaps with and without async
# scheduling. What a timeout cuts short is last.
#
#   OUT=/tmp/out bash studies/engine_gpu/staged_copies.sh
#
# Its limits add up to 690 s, more than one call to a lent machine may run
# (600 s) and more files than one call brings back (8): STAGE=1 runs the tests,
# the sampler and the step (410 s, 6 files), STAGE=2 the matmul's rows and the
# loops (280 s, 4 files), two calls on the same warm machine.
#
# TOK and WHEELS: see device_env.sh.
. studies/engine_gpu/device_env.sh

STAGE=${STAGE:-all}
if [ "$STAGE" != 2 ]; then
cuda_tests 150
stamp "pytest rc=$?"
tail -2 "$OUT/pytest.log"

# The sampler on the device (Llama 3's vocabulary): the cut chosen on the host
# against the candidate cut that reads back which rows need a sort, and the
# top-k / top-p cut alone by the threshold search (engine/top_k_top_p_triton.py)
# and by a sort.
timeout 60 python3 -m bench.sampling_bench --device cuda --batch 1,8,32,128 --vocab 128256 \
    --scales 3 --reps 21 --out "$OUT/sampling.json" > /tmp/sampling.log 2>&1
stamp "sampling rc=$?"

# The whole step, default and deterministic (query tiles of 16 and 64 rows).
timeout 200 python3 -m bench.gpu_step --out "$OUT/gpu_step.json" --no-hf \
    --backends triton,triton-det,triton-det64 --prefill-lens 512,2048,8192 \
    > "$OUT/step.log" 2>&1
stamp "step rc=$?"
grep -E "graphs|prefill|copy" "$OUT/step.log" | tail -40
grep -E "top_p|top_k|Error" /tmp/sampling.log
fi
[ "$STAGE" = 1 ] && exit 0

# From how many rows the deterministic GEMM's larger tile pays (LARGE_ROWS,
# 512 a guess): a prefill's matmuls of the 8B shape at 128 to 2,048 rows.
timeout 60 python3 -m studies.engine_gpu.invariant_matmul --large-rows \
    --out "$OUT/large_rows.json" > /tmp/large_rows.log 2>&1
stamp "large rows rc=$?"
cat /tmp/large_rows.log

# The rule that gained nothing from async scheduling on the H200 (MLFQ with
# proactive swaps), without and with it; 2,000 requests, Llama-3.2-1B shape.
LOOP=(--requests 2000 --timeout 75 --policy mlfq --swap-mode proactive --tokenizer "$TOK")
# First, 500 of them with every synchronizing CUDA call counted by its site.
serving_loop sites 60 "${LOOP[@]}" --ahead --sync-sites --requests 500
cp /tmp/loop_sites.json "$OUT/sync_sites.json"
python3 -c "import json; r = json.load(open('$OUT/sync_sites.json')); \
print(r.get('syncs_per_iteration'), r.get('sync_sites', {}).get('by_site', [])[:12])"
serving_loop sync 80 "${LOOP[@]}"
serving_loop ahead 80 "${LOOP[@]}" --ahead
loops_summary sync ahead
