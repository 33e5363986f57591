"""Rotary position embeddings: the cos/sin tables, with the scalings Llama and Qwen3 configs use.

Supported `rope_type`s: "default", "linear" (positions divided by `factor`), "llama3" (Llama 3.1's
frequency-dependent smoothing) and "yarn" (YaRN, as Qwen's long-context setups configure it: each
frequency between interpolated (divided by `factor`) and kept, by a linear ramp over the dimensions
that turn `beta_fast` to `beta_slow` times within `original_max_position_embeddings`; cos and sin then
scaled by the attention factor, 0.1 ln(factor) + 1 unless the config gives `attention_factor` or
`mscale` / `mscale_all_dim`), all as transformers' modeling_rope_utils computes them. Both the older
config spelling (`rope_theta` + `rope_scaling`) and the newer one (`rope_parameters` holding theta and
the type) are read.

One source of tables for every engine: the CPU reference engine, the hybrid GPU engine and the CUDA
engine (runtime/backends/exl2_arch.py replaces exllamav2's own tables with these) all call `tables`.

Layout as in the HF checkpoints: each head's dimensions are two halves, (x1, x2) -> rotate_half = (-x2, x1).
D = head dim, S = positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.errors import UnsupportedArchitecture
from runtime.modelfolder import check_rope

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str
    params: dict


def rope_config(config: dict, where: str) -> RopeConfig:
    """Read theta and scaling from a config.json dict; `where` names the file for errors."""
    params = check_rope(config, where)          # every field the known types need, present and in range
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitecture(where,
                                      f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture(where, "partial rotary embeddings are not supported")
    if rope_type == "yarn":              # transformers' default: the config's own original length, else its max
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params = {**params, "original_max_position_embeddings": original or config.get("max_position_embeddings")}
        if not params["original_max_position_embeddings"]:
            raise UnsupportedArchitecture(where, "rope type 'yarn' needs 'original_max_position_embeddings' or "
                                                 "'max_position_embeddings'")
    return RopeConfig(theta, rope_type, params)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 for the other types)."""
    if rope.rope_type != "yarn":
        return 1.0
    p, factor = rope.params, float(rope.params["factor"])
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _mscale(factor, float(p["mscale"])) / _mscale(factor, float(p["mscale_all_dim"]))
    return _mscale(factor)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies over `dim` rotated dimensions (transformers' _compute_yarn_parameters)."""
    p = rope.params
    factor, original = float(p["factor"]), float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:         # the dimension that turns `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp                                  # 1: extrapolated (kept), 0: interpolated (divided by factor)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[D/2] inverse frequencies (float32)."""
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return freq / float(rope.params["factor"])
    if rope.rope_type == "llama3":
        factor = float(rope.params["factor"])
        low, high = float(rope.params["low_freq_factor"]), float(rope.params["high_freq_factor"])
        old_len = float(rope.params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return freq


def tables(rope: RopeConfig, head_dim: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, D] for positions 0..length-1 (each half repeated, matching rotate_half), times the
    attention factor (YaRN's; 1 otherwise)."""
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq(rope, head_dim)[None, :]   # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                                            # [S, D]
    scale = attention_factor(rope)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)
