#!/usr/bin/env bash
# One device call that gathers the GPU evidence behind README's op and demo figures: the GPU-marked tests, the
# conditioning, block-stack, attention and GEMM benchmarks and the full-width RL demo. Run from the repository
# root on the H200 image (torch 2.11, triton 3.6) with the diffusers wheel carried in .whl/;
# results land in $OUT (JSON, the demo's PNG, and every step's log in logs.txt). Each step has its own time limit so one slow step cannot starve the rest.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD/src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export FLOWLOCK_COMMIT=${FLOWLOCK_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
    local rc=$?
    { echo "=== $name rc=$rc"; cat "/tmp/$name.log"; } >> "$OUT/logs.txt"
    echo "=== $name rc=$rc $(date -u +%T)"
    tail -n 20 "/tmp/$name.log"
}
# STEPS picks the steps (default: gpu_tests conditioning block demo); *_ARGS add flags to one step.
want() { [[ " ${STEPS:-gpu_tests conditioning block demo} " == *" $1 "* ]]; }
want gpu_tests && step gpu_tests "${GPU_TESTS_S:-170}" python3 -m pytest -m gpu -q -p no:cacheprovider tests
want conditioning && step conditioning "${COND_S:-130}" python3 benchmarks/bench_conditioning.py --skip-gate \
    --out "$OUT/conditioning.json" ${COND_ARGS:-}
want block && step block "${BLOCK_S:-150}" python3 benchmarks/bench_block.py --skip-gate --out "$OUT/block.json" \
    ${BLOCK_ARGS:-}
want attention && step attention "${ATTN_S:-150}" python3 benchmarks/bench_attention.py --skip-gate \
    --out "$OUT/attention.json" ${ATTN_ARGS:-}
want linear && step linear "${LINEAR_S:-150}" python3 benchmarks/bench_linear.py --skip-gate \
    --out "$OUT/linear.json" ${LINEAR_ARGS:-}
want memory_bound && step memory_bound "${MEMORY_BOUND_S:-150}" python3 benchmarks/bench_memory_bound.py --skip-gate \
    --out "$OUT/memory_bound.json" ${MEMORY_BOUND_ARGS:-}
want demo && step demo "${DEMO_S:-90}" python3 -m flowlock demo --device cuda --width full --layers 2 --seq 1024 \
    --json "$OUT/demo_gpu.json" --plot "$OUT/demo_gpu.png"
