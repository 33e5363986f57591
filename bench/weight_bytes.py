"""Bytes of weights one decode step reads in the CUDA engine, from an EXL2 folder's stored tensor sizes
(the roofline's divisor, bench/roofline.py).

Pure arithmetic over the safetensors headers (no torch, no GPU): what the roofline of a decode step
divides the memory bandwidth by. Per token, at batch 1:
- every dense tensor once: attention, norms, routers, dense MLPs, shared experts, the head;
- one row of the embeddings (the whole table where the head is tied to it: the head reads it all);
- per MoE layer, top_k experts: top_k times the mean stored bytes of that layer's experts.
A linear counts all its stored EXL2 parts (codes, scales, groups, the permutation: the kernels read
each once per step). The KV cache is not counted. Multi-token-prediction layers (`mtp.`) are left
out: a plain decode step does not run them; so is a vision tower (`model.visual.`).

`decode_weight_bytes(folder, telemetry)` is what the worker benchmark adds to the load's telemetry of
an engine that reports no `weight_bytes_per_token` of its own (the exllamav2-based engine): computed
in the benchmark's process, so a user's load reads no more than it needs.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

from runtime import qwen35
from runtime.errors import InvalidModel
from runtime.modelfolder import DTYPE_BYTES, flat_config, read_header, read_json

# Layers under model. (Llama, Qwen3, Mixtral), model.language_model. (Qwen3.5-MoE, a multimodal checkpoint)
# or transformer.blocks. (DBRX)
EXPERT = re.compile(r"^(?:model\.(?:language_model\.)?layers|transformer\.blocks)\.(\d+)\..*\.experts\.(\d+)\.")
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight")
NOT_READ = ("mtp.", "model.visual.")   # the MTP head (a draft), a vision tower (images are not supported)
PARTS = ("attention", "norms", "router", "dense_mlp", "shared_experts", "experts", "embeddings", "head", "other")


def _nbytes(entry: dict, where: Path, name: str) -> int:
    if entry["dtype"] not in DTYPE_BYTES:
        raise InvalidModel(where, f"tensor {name!r}: dtype {entry['dtype']!r} is not one this engine reads")
    return math.prod(entry["shape"]) * DTYPE_BYTES[entry["dtype"]]


def _part(name: str) -> str:
    """Which part of a decode step a dense tensor belongs to (its name's words)."""
    if name.startswith("lm_head."):
        return "head"
    if "norm" in name.rsplit(".", 2)[-2] or name.endswith(("norm.weight", "norm.bias")):
        return "norms"
    if ".shared_expert" in name:
        return "shared_experts"
    if name.rsplit(".", 2)[-2] == "gate" or ".router." in name:
        return "router"
    if ".self_attn." in name or ".linear_attn." in name or ".attn." in name:
        return "attention"
    if ".mlp." in name or ".ffn." in name:
        return "dense_mlp"
    return "other"


def tensor_sizes(folder: str | Path) -> dict[str, int]:
    """Stored bytes of every tensor of the folder's safetensors files (their headers, checked)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidModel(folder, "no .safetensors files")
    sizes: dict[str, int] = {}
    for f in files:
        for name, entry in read_header(f).items():
            sizes.setdefault(name, _nbytes(entry, f, name))
    return sizes


def weight_bytes_per_token(folder: str | Path, sizes: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """Bytes of weights one decode step reads, by part (PARTS) and in all (`total`), with the per-layer
    bytes of one expert (`expert_bytes_per_layer`, the mean of the layer's experts) and `top_k`.
    `sizes`: the folder's `tensor_sizes`, where the caller has read them already."""
    folder = Path(folder)
    raw = read_json(folder / "config.json", "config.json")
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if isinstance(archs, list) and archs and archs[0] in qwen35.ARCHITECTURES:
        config = qwen35.read_config(raw, folder / "config.json")         # sizes under text_config
    else:
        config = flat_config(raw)
    sizes = tensor_sizes(folder) if sizes is None else sizes
    top_k = int(config.get("num_experts_per_tok") or config.get("num_experts_per_token") or 0)
    parts = dict.fromkeys(PARTS, 0)
    experts: dict[int, dict[int, int]] = {}                        # layer -> expert -> bytes
    tied = not any(n.startswith("lm_head.") for n in sizes)
    for name, n in sizes.items():
        if name.startswith(NOT_READ):
            continue
        m = EXPERT.match(name)
        if m:
            layer = experts.setdefault(int(m.group(1)), {})
            layer[int(m.group(2))] = layer.get(int(m.group(2)), 0) + n
        elif name in EMBEDDINGS:
            rows = int(config.get("vocab_size") or 0)
            parts["embeddings"] += n if tied or rows <= 0 else n // rows
        else:
            parts[_part(name)] += n
    if experts and top_k <= 0:
        raise InvalidModel(folder / "config.json", "an MoE model without num_experts_per_tok")
    per_layer = {layer: sum(e.values()) / len(e) for layer, e in sorted(experts.items())}
    parts["experts"] = round(sum(min(top_k, len(experts[layer])) * b for layer, b in per_layer.items()))
    out: dict[str, Any] = dict(parts)
    out["total"] = sum(parts.values())
    out["expert_bytes_per_layer"] = [round(b) for b in per_layer.values()]
    out["top_k"] = top_k if experts else 0
    return out


def decode_weight_bytes(folder: str | Path, telemetry: dict) -> Optional[dict[str, Any]]:
    """The telemetry keys `weight_bytes_per_token` (bytes) and `weight_bytes_per_token_parts` for a model
    on an EXL2 folder whose engine reports none of its own (`telemetry`: its figures); None otherwise
    (or for a folder whose sizes cannot be read: the roofline is then left out)."""
    if "weight_bytes_per_token" in telemetry:
        return None
    try:
        sizes = tensor_sizes(folder)
        if not any(name.endswith(".q_weight") for name in sizes):
            return None
        parts = weight_bytes_per_token(folder, sizes)
    except (InvalidModel, OSError, ValueError, TypeError):
        return None
    return {"weight_bytes_per_token": parts["total"], "weight_bytes_per_token_parts": parts}
