"""Rotary position embeddings: the inverse frequencies of every rope type, and the cos/sin tables.

The types are those of ``ModelSpec.rope_scaling`` (read from config.json by spec/hf_config.py),
computed as transformers' ``modeling_rope_utils`` computes them (fp32 throughout, so logits
match to 1e-5; tests/runtime/test_runtime_rope_window.py checks each type against transformers at
positions past ``original_max_position_embeddings``):

* default: ``inv_freq[i] = theta ** (-2i / dim)``.
* ``linear``: ``inv_freq / factor`` (positions interpolated by ``factor``).
* ``llama3``: wavelengths longer than ``original / low_freq_factor`` divided by ``factor``, shorter
  than ``original / high_freq_factor`` kept, the band between blended linearly in
  ``original / wavelength``.
* ``yarn``: per dimension a blend of interpolated (``/ factor``) and extrapolated frequencies, with a
  linear ramp between the correction dimensions of ``beta_fast`` and ``beta_slow`` rotations over
  ``original_max_position_embeddings``; cos/sin are multiplied by ``attention_factor`` (default
  ``0.1 ln(factor) + 1``, or the ratio of the two mscales when ``mscale`` and ``mscale_all_dim``
  are given).
* ``dynamic`` (NTK): ``theta`` grows with the sequence: ``theta * (factor * L / max_position -
  (factor - 1)) ** (dim / (dim - 2))`` for ``L = max(positions) + 1`` once ``L`` exceeds
  ``max_position``. transformers keeps this state in the module (frequencies only grow during a
  generation and reset below ``max_position``); here it is a function of the positions of the
  call, which equals transformers on a fresh model for a full-sequence forward, and for
  cached decoding when each step passes the positions it adds (``seq_len`` = the largest
  position seen so far + 1 -- give ``seq_len`` explicitly for that).

``rope_scale_softmax(spec)`` is DeepSeek-V3's extra softmax scale (``mscale(factor,
mscale_all_dim) ** 2``) for scaled rope under MLA.
"""

from __future__ import annotations

import math

import torch

from modelcarve.spec.model import ModelSpec


def _default_inv_freq(dim: int, theta, device=None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, theta: float, p: dict, max_position: int, device=None) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / original
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolate = 1 - ramp  # weight of the unscaled frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


def inv_freq(spec: ModelSpec, dim: int, seq_len: int | torch.Tensor | None = None, device=None):
    """(inverse frequencies [dim / 2] fp32, attention factor multiplying cos/sin) of ``spec``'s rope.
    ``seq_len`` matters only to ``dynamic`` (the longest position + 1 the call sees)."""
    p = spec.rope_parameters
    kind = p.get("rope_type", "default")
    theta = spec.rope_theta
    if kind == "default":
        return _default_inv_freq(dim, theta, device), 1.0
    if kind == "linear":
        return _default_inv_freq(dim, theta, device) / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(dim, theta, device), p), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, p, spec.max_position, device)
    if kind == "dynamic":
        factor, limit = p["factor"], spec.max_position
        if seq_len is None or int(seq_len) <= limit:
            return _default_inv_freq(dim, theta, device), 1.0
        # fp32 tensor arithmetic, as transformers does on its tensor seq_len
        length = torch.as_tensor(seq_len, device=device).reshape(())
        base = theta * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(dim, base, device), 1.0
    raise ValueError(f"rope type {kind!r} is not supported")


def rope_cos_sin(positions: torch.Tensor, dim: int, spec: ModelSpec, dtype: torch.dtype,
                 seq_len: int | torch.Tensor | None = None):
    """cos/sin tables [s, dim] for absolute ``positions`` (split-halves layout, fp32 math, then
    ``dtype``). ``seq_len`` (dynamic rope only) defaults to ``max(positions) + 1``."""
    if seq_len is None and spec.rope_parameters.get("rope_type") == "dynamic" and positions.numel():
        seq_len = positions.max() + 1
    inv, attention = inv_freq(spec, dim, seq_len, positions.device)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)


def rope_scale_softmax(spec: ModelSpec) -> float:
    """DeepSeek-V3's softmax-scale multiplier for scaled rope (transformers' ``yarn_apply_mscale``)."""
    p = spec.rope_parameters
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        m = _yarn_mscale(p["factor"], p["mscale_all_dim"])
        return m * m
    return 1.0
