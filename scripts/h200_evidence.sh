#!/usr/bin/env bash
# One device call that gathers the GPU evidence for issues 2-4: the GPU-marked tests, the
# conditioning and block-stack benchmarks and the full-width RL demo. Run from the repository
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
step gpu_tests "${GPU_TESTS_S:-170}" python3 -m pytest -m gpu -q -p no:cacheprovider tests
step conditioning "${COND_S:-130}" python3 benchmarks/bench_conditioning.py --skip-gate --out "$OUT/conditioning.json"
step block "${BLOCK_S:-150}" python3 benchmarks/bench_block.py --skip-gate --out "$OUT/block.json"
step demo "${DEMO_S:-90}" python3 -m flowlock demo --device cuda --width full --layers 2 --seq 1024 \
    --json "$OUT/demo_gpu.json" --plot "$OUT/demo_gpu.png"
