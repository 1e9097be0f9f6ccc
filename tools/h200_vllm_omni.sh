#!/usr/bin/env bash
# The rollout engine on the H200: vLLM-Omni 0.30.0 (pure-Python bundle) + flowlock on CUDA, in one device call.
#
# The device machine cannot receive the vllm wheel; `python tools/vllm_omni_bundle.py` (run here
# first) writes .vllm_bundle/: vllm's and vllm_omni's .py files (vllm_py.zip) and cp312 manylinux
# wheels of what they import that the image lacks. Device call, from the repository root:
#   carry: [".vllm_bundle", ".whl"]
#   command: bash tools/h200_vllm_omni.sh
# Stages (each one's status in $OUT/stages.txt; a failed stage does not stop the others):
#   env      GPU, python, glibc, the image's torch / triton / transformers
#   install  the bundle's wheels and .whl/*.whl (diffusers, peft) into /tmp/site, vllm_py.zip extracted there
#   import   MiniMaxH3DiTModel imports with vLLM's and vLLM-Omni's unspecified platforms pinned
#            (tests/vllm_omni_env.py: vllm's compiled ops are absent, so NVML is told there is no GPU)
#   engines  tools/vllm_omni_engines_cuda.py: tiny H3, CUDA tensors, flowlock's Triton kernels; vLLM-Omni +
#            flowlock vs diffusers + flowlock (rollout / replay velocities and CPS log-probs, module trace), bf16
#            and fp32 -> $OUT/engines_cuda.json
#   bench    benchmarks/bench_vllm_omni.py: full-width H3 (2 blocks + refiner), vLLM-Omni + flowlock vs
#            vLLM-Omni stock in one process, and cross-engine mismatch counts -> $OUT/bench_vllm_omni.json.
#            Stock here is vLLM-Omni without vllm's compiled ops: its torch-native RMSNorm / SiLU-and-mul /
#            q-k norm + RoPE, cuBLAS linears, torch SDPA attention, its own Triton indexed modulation
#   tests    tests/integrations/test_vllm_omni_engine_invariance.py on this machine's CPU (torch 2.11, the bundle)
#   verl     benchmarks/bench_verl_omni_rollout.py: verl-omni's H3 FlowGRPO rollout (flowlock's strict sampler on the
#            plugin-installed native DiT) replayed by the strict diffusers actor, tiny and full-width 2-block H3:
#            Δlogp / ratio / clip fraction strict and stock, and the rollout's per-step time against verl-omni's
#            stock step (its CPS scheduler from a verl-omni checkout: carry it as .verl_omni, or set VERL_OMNI)
#            -> $OUT/bench_verl_omni_rollout.json
# STAGES="verl" (say) runs env, install, import and only the named later stages.
# Everything printed goes to $OUT/h200_vllm_omni.log. BUDGET_S (default 520) bounds the whole run.
# For a dry run of this script on a CPU machine: BUNDLE=<a bundle built with --python-version of that
# python> DEVICE=cpu BENCH_ARGS=--smoke PYTHON=<venv python> bash tools/h200_vllm_omni.sh
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/h200_vllm_omni.log") 2>&1
budget=${BUDGET_S:-520}
start=$SECONDS
SITE=${SITE:-/tmp/site}
BUNDLE=${BUNDLE:-.vllm_bundle}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$SITE:$PWD/src SITE BUNDLE PYTHON
: > "$OUT/stages.txt"

# stage NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what is left of the budget); record rc and time
stage() {
    local name=$1 limit=$2 rc t0 left
    shift 2
    left=$(( budget - (SECONDS - start) ))
    if (( left < limit )); then limit=$left; fi
    if (( limit < 15 )); then
        echo "=== $name NOT RUN (${left}s of the budget left)"
        echo "$name not_run budget" >> "$OUT/stages.txt"
        return 0
    fi
    echo "=== $name (limit ${limit}s, at $((SECONDS - start))s)"
    t0=$SECONDS
    # functions run in a child bash (exported below), so timeout can stop them too
    if timeout --kill-after=10 "$limit" bash -c '"$@"' stage "$@"; then rc=0; else rc=$?; fi
    echo "=== $name rc=$rc in $((SECONDS - t0))s"
    echo "$name rc=$rc seconds=$((SECONDS - t0))" >> "$OUT/stages.txt"
}

env_info() {
    set -uo pipefail
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PYTHON" --version
    ldd --version | head -n 1 || true
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "accelerate", "safetensors",
             "numpy", "peft", "pydantic"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
EOF
    du -sh "$BUNDLE" .whl || true
}

install_bundle() {
    set -euo pipefail
    rm -rf "$SITE" && mkdir -p "$SITE"
    local w failed=0 pip=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
    if ! "${pip[@]}" "$BUNDLE"/wheels/*.whl .whl/*.whl; then
        # one unsupported wheel (a glibc tag, say) fails them all: install the rest one by one, name the failures
        for w in "$BUNDLE"/wheels/*.whl .whl/*.whl; do
            "${pip[@]}" "$w" || { echo "WHEEL FAILED: $w"; failed=1; }
        done
    fi
    "$PYTHON" -m zipfile -e "$BUNDLE"/vllm_py.zip "$SITE"
    ls "$SITE" | tr '\n' ' '; echo
    return "$failed"  # the later stages run either way
}

import_probe() {
    set -euo pipefail
    "$PYTHON" - <<'EOF'
import sys, time
sys.path.insert(0, "tests")
t0 = time.perf_counter()
import vllm_omni_env
print("pinned unspecified platforms:", vllm_omni_env.pin_pure_python_platforms())
from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel  # noqa: F401
vllm_omni_env.check_pure_python_platforms()
import torch, triton, vllm, vllm_omni
from vllm.triton_utils import HAS_TRITON
print(f"MiniMaxH3DiTModel imported in {time.perf_counter() - t0:.1f}s: vllm {vllm.__version__} from {vllm.__file__}, "
      f"vllm_omni from {vllm_omni.__file__}; torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda {torch.cuda.is_available()}, vllm HAS_TRITON {HAS_TRITON}")
EOF
}

export -f env_info install_bundle import_probe
# STAGES picks the stages after env / install / import (default: all of them)
wants() { [[ " ${STAGES:-engines bench tests verl} " == *" $1 "* ]]; }
stage env 30 env_info
stage install 90 install_bundle
stage import 60 import_probe
wants engines && stage engines 150 "$PYTHON" tools/vllm_omni_engines_cuda.py --device "$DEVICE" --out "$OUT/engines_cuda.json"
# the CPU test gate of the benchmark (tests/integrations) passed at this commit on the CPU machine; the
# tests stage below runs the engine-invariance file here too
# shellcheck disable=SC2086
wants bench && stage bench 240 "$PYTHON" benchmarks/bench_vllm_omni.py --device "$DEVICE" --skip-gate ${BENCH_ARGS:-} \
    --out "$OUT/bench_vllm_omni.json"
wants tests && stage tests 150 "$PYTHON" -m pytest -x -q -p no:cacheprovider -m "not gpu and not multigpu and not slow" \
    tests/integrations/test_vllm_omni_engine_invariance.py
# verl-omni's CPS scheduler (the stock rollout step) comes from a verl-omni checkout carried as .verl_omni
wants verl && stage verl 240 "$PYTHON" benchmarks/bench_verl_omni_rollout.py --device "$DEVICE" --skip-gate \
    --verl-omni "${VERL_OMNI:-.verl_omni}" ${BENCH_ARGS:-} --out "$OUT/bench_verl_omni_rollout.json"
echo "=== done in $((SECONDS - start))s"
cat "$OUT/stages.txt"
# exit non-zero when any stage failed or did not run (every stage's result is above either way)
! grep -qv " rc=0 " "$OUT/stages.txt"
