"""The cross-engine check on a GPU: vLLM-Omni + flowlock against diffusers + flowlock, tiny H3, CUDA tensors.

``python tools/vllm_omni_engines_cuda.py --out engines.json [--device cuda] [--dtype bfloat16 float32]``
runs :func:`flowlock.validate.engines.engine_demo` (the rollout of 3 requests x 2 CPS steps packed in
vLLM-Omni, replayed request by request in diffusers, velocities and log-probs compared bitwise; and
the module-by-module trace), strict and stock side by side, once per ``--dtype`` (``bfloat16``: BF16
with H3's FP32 modules; ``float32``: every parameter FP32). On CUDA flowlock runs its Triton kernels.

vllm may be the pure-Python bundle (``tools/vllm_omni_bundle.py``): the test suite's runtime
(``tests/vllm_omni_env.py``) then pins vLLM's and vLLM-Omni's unspecified platforms before vllm is
imported and puts in its shims (SDPA attention on the caller's device, a one-rank gloo group), so the
stock side is vLLM-Omni's torch-native paths. Exit 0 iff strict is bitwise equal across engines for
every dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import vllm_omni_env  # noqa: E402

PURE_PYTHON = vllm_omni_env.pin_pure_python_platforms()  # before anything imports vllm

import torch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    from flowlock.validate.engines import engine_demo, report_blocks
    from flowlock.validate.report import show

    vllm_omni_env.ensure_runtime()
    if PURE_PYTHON:
        vllm_omni_env.check_pure_python_platforms()
    import vllm
    import vllm_omni

    payload = {"device": str(torch.device(args.device)), "pure_python_vllm": PURE_PYTHON,
               "vllm": vllm.__version__, "vllm_file": vllm.__file__, "vllm_omni_file": vllm_omni.__file__,
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "runs": {}}
    ok = True
    for name in args.dtype:
        t0 = time.perf_counter()
        try:
            run = engine_demo(torch.device(args.device), dtype=getattr(torch, name))
        except Exception as err:  # record it, go on with the next dtype
            run = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            print(f"[{name}] FAILED: {run['error']}", flush=True)
        else:
            show([f"[{name}]", *report_blocks(run)])
        run["seconds"] = round(time.perf_counter() - t0, 1)
        payload["runs"][name] = run
        ok = ok and run["ok"]
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    payload["ok"] = ok
    args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"strict bitwise equal across engines for {args.dtype}: {'yes' if ok else 'NO'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
