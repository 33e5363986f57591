"""GPTQ quantization of one linear layer into EXL2's tensor format (see format.py for the layout).

Given the HF weight W [out, in] and the Hessian H = 2 X^T X of the layer's real inputs X [tokens, in],
the columns of W (input channels) are rounded one at a time and the rounding error of each is spread
over the columns not yet rounded through the Cholesky factor of H^-1 (Frantar et al., "GPTQ", 2022),
so that ||X W^T - X Wq^T|| stays small rather than ||W - Wq||.

EXL2's structure is kept as it is:
- act-order: input channels are processed, and stored, in descending order of diag(H). EXL2's
  q_invperm records that order, and its groups run from the most bits to the fewest, so the channels
  with the largest activations also get the widest codes.
- groups and scales: each group (32 rows in the converter) is one lazy-update block. When the loop reaches it,
  its scales are searched on its weights as the error feedback has left them (format.search_scales: the
  group's maximum step times 0.70-1.20, clipping the largest weights where that lowers the error, then
  each column's 4-bit scale nudged), as exllamav2's quantizer does; codes out of range are clamped.
- one damped inverse per Hessian (`prepare`): linears fed the same input (q/k/v, gate/up) and the
  candidate widths of a measured allocation reuse it.
The result is an EXL2 tensor set like format.quantize's (format.assemble packs it), so format.dequantize,
the writer and exllamav2 read it unchanged.

Damping: H is a sample estimate from the calibration tokens. With few tokens per input channel (a 1536-wide
down_proj calibrated on 1024 tokens has a singular H) the error feedback fits the calibration text and
the error grows on any other input. On SmolLM2-135M at 4 bits with 4 x 256 calibration tokens, damping
0.01 gives down_proj 0.2-0.4x round-to-nearest's output error on the calibration rows but 1.0-1.3x on
unseen rows of the same text and 1.2-1.7x on a chat prompt; damping 3 gives 0.74-0.92x and 0.53-1.0x.
For all linears the error on unseen inputs is about flat for damping 0.3 to 3 (in_features / tokens is
0.56 and 1.5 there), and the chat prompt prefers the upper end. So the damping is at least
DAMP_PER_INPUT x in_features / tokens (`damping`): 1.4 for the 576-wide linears there, 3.75 for
down_proj; with 250 x in_features calibration tokens or more it is the given `damp`. With the default
calibration (32 x 512 tokens of exllamav2's standard set) the floor is 0.09 for the 576-wide linears and
0.23 for down_proj (exllamav2 damps by 0.12 throughout); on the demo at 3 bpw with 32 x 512 tokens (groups of 128),
dropping the floor changed the held-out perplexity from 103 to 99, and without it damping 0.03 gave 111 and
0.12 gave 104: differences within the evaluation's noise, so the floor stays for small calibrations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from . import format as fmt

DEFAULT_DAMP = 0.01           # fraction of the mean diagonal of H added to it (with a floor: `damping`)
DAMP_PER_INPUT = 2.5          # damping floor per input channel per calibration token
BLOCK = 128                   # columns per lazy-update block


class HessianAccumulator:
    """Sums 2 X^T X over batches of a layer's inputs (any leading shape, last dim = in_features)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros((in_features, in_features), dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        self.h += (x.t() @ x).to(torch.float64).mul_(2.0)    # a batch's sum in float32, the total in float64
        self.tokens += x.shape[0]


def act_order(hessian: torch.Tensor) -> torch.Tensor:
    """Input channels by descending diag(H): the order GPTQ processes and EXL2 stores them in."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


def damping(damp: float, in_features: int, tokens: int | None) -> float:
    """Fraction of H's mean diagonal to add: `damp`, raised to DAMP_PER_INPUT x in_features / tokens when H
    comes from few tokens per input channel (None: the number of tokens is unknown, `damp` as given)."""
    return damp if tokens is None else max(damp, DAMP_PER_INPUT * in_features / max(tokens, 1))


def _inverse_cholesky(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp)^-1, with more damping if H is not positive definite."""
    mean_diag = torch.diagonal(h).mean().item()
    for factor in (1, 10, 100):
        hd = h.clone()
        hd.diagonal().add_(damp * factor * max(mean_diag, 1e-12))
        try:
            hinv = torch.cholesky_inverse(torch.linalg.cholesky(hd))
            return torch.linalg.cholesky(hinv, upper=True)
        except torch.linalg.LinAlgError:
            continue
    raise fmt.Exl2FormatError(name, "Hessian is not positive definite even with 100x damping")


@dataclass
class Prepared:
    """What GPTQ needs of a Hessian, computed once for every linear fed the same input (q/k/v, gate/up,
    several candidate widths): the act-order permutation, the channels that never saw input and the
    upper Cholesky factor of the damped inverse in that order (float32, on the Hessian's device)."""
    perm: torch.Tensor
    dead: torch.Tensor
    u: torch.Tensor
    in_features: int


def prepare(hessian: torch.Tensor, *, damp: float = DEFAULT_DAMP, tokens: int | None = None,
            use_act_order: bool = True, name: str = "weight") -> Prepared:
    """Check, damp and invert a Hessian [in, in] (tokens: rows it was summed over; sets the damping's floor)."""
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise fmt.Exl2FormatError(name, f"Hessian of shape {list(hessian.shape)} is not square")
    if not torch.isfinite(hessian).all():
        raise fmt.Exl2FormatError(name, "Hessian has non-finite values")
    if tokens is not None and tokens <= 0:
        raise fmt.Exl2FormatError(name, f"Hessian summed over {tokens} tokens; the layer saw no calibration input")
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0                       # channels that never saw input
    if dead.any():
        h[dead, dead] = 1.0
    perm = act_order(h) if use_act_order else torch.arange(h.shape[0], device=h.device)
    u = _inverse_cholesky(h[perm][:, perm], damping(damp, h.shape[0], tokens), name).to(torch.float32)
    return Prepared(perm, dead, u, h.shape[0])


def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor | Prepared, bits=4,
                  group_size: int | Mapping[int, int] = 128, *, bits_prop: Sequence[float] | None = None,
                  damp: float = DEFAULT_DAMP, tokens: int | None = None, use_act_order: bool = True,
                  name: str = "weight") -> dict[str, torch.Tensor]:
    """GPTQ-quantize an HF weight [out, in] with its inputs' Hessian [in, in] (or `prepare`'s result for it)
    -> EXL2 tensor set (on the CPU). The work runs on the Hessian's device, the packing on the CPU.
    tokens: how many input rows H was summed over (HessianAccumulator.tokens); sets the damping's floor."""
    in_features = hessian.in_features if isinstance(hessian, Prepared) else hessian.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != in_features or (
            not isinstance(hessian, Prepared) and hessian.shape != (in_features, in_features)):
        shape = [in_features] * 2 if isinstance(hessian, Prepared) else list(hessian.shape)
        raise fmt.Exl2FormatError(name, f"Hessian of shape {shape} does not match a weight of "
                                        f"shape {list(weight.shape)} (expected [in, in])")
    if not torch.isfinite(weight).all():
        raise fmt.Exl2FormatError(name, "weight has non-finite values")
    fmt.quantize(weight[:1], bits, group_size, bits_prop=bits_prop, name=name)    # validates widths, sizes, range
    prep = hessian if isinstance(hessian, Prepared) else prepare(hessian, damp=damp, tokens=tokens,
                                                                 use_act_order=use_act_order, name=name)
    return quantize_gptq_many([weight], [prep], bits, group_size, bits_prop=bits_prop, names=[name])[0]


def quantize_gptq_many(weights: Sequence[torch.Tensor], preps: Sequence[Prepared], bits=4,
                       group_size: int | Mapping[int, int] = 128, *, bits_prop: Sequence[float] | None = None,
                       names: Sequence[str] | None = None) -> list[dict[str, torch.Tensor]]:
    """GPTQ of several weights of one shape [out, in], each with its own prepared Hessian (the experts of a
    layer), in one column loop: its elementwise steps run on all of them at once, so the loop's many small
    operations are launched once for all rather than once each (on a GPU they are latency-bound). Every
    weight's result is bit for bit what it gets alone (the same operations on the same values; the scale
    search and the block updates run weight by weight). -> one EXL2 tensor set each (on the CPU)."""
    names = list(names or [f"weight{i}" for i in range(len(weights))])
    if not weights or len(preps) != len(weights) or len(names) != len(weights):
        raise ValueError(f"{len(weights)} weights, {len(preps)} Hessians and {len(names)} names: one of each")
    shape = weights[0].shape
    for w, p, name in zip(weights, preps, names):
        if w.dim() != 2 or w.shape != shape or w.shape[1] != p.in_features:
            raise fmt.Exl2FormatError(name, f"weight of shape {list(w.shape)} with a Hessian of {p.in_features} "
                                            f"inputs among weights of shape {list(shape)}")
        if not torch.isfinite(w).all():
            raise fmt.Exl2FormatError(name, "weight has non-finite values")
    fmt.quantize(weights[0][:1], bits, group_size, bits_prop=bits_prop, name=names[0])  # widths, sizes, range
    dev = preps[0].u.device
    out, in_features = shape
    n = out + (-out % 32)
    wp = torch.zeros((len(weights), n, in_features), device=dev)    # [E, N, in] packed order, padded rows 0
    for e, (w, p) in enumerate(zip(weights, preps)):
        wp[e, :out] = w.detach().to(dev, torch.float32)[:, p.perm]
        if p.dead.any():
            wp[e][:, p.dead[p.perm]] = 0.0
    mix, props = fmt.resolve_bits(bits, bits_prop, names[0])
    gs = dict(group_size) if isinstance(group_size, Mapping) else {b: int(group_size) for b in mix}
    groups = fmt.plan_groups(in_features, mix, props, gs)

    codes = torch.empty_like(wp)                        # centred codes, [E, N, in]
    qscale = torch.empty((len(weights), len(groups), n), device=dev)
    qsm = torch.empty((len(weights), len(groups)), dtype=torch.float16, device=dev)
    b0 = 0
    for g, (b, rows) in enumerate(groups):             # one group = one lazy-update block
        b1 = b0 + rows
        zero = 1 << (b - 1)
        # the group's scales from its weights as the error feedback has left them (exllamav2 does the same)
        steps = []
        for e in range(len(weights)):
            qscale[e, g], qsm[e, g], step = fmt.search_scales(wp[e, :, b0:b1].t(), b)
            steps.append(step)
        step = torch.stack(steps)                                       # [E, N]
        wb = wp[:, :, b0:b1].clone()
        err = torch.zeros_like(wb)
        ub = torch.stack([p.u[b0:b1, b0:b1] for p in preps])            # [E, rows, rows]
        for j in range(rows):
            q = torch.clamp(torch.round(wb[:, :, j] / step), -zero, zero - 1)
            codes[:, :, b0 + j] = q
            e = (wb[:, :, j] - q * step) / ub[:, j, j].unsqueeze(1)
            wb[:, :, j:] -= e.unsqueeze(2) * ub[:, j, j:].unsqueeze(1)
            err[:, :, j] = e
        for e, p in enumerate(preps):
            wp[e, :, b1:] -= err[e] @ p.u[b0:b1, b1:]
        b0 = b1
    codes[:, out:] = 0                                  # padded columns hold the zero code
    qscale[:, :, out:] = 16                             # as the plain quantizer leaves them
    return [fmt.assemble(codes[e].t().to(torch.int64), qscale[e], qsm[e], groups, p.perm, name)
            for e, (p, name) in enumerate(zip(preps, names))]
