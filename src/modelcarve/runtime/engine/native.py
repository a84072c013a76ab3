"""The engine's native CPU kernels (``native_kernels.cpp``), built on first use: a bf16 / fp32 GEMM
(``NativeWeight``, every engine linear) and one decode step's paged attention (``decode_attention``).

    from modelcarve.runtime.engine import native
    if native.available():                       # an avx512_bf16 CPU and a C++ compiler, built once
        w = native.NativeWeight(weight)           # bf16 / fp32 [n, k] -> its packed copy, made once
        y = w(x, bias)                            # x [m, k] -> y [m, n] in the weight's dtype

Why: at a few rows a decode step's linears stream their weights from memory, and oneDNN's bf16
kernel for 1-16 rows reads a packed weight at about half this core's read bandwidth, its fp32 one
at ~75% (the ~110M llama of benchmarks/serve_vs_peers.py: 13.9 ms a sweep of its 200 MB of bf16
linears, ~14 GB/s, where a plain read of 200 MB runs at ~27 GB/s here). The weight is stored
instead in groups of 64 rows, column pair by column pair (fp32: column by column): each group is
one front-to-back stream, and one AVX512-BF16 ``VDPBF16PS`` (fp32: one FMA, x's value broadcast)
updates 16 rows' fp32 sums with no horizontal reduction. The ~110M llama's 49 linears, one
thread, rows 1 / 4 / 16 / 64, ms: bf16 7.75 / 7.15 / 16.3 / 57.5 against oneDNN's 10.6 / 9.9 /
19.5 / 61.4; fp32 16.5 / 15.4 / 33.2 / 115 against 20.4 / 20.0 / 37.4 / 120.

``decode_attention`` reads each sequence's keys and values in place through its block table (the
gathered path copies every sequence's blocks, builds a mask and runs SDPA, ~360 us a layer for 16
sequences of ~130 keys here) and computes in fp32 what ``paged_attention._attend`` computes.

The GEMM's arithmetic is ``F.linear``'s up to summation order: bf16 x bf16 products summed in fp32
(``VDPBF16PS`` adds the two products of a pair, then the accumulator, rounding to nearest; it
flushes bf16 denormal inputs to zero), the bias added in fp32, one rounding to bf16 (fp32: FMAs in
fp32, the bias added last).

Build: the source is compiled by the system's ``g++`` (``CXX``) into
``~/.cache/modelcarve/native/`` (``MODELCARVE_CACHE``), keyed by the source's and the flags' hash,
written atomically (ranks may build at once); loaded with ``ctypes`` (the call releases the GIL).
Nothing is built, and the engine keeps oneDNN's kernels and SDPA, where the CPU lacks
avx512_bf16, no compiler is found, the build fails, or ``MODELCARVE_ENGINE_NATIVE=0``;
``reason()`` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_kernels.cpp")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mfma")
_LIB = None
_REASON = None


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags and " avx512vl" in flags


def _cache_dir() -> Path:
    root = os.environ.get("MODELCARVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "modelcarve")
    return Path(root) / "native"


def _build() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    text = SOURCE.read_bytes()
    key = hashlib.sha256(text + " ".join((cxx, *FLAGS)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"native_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            raise RuntimeError(f"{Path(cxx).name} failed: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    global _LIB, _REASON
    if _LIB is not None or _REASON is not None:
        return _LIB
    if os.environ.get("MODELCARVE_ENGINE_NATIVE", "1") == "0":
        _REASON = "turned off (MODELCARVE_ENGINE_NATIVE=0)"
    elif not _cpu_has_bf16():
        _REASON = "this CPU has no avx512_bf16"
    else:
        try:
            lib = ctypes.CDLL(str(_build()))
            fn = lib.mc_gemm_bf16
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            lib.mc_native_group.restype = ctypes.c_int
            f32 = lib.mc_gemm_f32
            f32.restype = None
            f32.argtypes = fn.argtypes
            att = lib.mc_decode_attention
            att.restype = None
            att.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int, ctypes.c_int]
            _LIB = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _REASON = f"build failed: {err}"
    return _LIB


def available() -> bool:
    """Whether the native kernel is built and loaded here (builds it on the first call)."""
    return _load() is not None


def reason() -> str | None:
    """Why the native kernel is not used here (None when it is)."""
    _load()
    return _REASON


GROUP = 64
"""Weight rows per packed group (``native_kernels.cpp``'s GROUP, checked against the library at load)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` -> the kernel's layout, zero rows padding the last 64-row group: bf16 (k even)
    ``[ceil(n / 64), k / 2, 64, 2]`` (column pairs), fp32 ``[ceil(n / 64), k, 64]`` (columns)."""
    n, k = weight.shape
    groups = -(-n // GROUP)
    padded = weight.new_zeros(groups * GROUP, k)
    padded[:n] = weight
    if weight.dtype == torch.bfloat16:
        return padded.view(groups, GROUP, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(groups, GROUP, k).permute(0, 2, 1).contiguous()


class NativeWeight:
    """A bf16 or fp32 weight ``[n, k]`` in the native kernel's layout; ``self(x, bias)`` is
    ``F.linear(x, weight, bias)`` for a 2-D ``x`` of the weight's dtype and any row count
    (``bias``: ``[n]`` or None, cast to the weight's dtype)."""

    def __init__(self, weight: torch.Tensor):
        lib = _load()
        if lib is None or lib.mc_native_group() != GROUP:
            raise RuntimeError(f"the native kernel is not available: {_REASON or 'group size mismatch'}")
        w = weight.detach()
        self.n, self.k = w.shape
        self.dtype = w.dtype
        self.packed = pack(w)
        self._fn = lib.mc_gemm_bf16 if w.dtype == torch.bfloat16 else lib.mc_gemm_f32

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """A weight the kernels take: 2-D on the CPU, fp32, or bf16 with an even number of columns."""
        return (weight.dim() == 2 and weight.device.type == "cpu"
                and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.stride(-1) != 1 or x.dtype != self.dtype:
            x = x.to(self.dtype).contiguous()
        if bias is not None and (bias.dtype != self.dtype or not bias.is_contiguous()):
            bias = bias.to(self.dtype).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=self.dtype, device=x.device)
        if m:
            self._fn(x.data_ptr(), m, x.stride(0), self.k, self.packed.data_ptr(), self.n,
                     None if bias is None else bias.data_ptr(), y.data_ptr(), self.n, torch.get_num_threads())
        return y


_ATT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def attention_fits(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes these: fp32 or bf16 on the CPU, the cache in q's dtype,
    a head size that is a multiple of 16, and the kernel built here."""
    return (q.dtype in _ATT_DTYPES and cache.dtype == q.dtype and q.device.type == "cpu"
            and q.shape[-1] % 16 == 0 and cache.is_contiguous() and available())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     ctx: torch.Tensor, block_size: int, window: int | None, scale: float) -> torch.Tensor:
    """One decode step's attention, a query per sequence: ``q [n, heads, d]`` over the paged caches
    ``[slots, kv_heads, d]`` through block tables ``tables [n, width]`` (int64), sequence ``i``
    seeing keys ``0 .. ctx[i] - 1`` (the last ``window`` of them when set) -> ``[n, heads * d]``.
    fp32 scores, softmax and weighted sum (``mc_decode_attention``), one rounding to q's dtype: what
    ``paged_attention._attend`` computes on the gathered keys, without gathering them."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {_REASON}")
    n, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    tables = tables.contiguous()
    ctx = ctx.contiguous()
    out = torch.empty(n, heads * d, dtype=q.dtype)
    lib.mc_decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                             tables.shape[1], ctx.data_ptr(), n, heads, kv_heads, d, block_size,
                             window or 0, scale, out.data_ptr(), heads * d, _ATT_DTYPES[q.dtype],
                             torch.get_num_threads())
    return out
