#!/usr/bin/env bash
# One device call (one H200, at most 10 minutes) of the full-depth model benchmark (benchmarks/bench_model.py). Run from
# the repository root on the H200 image (torch 2.11, triton 3.6) with the diffusers wheel carried in
# .whl/, at a commit whose CPU gate (tests/models) passed: the jobs run with --skip-gate.
#
# JOBS: benchmark processes run one after another, each "S[,S...][:MEASURES]" (measures default
# forward,step), e.g. JOBS="925,4253" or JOBS="8349 16384:forward". VARIANTS (default: the
# benchmark's, all seven on CUDA) and MODEL_ARGS go to every job. Each job writes $OUT/model_<job>.json, rewritten after every S so that a job stopped at
# its limit keeps its finished rows, and $OUT/model_<job>.log. All jobs stop by BUDGET_S (default
# 560 s, inside the call's 600). Join the JSONs of several calls with bench_model.py --merge.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD/src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export FLOWLOCK_COMMIT=${FLOWLOCK_COMMIT:-unknown}
# Weights and gradients of the 33B model take ~123 GiB of the 140: segments that grow in place keep
# freed blocks from being stranded between variants and S values.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv
for job in ${JOBS:?set JOBS, e.g. JOBS=925,4253}; do
    seqs=${job%%:*}
    measures=forward,step
    [[ $job == *:* ]] && measures=${job#*:}
    name=model_S${seqs//,/-}_${measures//,/-}
    left=$(( ${BUDGET_S:-560} - (SECONDS - start) ))
    if (( left < 90 )); then
        echo "=== $name not run: ${left}s left"
        continue
    fi
    echo "=== $name (limit ${left}s) $(date -u +%T)"
    timeout "$left" python3 benchmarks/bench_model.py --skip-gate --seq ${seqs//,/ } --measures "$measures" \
        ${VARIANTS:+--variants "$VARIANTS"} --out "$OUT/$name.json" \
        ${MODEL_ARGS:-} > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$? $(date -u +%T)"
    grep -E "^S=|^  [a-z_]+ failed:|^wrote|Error" "$OUT/$name.log" | tail -n 40
done
