"""Rotary position embeddings: the cos/sin tables, with the scalings Llama and Qwen3 configs use.

Supported `rope_type`s: "default", "linear" (positions divided by `factor`) and "llama3" (Llama 3.1's
frequency-dependent smoothing). Both the older config spelling (`rope_theta` + `rope_scaling`) and
the newer one (`rope_parameters` holding theta and the type) are read.

Layout as in the HF checkpoints: each head's dimensions are two halves, (x1, x2) -> rotate_half = (-x2, x1).
D = head dim, S = positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.errors import UnsupportedArchitecture
from runtime.modelfolder import check_rope

ROPE_TYPES = ("default", "linear", "llama3")


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
    return RopeConfig(theta, rope_type, params)


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[D/2] inverse frequencies (float32)."""
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
    """cos, sin: [S, D] for positions 0..length-1 (each half repeated, matching rotate_half)."""
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq(rope, head_dim)[None, :]   # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                                            # [S, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)
