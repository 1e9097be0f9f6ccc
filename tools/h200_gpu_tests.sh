#!/usr/bin/env bash
# The GPU-marked tests on the H200, one file per pytest process, each under its own time limit so a
# slow file (first-time Triton compiles) cannot starve the rest; one summary line per file, the
# verbose logs in $OUT/gpu_tests.log. Run from the repository root with the diffusers wheel in .whl/.
# GPU_TESTS_S bounds the whole step (default 330 s); GPU_TESTS_SKIP names files to leave out.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD/src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
files=$(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
for f in $files; do
    if [[ " ${GPU_TESTS_SKIP:-} " == *" $f "* ]]; then echo "$f skipped (GPU_TESTS_SKIP)"; continue; fi
    left=$(( ${GPU_TESTS_S:-330} - (SECONDS - start) ))
    if (( left < 20 )); then echo "$f NOT RUN (${left}s left)"; continue; fi
    timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "$f" > /tmp/one.log 2>&1
    rc=$?
    { echo "=== $f rc=$rc"; cat /tmp/one.log; } >> "$OUT/gpu_tests.log"
    echo "$f rc=$rc $(grep -E '[0-9]+ (passed|failed|error)' /tmp/one.log | tail -n 1)"
    grep -E "^(FAILED|ERROR)" /tmp/one.log | head -n 5
done
