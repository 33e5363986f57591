"""The CPU reference engine: a compact pure-PyTorch Llama / Qwen3 / Qwen3-MoE / Mixtral / DBRX / Qwen3.5-MoE
for machines without a GPU.

`load(path, options, progress)` validates the folder, reads and dequantizes every weight (plain or
EXL2), and returns the engine with a note per option saying whether it was applied.

Modules: weights.py (config -> Spec, weights read and fused), rope.py (position tables),
model.py (the forward pass and KV cache), engine.py (the Engine interface); Qwen3.5-MoE's hybrid
stack: qwen35.py (spec, weights, forward), deltanet.py (linear attention), hybrid.py (its cache,
rollback and engine).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from runtime.cpu_load import physical_cores
from runtime.engine import ModelInfo, ProgressFn
from runtime.errors import OutOfMemory
from runtime.options import LoadOptions

# Weight precision of the reference engine, measured on the demo model (docs/cpu-kernel.md has the figures):
# "int8" runs the CPU kernel's integer dot products (an EXL2 folder's own codes, plain weights as 8-bit
# codes; qlinear.py), faster than float32 or bfloat16 weights (a decode step is bound by the bytes of weights
# it reads), and keeps the demo model's answers; "float32" is for parity checks.
DEFAULT_PRECISION = "int8"

IGNORED = "ignored: CPU reference engine "


def load(path: str | os.PathLike, options: Optional[LoadOptions] = None, progress: Optional[ProgressFn] = None, *,
         precision: Optional[str] = None, device: str = "cpu"):
    """-> (ReferenceEngine, {option path: "applied..." | "ignored: why"}). device: "cpu", or "cuda" for
    parity checks on a GPU machine (float32/bfloat16, Llama/Qwen3/Qwen3-MoE/Mixtral/DBRX: the same weights and
    forward pass, dequantized and run there, float32 matmuls without TF32); logits come back on the CPU."""
    import torch

    from runtime import qwen35
    from runtime.modelfolder import ModelFolder
    from runtime.reference.engine import ReferenceEngine
    from runtime.reference.weights import Spec, load_weights

    options = options or LoadOptions()
    progress = progress or (lambda stage, message, done, total: None)
    off = options.offload
    precision = precision or DEFAULT_PRECISION

    threads = off.cpu_threads or physical_cores()
    torch.set_num_threads(threads)
    progress("validate", f"Checking {Path(path).name}", 0, 1)
    folder = ModelFolder(path)
    hybrid = folder.config["architectures"][0] in qwen35.ARCHITECTURES
    if hybrid and torch.device(device).type != "cpu":
        raise ValueError(f"the reference engine runs Qwen3.5-MoE on the CPU only, not on {device}")
    if hybrid:                                  # Qwen3.5-MoE: DeltaNet and gated attention layers
        from runtime.reference import mtp
        from runtime.reference import qwen35 as reference35
        from runtime.reference.hybrid import HybridEngine
        spec = reference35.Spec.from_config(folder.config, str(folder.path / "config.json"))
        read, engine_class = mtp.load_weights, HybridEngine      # with the MTP head when there is one
    else:
        spec = Spec.from_config(folder.config, str(folder.path / "config.json"))
        read, engine_class = (lambda *a: load_weights(*a, device=device)), ReferenceEngine
    progress("validate", f"Checking {folder.info.name}", 1, 1)
    context = min(off.context_length, spec.max_positions)
    try:
        weights = read(folder, spec, precision,
                               lambda done, total: progress("load", f"Loading weights ({precision})", done, total))
    except MemoryError as e:
        raise OutOfMemory(f"not enough memory to load {folder.info.name} on the CPU", str(e)) from None
    finally:
        folder.close()
    info = folder.info
    model_info = ModelInfo(name=info.name, path=str(info.path), architecture=info.architecture,
                           vocab_size=info.vocab_size, context_length=context, num_layers=info.num_layers,
                           num_experts=info.num_experts, experts_per_token=info.experts_per_token,
                           bits_per_weight=info.bits_per_weight,
                           extra={"precision": precision, "num_params": info.num_params,
                                  "active_params": info.active_params, "is_exl2": info.is_exl2})
    engine = engine_class(model_info, spec, weights, context, adapts_threads=not off.cpu_threads)

    applied = {
        "offload.backend": "applied" if off.backend in ("cpu", "auto") else IGNORED + "runs on the CPU",
        "offload.context_length": "applied" if context == off.context_length else
        f"applied: capped at {context}, the model's max_position_embeddings",
        "offload.cpu_threads": "applied" if off.cpu_threads else
        f"applied: automatic, up to {threads} (the physical cores less those other programs keep busy)",
        "offload.vram_budget_gb": IGNORED + ("uses no GPU memory" if torch.device(device).type == "cpu"
                                             else f"keeps every weight on {device}"),
        "offload.ram_budget_gb": IGNORED + "keeps every weight in RAM",
        "offload.kv_cache": IGNORED + f"keeps the cache in {str(weights.dtype).removeprefix('torch.')}",
        "offload.placement": IGNORED + "computes every expert on the CPU",
    }
    return engine, applied
