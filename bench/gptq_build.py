"""GPTQ-family builds written the way GPTQModel, AutoRound and AWQ document their packing, from 16-bit weights
(the tests' fixtures and bench/gptq_quality.py build them here; runtime/ never writes this format).

GPTQ packing (AutoGPTQ / GPTQModel, AutoRound's auto_round:auto_gptq): qweight int32 [in * b / 32, out] holds
32 / b codes per word down the input rows, the first row in the low bits; qzeros int32 [groups, out * b / 32]
the zero points the same way along the output columns, stored minus one in `checkpoint_format: gptq` (v1) and
as they are in `gptq_v2`; scales fp16 [groups, out]; g_idx int32 [in] each input row's group (act order: the
rows quantized in a permuted order, groups cut along it). AWQ (gemm): qweight int32 [in, out / 8] and qzeros
[groups, out / 8] packed along the columns, word nibble n holding column (0, 2, 4, 6, 1, 3, 5, 7)[n] of its eight;
zero points as they are. Weight: scale * (q - zero).

The quantizer here is round to nearest with GPTQ's own scale and zero rules (symmetric: scale = 2 * max|w| /
(2**b - 1), zero = 2**(b-1); asymmetric: scale = (max - min) / (2**b - 1), zero = round(-min / scale)); the
calibration GPTQ adds changes which codes are chosen, not how they are stored. `grid=True` snaps every scale to
a step EXL2 can store (fp16(fp16(k**2) * m), k in 1..16, m a normal fp16 number per group): such builds import
bit-exactly.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_down_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    c = codes.astype(np.uint64).reshape(codes.shape[0] // per, per, codes.shape[1])
    word = sum(c[:, j, :] << np.uint64(bits * j) for j in range(per))
    return (word & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def _pack_along_cols(codes: np.ndarray, bits: int, order=None) -> np.ndarray:
    per = 32 // bits
    c = codes.astype(np.uint64).reshape(codes.shape[0], codes.shape[1] // per, per)
    order = order or tuple(range(per))
    word = sum(c[:, :, order[n]] << np.uint64(bits * n) for n in range(per))
    return (word & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def snap_to_grid(scales: torch.Tensor) -> torch.Tensor:
    """Each group's scales [G, N] moved to the nearest step fp16(fp16(k**2) * m), m = fp16(max / 256) kept normal."""
    m = (scales.float().amax(1) / 256).clamp(min=2.0 ** -14).half()                     # [G]
    k = torch.sqrt(scales.float() / m.float().unsqueeze(1)).round().clamp(1, 16)
    k[torch.arange(k.shape[0]), scales.float().argmax(1)] = 16
    return ((k * k).half() * m.unsqueeze(1)).half()


def quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool, grid: bool,
             gen: torch.Generator) -> dict[str, np.ndarray]:
    """One linear [out, in] -> codes [in, out], zeros [G, out], scales fp16 [G, out], g_idx [in]."""
    out, inp = w.shape
    gs = inp if group_size == -1 else group_size
    groups = math.ceil(inp / gs)
    order = torch.randperm(inp, generator=gen) if act_order else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[order] = torch.arange(inp) // gs
    wt, maxq = w.t().double(), 2 ** bits - 1
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        x = wt[g_idx == g]
        if sym:
            scales[g] = (2 * x.abs().amax(0) / maxq).clamp(min=1e-6).float()
            zeros[g] = (maxq + 1) // 2
        else:
            lo, hi = x.amin(0).clamp(max=0), x.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / maxq).clamp(min=1e-6).float()
            zeros[g] = torch.round(-lo / scales[g].double()).long().clamp(0, maxq)
    scales = scales.half()
    if grid:
        scales = snap_to_grid(scales)
    s, z = scales.double()[g_idx], zeros[g_idx]
    codes = torch.clamp(torch.round(wt / s) + z, 0, maxq).long()
    return {"codes": codes.numpy(), "zeros": zeros.numpy(), "scales": scales.numpy(), "g_idx": g_idx.numpy()}


def pack(q: dict[str, np.ndarray], bits: int, packing: str, zero_minus_one: bool) -> dict[str, torch.Tensor]:
    stored_zeros = q["zeros"] - (1 if zero_minus_one else 0)
    if packing == "awq":
        parts = {"qweight": _pack_along_cols(q["codes"], bits, AWQ_ORDER),
                 "qzeros": _pack_along_cols(stored_zeros, bits, AWQ_ORDER)}
    else:
        parts = {"qweight": _pack_down_rows(q["codes"], bits), "qzeros": _pack_along_cols(stored_zeros, bits),
                 "g_idx": q["g_idx"].astype(np.int32)}
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
    out["scales"] = torch.from_numpy(q["scales"])
    return out


CONFIGS = {
    "gptq": lambda bits, gs, sym, act, v2: {
        "quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": act, "lm_head": False,
        "checkpoint_format": "gptq_v2" if v2 else "gptq", "pack_dtype": "int32",
        "meta": {"quantizer": ["gptqmodel:5.7.1"], "act_group_aware": True}},
    "auto-round": lambda bits, gs, sym, act, v2: {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": bits, "group_size": gs,
        "sym": sym, "data_type": "int", "autoround_version": "0.12.0"},
    "awq": lambda bits, gs, sym, act, v2: {
        "quant_method": "awq", "bits": bits, "group_size": gs, "zero_point": True, "version": "gemm"},
}


def gptq_folder(src: Path, out: Path, *, method: str = "gptq", bits: int = 4, group_size: int = 32,
                sym: bool = True, desc_act: bool = False, v2: bool = False, grid: bool = False,
                which=lambda name: ".experts." in name and not name.startswith(("mtp.", "model.visual")),
                seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of the 16-bit checkpoint `src` at `out` whose linears `which(name)` picks are quantized and packed
    as `method` stores them; -> {linear prefix: its stored tensors}."""
    import shutil
    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(out / "model.safetensors"))
    packing = "awq" if method == "awq" else "gptq"
    quantized = {}
    for name in sorted(tensors):
        if name.endswith(".weight") and tensors[name].dim() == 2 and which(name):
            prefix = name[: -len(".weight")]
            q = quantize(tensors.pop(name).float(), bits, group_size, sym, desc_act, grid, gen)
            parts = pack(q, bits, packing, zero_minus_one=packing == "gptq" and not v2)
            quantized[prefix] = parts
            tensors.update({f"{prefix}.{k}": v for k, v in parts.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = CONFIGS[method](bits, group_size, sym, desc_act, v2)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return quantized
