#!/usr/bin/env bash
# diffusers' own MiniMax-H3 model tests, stock and with every model flowlock.patch(model, mode="strict"):
# prints both outcome counts, how many stock passes also pass strict, and each difference with its
# first error line. A developer tool, not CI (CI cannot fetch the diffusers repository).
#
#   tools/diffusers_h3_suite.sh DIFFUSERS_CHECKOUT [extra pytest args]
#
# DIFFUSERS_CHECKOUT holds diffusers' tests/ (tests/models/testing_utils, tests/conftest.py,
# tests/testing_utils.py) at a commit matching the installed wheel, e.g.
#   git --git-dir=MIRROR archive 58eb52c tests | tar -x -C /tmp/dsuite
# The tests import the installed diffusers; their conftest puts DIFFUSERS_CHECKOUT/src first on
# sys.path, so a full checkout's src/diffusers would shadow the wheel (the report header and the
# summary name the diffusers actually imported). PYTHON (default python3) must have flowlock's deps,
# diffusers, peft and pytest. OUT_DIR (default a temp dir) keeps the two JSON reports and logs.
set -u
if (( $# < 1 )) || [[ ! -f "$1/tests/models/transformers/test_models_transformer_minimax_h3.py" ]]; then
    echo "usage: $0 DIFFUSERS_CHECKOUT [pytest args]  (DIFFUSERS_CHECKOUT/tests/models/transformers/" \
         "test_models_transformer_minimax_h3.py must exist)" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd); shift
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-python3}
out=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONPATH="$repo/src:$here/diffusers_h3_suite${PYTHONPATH:+:$PYTHONPATH}"
for run in off strict; do
    (cd "$checkout" && FLOWLOCK_SUITE_PATCH=$run FLOWLOCK_SUITE_REPORT="$out/$run.json" \
        "$python" -m pytest tests/models/transformers/test_models_transformer_minimax_h3.py -q \
        -p no:cacheprovider -p no:xdist -p flowlock_strict_plugin "$@") > "$out/$run.log" 2>&1
    echo "$run run: rc=$? $(tail -n 1 "$out/$run.log")  (log: $out/$run.log)"
    [[ -f "$out/$run.json" ]] || { echo "no report from the $run run" >&2; exit 1; }
done
"$python" "$here/diffusers_h3_suite/compare.py" "$out/off.json" "$out/strict.json"
