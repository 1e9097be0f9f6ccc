#!/usr/bin/env bash
# verl-omni's own MiniMax-H3 CPU tests, stock and with flowlock switched on (its vLLM plugin strict and
# flowlock.integrations.verl_omni.register as verl-omni's external_lib), then flowlock's two-iteration run
# through verl-omni's H3 adapters (tools/verl_omni_h3_run.py). A developer tool, not CI: verl-omni is not
# on the package registries.
#
#   VERL_OMNI_DIR=DIR [VERL_DIR=DIR] [SCRATCH_DIR=DIR] tools/verl_omni_h3_suite.sh [extra pytest args]
#
# VERL_OMNI_DIR  a verl-omni tree, e.g. git --git-dir=MIRROR archive a1139baf | tar -x -C DIR. The suite
#                runs on a copy, so the tree stays as it was. VERL_OMNI_COMMIT names its commit (default:
#                git rev-parse in the tree, where it is a git work tree).
# VERL_DIR       verl at the commit in VERL_OMNI_DIR/.github/verl_pin.txt, put on sys.path as verl-omni's
#                CI installs it (--no-deps); unset: verl must already be importable by PYTHON.
# SCRATCH_DIR    where the environment is built (default: a new temp dir); never inside this repository.
# DEPS_DIR       the packages verl-omni imports that PYTHON lacks (default SCRATCH_DIR/deps), installed once
#                with pip --target --no-deps from the pins below and reused while the pins are unchanged.
# OUT_DIR        junit xml and log per test file and run, summary.tsv / summary.json, the run's JSON
#                (default SCRATCH_DIR/out).
# PYTHON         default python3: the project's test venv (torch 2.13.0 CPU, vllm and vllm-omni 0.30.0,
#                diffusers, tensordict, pytest, flowlock). Nothing is installed into it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-python3}

if [[ -z "${VERL_OMNI_DIR:-}" || ! -f "$VERL_OMNI_DIR/tests/pipelines/test_minimax_h3_diffusion_nft_on_cpu.py" ]]; then
    echo "usage: VERL_OMNI_DIR=DIR [VERL_DIR=DIR] [SCRATCH_DIR=DIR] $0 [pytest args]" \
         "(DIR/tests/pipelines/test_minimax_h3_diffusion_nft_on_cpu.py must exist)" >&2
    exit 2
fi
scratch=${SCRATCH_DIR:-$(mktemp -d)}
mkdir -p "$scratch"
scratch=$(cd "$scratch" && pwd -P)
deps_dir=${DEPS_DIR:-$scratch/deps}
out=${OUT_DIR:-$scratch/out}
mkdir -p "$deps_dir" "$out"
deps_dir=$(cd "$deps_dir" && pwd -P)
for dir in "$scratch" "$deps_dir"; do
    # the environment is a developer's scratch state: it must never land in a commit
    if [[ "$dir/" == "$(cd "$repo" && pwd -P)/"* ]]; then
        echo "$dir is inside the repository; give SCRATCH_DIR / DEPS_DIR outside it" >&2
        exit 2
    fi
done

# Exact versions, installed with --no-deps beside PYTHON's packages (which stay as they are): what
# verl-omni, verl and the vLLM / vLLM-Omni modules its H3 tests import need and the test venv lacks.
# Within verl-omni's declared ranges except where PYTHON's packages decide: accelerate 1.12.0 (vllm-omni
# 0.30.0 pins it; verl-omni asks >= 1.14) and tensordict 0.15.3 (verl-omni asks <= 0.10.0).
pins=(
    # verl-omni's and verl's own requirements
    codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1
    pyarrow==24.0.0 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 ray==2.60.0 msgpack==1.2.4
    protobuf==7.36.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
    rpds-py==2026.9.1 uvicorn==0.55.0 TransferQueue==0.1.8 torchdata==0.11.0 orjson==3.13.0
    imageio==2.38.0 imageio-ffmpeg==0.6.0 pytest-asyncio==1.4.0
    # wandb: verl-omni's tracking tests build wandb.Video objects (nothing is sent)
    wandb==0.30.0 platformdirs==4.14.9 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2
    # transformers <= 5.14.1 is verl-omni's cap (and vllm-omni 0.30.0 asks < 5.15): 5.24's Qwen2-VL no
    # longer exports what verl's qwen2_vl module imports. It shadows the venv's 5.24.0 with the
    # huggingface_hub / tokenizers ranges it declares.
    transformers==5.14.1 huggingface-hub==1.33.0 tokenizers==0.22.2
    # vllm 0.30.0 pins these two; the only wheels are CUDA builds (see the shim and the torchaudio note)
    torchvision==0.28.0 torchaudio==2.11.0
    # vLLM-Omni's OpenAI server, imported by verl-omni's rollout server (the rollout-contract tests)
    soundfile==0.14.0 websockets==17.4 watchfiles==1.3.0 model-hosting-container-standards==0.1.16
    jmespath==1.1.0 supervisor==4.3.0 janus==2.0.0 ijson==3.6.0 mistral-common==1.13.1
    pydantic-extra-types==2.11.1 pycountry==26.2.16 pydantic-settings==2.16.3 python-dotenv==1.2.4
    python-multipart==0.0.34
)
stamp="$deps_dir/.verl_omni_h3_suite_pins"
if [[ ! -f "$stamp" ]] || [[ "$(cat "$stamp")" != "$(printf '%s\n' "${pins[@]}")" ]]; then
    if [[ -n "$(ls -A "$deps_dir")" && ! -f "$stamp" ]]; then
        echo "$deps_dir is not empty and was not built by this script; give an empty or new DEPS_DIR" >&2
        exit 2
    fi
    # pip --target cannot upgrade namespace packages (opentelemetry, google) in place: start empty
    find "$deps_dir" -mindepth 1 -delete
    echo "installing ${#pins[@]} packages into $deps_dir (log: $out/pip.log)"
    "$python" -m pip install --target "$deps_dir" --no-deps "${pins[@]}" > "$out/pip.log" 2>&1 || {
        tail -n 5 "$out/pip.log" >&2
        exit 1
    }
    # torchaudio 2.11.0's libraries link libtorch_cuda, which a CPU torch lacks, and a library that is
    # present but fails to load aborts `import torchaudio` (transformers imports it when installed).
    # Without them torchaudio runs as it does when it was built without its extension.
    rm -f "$deps_dir"/torchaudio/lib/*.so
    printf '%s\n' "${pins[@]}" > "$stamp"
fi

# torchvision 0.28.0's _C.so (a CUDA build, the only 0.28.0 wheel) cannot load on a CPU torch; torchvision
# supports running without it except for two unguarded fake-kernel registrations (pytorch/vision#9085).
# The shim defines those two schemas, only when _C did not load and only when torchvision is imported.
mkdir -p "$scratch/shim"
cat > "$scratch/shim/sitecustomize.py" <<'EOF'
# Written by flowlock's tools/verl_omni_h3_suite.sh: torchvision 0.28.0's CUDA-built _C.so does not load
# on a CPU torch, and torchvision/_meta_registrations.py then fails on register_fake("torchvision::nms")
# (and qnms) because the op was never defined. When, and only when, _C did not load, define those two
# schemas (the strings the 0.28.0 _C.so defines) with no kernel, just before that module is imported.
# torchvision.ops.nms still refuses to run (no ops, no CPU kernel); nothing else changes.
import importlib.abc
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libs = []  # a torch.library.Library removes its definitions when it is collected


class _DefineMissingTorchvisionSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision._meta_registrations":
            return None
        sys.meta_path.remove(self)
        import torch
        import torchvision.extension

        if not torchvision.extension._has_ops():
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                lib.define(schema)
            _libs.append(lib)
        return None  # the regular finders load the module


sys.meta_path.insert(0, _DefineMissingTorchvisionSchemas())
EOF

# A copy, so that the commit marker tools/verl_omni_h3_run.py reads and Python's caches never touch the
# given tree.
vo="$scratch/verl-omni"
rm -rf "$vo"
cp -a "$VERL_OMNI_DIR/." "$vo/"
commit=${VERL_OMNI_COMMIT:-$(git -C "$VERL_OMNI_DIR" rev-parse HEAD 2>/dev/null || true)}
if [[ -n "$commit" ]]; then
    echo "$commit" > "$vo/VERL_OMNI_COMMIT"
fi

export PYTHONPATH="$scratch/shim:$repo/src${VERL_DIR:+:$VERL_DIR}:$vo:$deps_dir"
export PYTHONPYCACHEPREFIX="$scratch/pycache"
# as verl-omni's CPU CI runs its tests
export TORCH_COMPILE_DISABLE=1 TORCHINDUCTOR_DISABLE=1
# the stock run must not inherit a switch from the caller's shell
unset FLOWLOCK_VLLM_OMNI
"$python" -c "import verl, verl_omni.pipelines.minimax_h3_diffusion_nft" > "$out/import.log" 2>&1 || {
    echo "verl-omni does not import (log: $out/import.log):" >&2
    tail -n 3 "$out/import.log" >&2
    exit 1
}

shopt -s nullglob
tests=()
for t in "$vo"/tests/pipelines/test_minimax_h3_*_on_cpu.py "$vo"/tests/agent_loop/test_minimax_h3_*_on_cpu.py \
         "$vo"/tests/pipelines/test_image_edit_interface_on_cpu.py; do
    tests+=("${t#"$vo"/}")
done

# One pytest per file: a file that fails to collect costs only its own counts (verl-omni's CI runs all of
# tests/ with -x, which stops at the first failure).
run_suite() {
    local name=$1 t base rc
    shift
    mkdir -p "$out/$name"
    for t in "${tests[@]}"; do
        base=$(basename "$t" .py)
        rc=0
        (cd "$vo" && "$python" -m pytest "$t" -q -p no:cacheprovider -p no:xdist --asyncio-mode=auto \
            -o 'python_files=*_on_cpu.py' --rootdir "$vo" --junitxml "$out/$name/$base.xml" "$@" "${extra[@]}") \
            > "$out/$name/$base.log" 2>&1 || rc=$?
        echo "$name $base: rc=$rc $(tail -n 1 "$out/$name/$base.log")"
    done
}
extra=("$@")
run_suite stock
status=0
# flowlock on: its vLLM plugin strict, and its registrations imported before any test module as verl-omni's
# external_lib import would (tools/verl_omni_h3_suite/flowlock_on.py, a pytest plugin)
(export FLOWLOCK_VLLM_OMNI=strict PYTHONPATH="$here/verl_omni_h3_suite:$PYTHONPATH"
 run_suite flowlock -p flowlock_on)

"$python" - "$out" "$here/verl_omni_h3_suite/expected_differences.tsv" "${tests[@]}" <<'EOF' || status=1
"""Counts per file and run from the junit xml, and every test whose outcome differs between the runs."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, expected_file, files = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
expected = dict(line.split("\t", 1) for line in expected_file.read_text().splitlines()
                if line.strip() and not line.startswith("#"))
runs = [r for r in ("stock", "flowlock") if (out / r).is_dir()]
summary, outcomes, missing = {}, {}, []
for run in runs:
    for f in files:
        xml = out / run / (Path(f).stem + ".xml")
        if not xml.is_file():
            missing.append(f"{run} {f}")
            continue
        counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
        for case in ET.parse(xml).getroot().iter("testcase"):
            verdict = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            key = "passed" if verdict is None else {"failure": "failed", "error": "errors"}.get(verdict.tag, "skipped")
            counts[key] += 1
            why = "" if verdict is None else ((verdict.get("message") or "").splitlines() or [""])[0]
            outcomes.setdefault(f"{case.get('classname')}::{case.get('name')}", {})[run] = (key, why)
        summary.setdefault(f, {})[run] = counts
lines = ["file\trun\tpassed\tfailed\terrors\tskipped"]
for f, per_run in summary.items():
    for run, c in per_run.items():
        lines.append(f"{f}\t{run}\t{c['passed']}\t{c['failed']}\t{c['errors']}\t{c['skipped']}")
differences = {}
if len(runs) == 2:
    differences = {t: o for t, o in outcomes.items()
                   if o.get("stock", ("absent",))[0] != o.get("flowlock", ("absent",))[0]}
(out / "summary.tsv").write_text("\n".join(lines) + "\n")
deliberate = {t: expected[t] for t in differences if t in expected}
(out / "summary.json").write_text(json.dumps({"counts": summary, "differences": differences, "deliberate": deliberate,
                                              "missing_reports": missing}, indent=2) + "\n")
print("\n".join(lines))
for test, o in differences.items():
    note = f" [deliberate: {expected[test]}]" if test in expected else ""
    print(f"differs: {test}: " + "; ".join(f"{run} {key} {why}".rstrip() for run, (key, why) in o.items()) + note)
for m in missing:
    print(f"no junit report: {m}")
# a stock pass that flowlock does not keep (and that is not a listed deliberate difference), or a run
# without a report, fails the suite
regressions = [t for t, o in differences.items() if o.get("stock", ("",))[0] == "passed" and t not in expected]
sys.exit(1 if regressions or missing else 0)
EOF

if [[ -f "$repo/tools/verl_omni_h3_run.py" ]]; then
    for mode in off on; do
        rc=0
        (cd "$repo" && "$python" tools/verl_omni_h3_run.py --out "$out" --flowlock "$mode") \
            > "$out/verl_omni_h3_run_$mode.log" 2>&1 || rc=$?
        echo "verl_omni_h3_run --flowlock $mode: rc=$rc (log: $out/verl_omni_h3_run_$mode.log)"
        (( rc == 0 )) || status=1
    done
else
    echo "tools/verl_omni_h3_run.py is absent: the two-iteration run is skipped"
fi
echo "results: $out"
exit "$status"
