"""GPTQ-family checkpoints for the tests (written by bench/gptq_build.py, the packing as GPTQModel, AutoRound and
AWQ document it) and an independent dequantization of them: numpy, written from the same documentation, sharing
nothing with runtime/. Weight: fp16(scale * (q - zero)); GPTQ v1 zero points are stored minus one."""
from __future__ import annotations

import numpy as np
import torch

from bench.gptq_build import AWQ_ORDER, gptq_folder, pack, quantize  # noqa: F401 (the tests' writers)


def _unpack_down_rows(words: np.ndarray, bits: int) -> np.ndarray:
    per, u = 32 // bits, words.view(np.uint32).astype(np.uint64)
    rows = [(u >> np.uint64(bits * j)) & np.uint64((1 << bits) - 1) for j in range(per)]
    return np.stack(rows, axis=1).reshape(-1, words.shape[1]).astype(np.int64)


def _unpack_along_cols(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    per, u = 32 // bits, words.view(np.uint32).astype(np.uint64)
    order = order or tuple(range(per))
    out = np.empty((words.shape[0], words.shape[1], per), dtype=np.int64)
    for n in range(per):
        out[:, :, order[n]] = (u >> np.uint64(bits * n)) & np.uint64((1 << bits) - 1)
    return out.reshape(words.shape[0], -1)


def dequantize(parts: dict[str, torch.Tensor], bits: int, packing: str, zero_offset: int, group_size: int,
               out: int, fp16: bool = True) -> torch.Tensor:
    """The documented dequantization, in numpy: W [out, in] = fp16(scale * (q - zero)), as float32; fp16=False:
    scale * (q - zero) in float64, the product before its rounding (what an integer kernel multiplies)."""
    qw, qz = parts["qweight"].numpy(), parts["qzeros"].numpy()
    scales = parts["scales"].float().numpy().astype(np.float64)
    if packing == "awq":
        codes, zeros = _unpack_along_cols(qw, bits, AWQ_ORDER), _unpack_along_cols(qz, bits, AWQ_ORDER)
    else:
        codes, zeros = _unpack_down_rows(qw, bits), _unpack_along_cols(qz, bits)
    zeros = zeros + zero_offset
    inp = codes.shape[0]
    g_idx = parts["g_idx"].numpy() if "g_idx" in parts else np.arange(inp) // (inp if group_size == -1 else group_size)
    w = scales[g_idx] * (codes - zeros[g_idx])                                            # [in, out] exact
    if not fp16:
        return torch.from_numpy(w.T[:out].copy())
    return torch.from_numpy(w.astype(np.float16).astype(np.float32).T[:out].copy())


def packed_layer_matches(w1, w3, w2, folder, experts: str, build: dict, offset: int, group_size: int) -> bool:
    """Whether the packed gate, up and down of every expert under `experts` (`...mlp.experts`, the names of the
    folder and of `build`, the build's stored tensors: Qwen3-MoE / Qwen3.5 names) are the build's weights as the
    dequantization above gives them, bit for bit. The layer is packed as runtime/experts/pack.pack_layer packs it:
    its intermediate in down's packed order (perm: argsort of down's q_invperm in the imported folder)."""
    from runtime.experts.pack import dequantize_packed
    for e in range(w2.num_experts):
        p = f"{experts}.{e}"
        perm = torch.argsort(folder.tensor(f"{p}.down_proj.q_invperm").long())
        inter = perm.numel()
        want = {name: dequantize(build[f"{p}.{name}"], 4, "gptq", offset, group_size, rows)
                for name, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", w2.out_features))}
        got = {"gate_proj": dequantize_packed(w1, e)[:inter], "up_proj": dequantize_packed(w3, e)[:inter],
               "down_proj": dequantize_packed(w2, e)}
        if not (torch.equal(got["gate_proj"].half().float().cpu(), want["gate_proj"][perm])
                and torch.equal(got["up_proj"].half().float().cpu(), want["up_proj"][perm])
                and torch.equal(got["down_proj"].half().float().cpu(), want["down_proj"][:, perm])):
            return False
    return True
