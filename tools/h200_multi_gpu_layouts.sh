#!/usr/bin/env bash
# The multi-GPU layout evidence (docs/layouts.md) in one device call on an nvidia-h200-x2 / -x4 / -x8 machine: every layout's NCCL run,
# each rank against one GPU, full-width H3. Run from the repository root with .whl/ (diffusers, peft) and
# .vllm_bundle/ (python tools/vllm_omni_bundle.py --python-version 3.12) carried:
#   carry: [".whl", ".vllm_bundle"]
#   command: bash tools/h200_multi_gpu_layouts.sh
# N (default: every GPU of the machine) is the degree of every run:
#   ulysses_even / ulysses_odd  diffusers Ulysses N, forward + backward, S = 4096 and 4097 (tools/ulysses_nccl.py)
#   exact_dp                    FSDP2 DP N with the exact tree, FSDP2's own reduction and stock (tools/exact_dp_nccl.py)
#   vllm_omni_tp / vllm_omni_sp vLLM-Omni TP N and its Ulysses N, forward (tools/vllm_omni_tp_nccl.py)
# Each writes $OUT/<run>_<N>.json and $OUT/<run>_<N>.log; BUDGET_S (default 560) bounds the whole call and
# a run that would start with under 60 s left is not started. LAYERS (default 2) blocks in every model.
set -u
start=$SECONDS
# NVLink multicast stays off in every process these runs start: on the lent machines a program that
# uses it can take the host's shared GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export FLOWLOCK_COMMIT=${FLOWLOCK_COMMIT:-unknown} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
N=${N:-$(nvidia-smi -L | wc -l)}
LAYERS=${LAYERS:-2}
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl .vllm_bundle/wheels/*.whl || exit 1
python3 -m zipfile -e .vllm_bundle/vllm_py.zip "$SITE" || exit 1
export PYTHONPATH=$SITE:$PWD/src
nvidia-smi --query-gpu=index,name,memory.total --format=csv
run() {
    local name=$1
    shift
    local left=$(( ${BUDGET_S:-560} - (SECONDS - start) ))
    if (( left < 60 )); then
        echo "=== ${name}_$N not run: ${left}s left"
        return
    fi
    echo "=== ${name}_$N (limit ${left}s) $(date -u +%T)"
    timeout "$left" torchrun --nproc-per-node "$N" --master-addr 127.0.0.1 --master-port $(( 29500 + RANDOM % 1000 )) \
        "$@" --out "$OUT/${name}_$N.json" > "$OUT/${name}_$N.log" 2>&1
    echo "=== ${name}_$N rc=$? $(date -u +%T)"
    tail -n 3 "$OUT/${name}_$N.log"
}
run ulysses_even tools/ulysses_nccl.py --layers "$LAYERS" --seq 4096
run ulysses_odd tools/ulysses_nccl.py --layers "$LAYERS" --seq 4097
run exact_dp tools/exact_dp_nccl.py --layers "$LAYERS" --seq 4253
run vllm_omni_tp tools/vllm_omni_tp_nccl.py --layers "$LAYERS"
run vllm_omni_sp tools/vllm_omni_tp_nccl.py --sp --layers "$LAYERS"
