"""Pack vLLM + vLLM-Omni 0.30.0 as pure Python for a machine that cannot receive the vllm wheel.

The H200 device machine gets at most 64 MiB of working tree and no registry; the vllm wheel alone is
~450 MB (mostly CUDA ``.so``: ``vllm_flash_attn``, ``_C``, ``_moe_C``), built against torch 2.13, while
that image has torch 2.11 (those ``.so`` could not load there anyway). Importing vLLM-Omni's
``MiniMaxH3DiTModel`` loads no compiled vllm op when vLLM's and vLLM-Omni's platforms are the
"unspecified" ones (``tests/vllm_omni_env.py`` pins them), and flowlock's adapter replaces every
kernel, so the ``.py`` files are enough.

``python tools/vllm_omni_bundle.py [--python-version 3.12] [--out .vllm_bundle]`` writes (gitignored):

* ``vllm_py.zip``: every ``.py`` (and ``py.typed``) of the installed ``vllm`` and ``vllm_omni``
  packages, plus their ``.dist-info`` metadata (``importlib.metadata.version("vllm")`` works; RECORD
  left out, it lists the files that are not here). No ``.so``, no kernel configs, headers or assets.
* ``wheels/``: the wheels of the distributions vllm / vllm-omni import on the way to the H3 model
  (and of its test helpers: packer, denoise branch) that the H200 image lacks (the image has torch,
  triton, numpy, transformers, accelerate, peft and their common dependencies), downloaded for
  ``--python-version`` / manylinux x86_64 (``--no-deps --only-binary=:all:``), versions as
  ``requirements/vllm-cpu.txt`` (the CPU suite's).
* ``MANIFEST.json``: what is in it, with sizes.

Not carried: PyAV (``av``, ~35 MB): vllm treats it as optional; the one vLLM-Omni module that imports
it at module level (``diffusion/utils/media_utils.py``, output muxing) gets a placeholder from
``tests/vllm_omni_env.pin_pure_python_platforms`` where ``av`` is missing.

Install it (what ``tools/h200_vllm_omni.sh`` does; the zip is extracted, not zip-imported, so
``__file__``-relative reads and ``.pyc`` caching behave as in a normal install)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target SITE .vllm_bundle/wheels/*.whl
    python3 -m zipfile -e .vllm_bundle/vllm_py.zip SITE
    PYTHONPATH=SITE:... python3 ...

``--from-site DIR`` reads vllm / vllm_omni from DIR (default: where this interpreter imports them
from, without importing them). Refuses to write a bundle over ``--max-mib`` (default 45).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm", "vllm_omni")
DISTS = ("vllm-0.30.0.dist-info", "vllm_omni-0.30.0.dist-info")
KEEP_SUFFIXES = (".py",)
KEEP_NAMES = ("py.typed",)
KEEP_DIST_FILES = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")

# Imported (hard, at module level) on the way to MiniMaxH3DiTModel and the H3 packer / denoise
# branch, absent from the H200 image; found by importing in a venv holding only the image's packages
# (the trace of who imports what: vllm.config -> pydantic, cbor2 (vllm.utils.hashing), openai
# (+ httpx2, httpcore2, truststore) / openai_harmony (vllm.reasoning -> entrypoints.mcp), xgrammar ->
# apache-tvm-ffi (vllm.parser), fastapi / starlette, partial-json-parser, msgspec, pybase64, cachetools, pyzmq
# (vllm.utils.network_utils); vllm_omni -> aenum, omegaconf, loguru, prettytable,
# cache_dit; llguidance, whose class an annotation in vllm.v1.structured_output.backend_guidance
# evaluates). ``av`` is optional for vllm (a placeholder);
# omegaconf's antlr4, prettytable's wcwidth and openai's jiter / distro are not imported on that path.
WHEELS = (
    "aenum==3.1.16", "annotated-types==0.8.0", "apache-tvm-ffi==0.1.11", "cache_dit==1.5.0", "cachetools==8.0.2",
    "cbor2==6.3.0", "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "llguidance==1.7.6",
    "loguru==0.7.3", "msgspec==0.23.0", "omegaconf==2.4.0", "openai==3.57.0",
    "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "prettytable==3.18.0", "pybase64==1.5.1",
    "pydantic==2.14.4", "pydantic_core==2.50.5", "pyzmq==27.3.0", "sniffio==1.3.1", "starlette==1.10.0",
    "truststore==0.10.5", "typing-inspection==0.4.5", "xgrammar==0.2.9",
)
# llguidance 1.7.6 ships only manylinux_2_31 (glibc >= 2.31: the H200 image's Python 3.12.3 is Ubuntu
# 24.04's, glibc 2.39; pip refuses an unsupported wheel at install, loudly)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_31_x86_64")


def _package_dir(name: str, site: Path | None) -> Path:
    if site is not None:
        return site / name
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not importable here: pass --from-site")
    return Path(next(iter(spec.submodule_search_locations)))


def write_zip(path: Path, site: Path | None) -> dict:
    files = 0
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in PACKAGES:
            root = _package_dir(name, site)
            for file in sorted(root.rglob("*")):
                if "__pycache__" in file.parts or not file.is_file():
                    continue
                if file.suffix in KEEP_SUFFIXES or file.name in KEEP_NAMES:
                    zf.write(file, file.relative_to(root.parent).as_posix())
                    files += 1
        for dist in DISTS:
            root = _package_dir(PACKAGES[0], site).parent / dist
            for member in KEEP_DIST_FILES:
                if (root / member).is_file():
                    zf.write(root / member, f"{dist}/{member}")
                    files += 1
    return {"files": files, "bytes": path.stat().st_size}


def download_wheels(dest: Path, python_version: str) -> list[dict]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(dest), *WHEELS]
    subprocess.run(cmd, check=True)
    return [{"wheel": w.name, "bytes": w.stat().st_size} for w in sorted(dest.glob("*.whl"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".vllm_bundle")
    parser.add_argument("--python-version", default="3.12", help="of the machine that installs the wheels")
    parser.add_argument("--from-site", type=Path, default=None, help="site-packages holding vllm and vllm_omni")
    parser.add_argument("--max-mib", type=float, default=45.0)
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("wheels/*.whl"), out / "vllm_py.zip"]:
        old.unlink(missing_ok=True)
    zipped = write_zip(out / "vllm_py.zip", args.from_site)
    wheels = download_wheels(out / "wheels", args.python_version)
    total = zipped["bytes"] + sum(w["bytes"] for w in wheels)
    manifest = {"python_version": args.python_version, "platforms": PLATFORMS, "vllm_py.zip": zipped,
                "wheels": wheels, "total_bytes": total, "total_mib": round(total / 2**20, 2)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{out}: vllm_py.zip {zipped['files']} files {zipped['bytes'] / 2**20:.1f} MiB, {len(wheels)} wheels "
          f"{sum(w['bytes'] for w in wheels) / 2**20:.1f} MiB, total {total / 2**20:.1f} MiB")
    if total > args.max_mib * 2**20:
        print(f"bundle is over --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
