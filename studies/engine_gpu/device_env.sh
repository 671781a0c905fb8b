# Sourced by this folder's GPU scripts, on a lent GPU machine (no Ray, no
# pydantic): installs the carried wheels, names SmolLM2's tokenizer files for
# the tests and the loop, and starts $OUT/main.log with the GPU's clocks.
#
# OUT=<folder for the results> (default /tmp/out); WHEELS=<folder of wheels to
# install first> (pydantic, which the image lacks; default .whl); TOK=<folder
# of SmolLM2's tokenizer files> (default .dev/tok).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
TOK=$(realpath "${TOK:-.dev/tok}")
export PREEMPT_SERVE_TEST_TOKENIZER=$TOK PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv | tee "$OUT/main.log"

# The CUDA tests of this folder's sections: cuda_tests <seconds> [more test files].
cuda_tests() {
    local limit=$1
    shift
    timeout "$limit" python3 -m pytest -q -n 8 -p no:cacheprovider \
        tests/engine/test_gpu.py tests/engine/test_attention.py tests/engine/test_fused_triton.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_cuda_graphs_mixed.py \
        tests/engine/test_swap.py tests/engine/test_batch_invariant.py \
        tests/engine/test_matmul_triton.py tests/engine/test_plan_ahead.py \
        tests/engine/test_length_head.py tests/engine/test_device_lists.py \
        tests/engine/test_top_k_top_p_triton.py "$@" \
        -k "triton or gpu or cuda or graph or fused or rotary or rms or side_stream or invariant or head or waits" \
        > "$OUT/pytest.log" 2>&1
}

stamp() { echo "$(date +%T) $*" | tee -a "$OUT/main.log"; }

# One run of the serving loop: serving_loop <name> <seconds> [engine_loop flags],
# its record in /tmp/loop_<name>.json; then loops_summary <name>... puts the
# runs in $OUT/loops.json and prints a line each.
serving_loop() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m studies.engine_gpu.engine_loop --out "/tmp/loop_$name.json" \
        "$@" > "/tmp/loop_$name.log" 2>&1
    stamp "loop $name rc=$?"
}
loops_summary() {
    local runs=() name
    for name in "$@"; do runs+=("/tmp/loop_$name.json"); done
    python3 -m studies.engine_gpu.loops_summary "$OUT" "${runs[@]}"
}
