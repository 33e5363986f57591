"""The CPU engine's integer projections: y = x @ W.T (+ b) by the CPU kernel's integer dot products
(runtime/cpu/csrc/qdot.cpp), the same that compute the experts of the offload's CPU path.

The weights are codes with a scale per group of input rows and output column:
- EXL2 linears keep their own codes (2..8 bits) and scales, bit for bit (`from_exl2`): a 3-bit model
  reads 3 bits a weight; where a linear has exact scales (q_scale_exact, an imported GPTQ build's), those are
  the scales kept, so the kernel computes with the build's own weights;
- plain weights are quantized to 8-bit codes per group of 128 inputs, one fp16 scale per group and
  output (`from_float`): finer than one scale per output row.
Each call quantizes x to int8 per group of the codes (in the kernel), so a decode step reads each weight
once at about the memory's speed. Several projections of one input (q/k/v, gate/up) are one call with
their outputs side by side. Activations in and out: float32 or bfloat16, as given.

N outputs, K inputs, P projections of a fused layer.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

GROUP = 128        # input rows per scale of quantized plain weights
# What rounding the activations to int8 per group costs, relative to the largest output of the float reference:
# the bound every check of the integer kernels uses (the linears, the CPU experts, an import's logits, the
# CPU path's host rows of bench.check_experts).
INT8_ACTIVATIONS_TOLERANCE = 3e-2
CHUNK = 32         # the kernel's rows per chunk: K is padded up to a multiple
TILE = 16          # the kernel's columns per tile: N is padded up to a multiple
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel():
    """The CPU kernel module, or None when it cannot be built here (no compiler): the caller keeps its
    torch path then."""
    from runtime.cpu import experts as ce
    try:
        return ce.load_kernel()
    except ce.CpuExpertsError:
        return None


def quantize_plain(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A plain weight [N, K] -> one projection of the kernel's store (as runtime/cpu/experts._to_exl2 gives an EXL2
    one): 8-bit codes (w / s rounded, plus 128) per group of GROUP inputs, s = max |w| / 127 of the group's
    column, as fp16. K is padded with zero weights to a multiple of 32 (their inputs read feature 0) and N
    with zero columns to a multiple of 16."""
    n, k = w.shape
    kp, np_ = -(-k // CHUNK) * CHUNK, -(-n // TILE) * TILE
    wp = torch.zeros(np_, kp, dtype=torch.float32)
    wp[:n, :k] = w.float()
    rows = [min(GROUP, kp - r0) for r0 in range(0, kp, GROUP)]
    cols = torch.split(wp, rows, dim=1)                                       # per group [N, rows]
    s = torch.stack([c.abs().amax(dim=1) for c in cols]) / 127                # [G, N]
    s16 = s.to(torch.float16)
    step = torch.repeat_interleave(s16.float(), torch.tensor(rows), dim=0).t()   # [N, K]
    codes = torch.where(step > 0, torch.round(wp / torch.where(step > 0, step, 1.0)), 0.0)
    codes = (codes.clamp(-128, 127) + 128).to(torch.uint8)                   # [N, K]
    words = codes.view(np_ // TILE, TILE, kp // 4, 4).permute(0, 2, 1, 3).contiguous()   # byte j of word q: row 4q + j
    grp, r0 = [], 0
    for r in rows:
        grp.append([8, r0 // 4, r0, r])
        r0 += r
    perm = torch.arange(kp, dtype=torch.int32)
    perm[k:] = 0
    return {"qw": words.view(torch.int32).view(np_ // TILE, kp // 4, TILE),
            "sc": s16.view(len(rows), np_ // TILE, TILE).permute(1, 0, 2).contiguous(),
            "grp": torch.tensor(grp, dtype=torch.int32), "perm": perm,
            "shape": torch.tensor([kp, n, kp // 4], dtype=torch.int64)}


class QLinear:
    """P projections of one input as the kernel's store: flat buffers and desc [P, 8]."""

    def __init__(self, parts: Sequence[Mapping[str, torch.Tensor]], in_features: int, bias: Optional[torch.Tensor],
                 ext):
        from runtime.cpu.experts import flatten
        self.flat, self.desc = flatten(parts)
        self.in_features = in_features
        self.out_features = int(self.desc[:, 6].sum())
        self.bias = bias
        self.ext = ext
        self._forward = ext.linear_forward
        self._store = (self.flat["qw"], self.flat["sc"], self.flat["grp"], self.flat["perm"], self.desc)

    @classmethod
    def from_exl2(cls, parts: Sequence[Mapping[str, torch.Tensor]], outs: Sequence[int], bias, ext,
                  name: str = "linear") -> "QLinear":
        """EXL2 tensor sets of P projections of one input (their codes and scales kept: q_scale_exact where a
        set has it, ModelFolder.exl2_tensors) -> QLinear; raises
        CpuExpertsError where the kernel cannot take them (rows of a group not a multiple of 32)."""
        from runtime.cpu.experts import _to_exl2
        conv = [_to_exl2(t, o, f"{name}[{i}]") for i, (t, o) in enumerate(zip(parts, outs))]
        return cls(conv, int(conv[0]["shape"][0]), bias, ext)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias, ext) -> "QLinear":
        return cls([quantize_plain(weight)], weight.shape[1], bias, ext)

    def __call__(self, x: torch.Tensor, norm: Optional[torch.Tensor] = None, eps: float = 1e-6, act: str = "none",
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] (act "silu_mul": [..., 2K], gate then up) -> [..., N]; norm: float32 [K], the input
        RMS-normalised and scaled by it first; residual [..., N] of x's dtype: the result added to it in
        place (the bias too), and it returned."""
        if x.dim() == 2 and x.dtype in KERNEL_DTYPES and x.is_contiguous() and \
                (residual is None or residual.dim() == 2) and self.bias is None:
            return self._forward(x, *self._store, norm, eps, act, residual)        # a decode step's calls
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype not in KERNEL_DTYPES:
            x2 = x2.float()
        res = None if residual is None else residual.view(-1, self.out_features)
        y = self._forward(x2.contiguous(), *self._store, norm, eps, act, res)
        if self.bias is not None:
            y = y.add_(self.bias) if residual is not None else y + self.bias
        return y.view(*lead, self.out_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())
