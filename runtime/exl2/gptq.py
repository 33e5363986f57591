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

Batched (`gptq_columns`): many weights of one shape run through one column loop, laid out as
[in, E, M, N] (rows = input channels in packed order; E weights with their own Hessians, such as the experts
of a layer, each with M copies sharing that Hessian: its parts (gate and up) times the candidate widths of
a measured allocation, each copy with its own plan of group widths). Every elementwise step, the scale
search and the lazy block update run once for the whole batch, with no host synchronisation inside the
loop: on a GPU the loop's many small operations are latency-bound, so the launches, not the arithmetic,
set its time, and one loop for a layer's experts at all their widths takes what one weight took.
Each weight's result is what it gets alone, up to the rounding order of batched reductions and matrix
products (tests/test_exl2_gptq_batched.py).
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
from .allocate import relative_errors

DEFAULT_DAMP = 0.01           # fraction of the mean diagonal of H added to it (with a floor: `damping`)
DAMP_PER_INPUT = 2.5          # damping floor per input channel per calibration token
PREPARE_BYTES = 256 << 20     # float64 Hessians factorised at once (a batch is cut into slices of this size)


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
    """Input channels by descending diag(H) ([..., in, in] -> [..., in]): the order GPTQ processes and EXL2
    stores them in."""
    return torch.argsort(torch.diagonal(hessian, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)


def damping(damp: float, in_features: int, tokens: int | None) -> float:
    """Fraction of H's mean diagonal to add: `damp`, raised to DAMP_PER_INPUT x in_features / tokens when H
    comes from few tokens per input channel (None: the number of tokens is unknown, `damp` as given)."""
    return damp if tokens is None else max(damp, DAMP_PER_INPUT * in_features / max(tokens, 1))


def _inverse_cholesky(h: torch.Tensor, damp: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """Upper Cholesky factors of (H + damp)^-1 for a batch h [E, n, n] (float64; damp [E], fraction of each
    mean diagonal), with 10x and then 100x the damping for those not positive definite."""
    mean_diag = torch.diagonal(h, dim1=-2, dim2=-1).mean(dim=-1).clamp(min=1e-12)
    out = torch.empty_like(h)
    todo = torch.arange(h.shape[0], device=h.device)
    for factor in (1, 10, 100):
        hd = h[todo]
        hd.diagonal(dim1=-2, dim2=-1).add_((damp[todo] * factor * mean_diag[todo]).unsqueeze(1))
        low, info = torch.linalg.cholesky_ex(hd)
        upper, info_inv = torch.linalg.cholesky_ex(torch.cholesky_inverse(low), upper=True)
        ok = (info == 0) & (info_inv == 0)
        out[todo[ok]] = upper[ok]
        todo = todo[~ok]
        if todo.numel() == 0:
            return out
    raise fmt.Exl2FormatError(names[int(todo[0])], "Hessian is not positive definite even with 100x damping")


@dataclass
class Prepared:
    """What GPTQ needs of a Hessian, computed once for every linear fed the same input (q/k/v, gate/up,
    several candidate widths): the act-order permutation, the channels that never saw input and the
    upper Cholesky factor of the damped inverse in that order (float32, on the Hessian's device).
    One Hessian ([in], [in, in]) or a batch of them ([E, in], [E, in, in]: `prepare_many`)."""
    perm: torch.Tensor
    dead: torch.Tensor
    u: torch.Tensor
    in_features: int


def prepare(hessian: torch.Tensor, *, damp: float = DEFAULT_DAMP, tokens: int | None = None,
            use_act_order: bool = True, name: str = "weight") -> Prepared:
    """Check, damp and invert a Hessian [in, in] (tokens: rows it was summed over; sets the damping's floor)."""
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise fmt.Exl2FormatError(name, f"Hessian of shape {list(hessian.shape)} is not square")
    p = prepare_many(hessian.unsqueeze(0), damp=damp, tokens=[tokens], use_act_order=use_act_order, names=[name])
    return Prepared(p.perm[0], p.dead[0], p.u[0], p.in_features)


def prepare_many(hessians: torch.Tensor, *, damp: float = DEFAULT_DAMP, tokens: Sequence[int | None],
                 use_act_order: bool = True, names: Sequence[str]) -> Prepared:
    """`prepare` for a batch of Hessians [E, in, in] at once (the experts of a layer): one batched
    factorisation, retried with more damping only for those that need it. -> a batched Prepared."""
    if hessians.dim() != 3 or hessians.shape[1] != hessians.shape[2]:
        raise fmt.Exl2FormatError(names[0], f"Hessian of shape {list(hessians.shape[1:])} is not square")
    if not torch.isfinite(hessians).all():
        bad = int(torch.nonzero(~torch.isfinite(hessians).flatten(1).all(dim=1))[0])
        raise fmt.Exl2FormatError(names[bad], "Hessian has non-finite values")
    for t, name in zip(tokens, names):
        if t is not None and t <= 0:
            raise fmt.Exl2FormatError(name, f"Hessian summed over {t} tokens; the layer saw no calibration input")
    n = hessians.shape[-1]
    step = max(1, PREPARE_BYTES // (n * n * 8))
    parts = []
    for e0 in range(0, hessians.shape[0], step):           # a slice at a time: a factorisation takes ~6 copies
        h = hessians[e0:e0 + step].detach().to(torch.float64).clone()
        diag = torch.diagonal(h, dim1=-2, dim2=-1)
        dead = diag == 0                                    # channels that never saw input
        diag.masked_fill_(dead, 1.0)
        perm = act_order(h) if use_act_order else torch.arange(n, device=h.device).expand(h.shape[0], n)
        h = h.gather(1, perm.unsqueeze(2).expand(-1, -1, n)).gather(2, perm.unsqueeze(1).expand(-1, n, -1))
        damps = torch.tensor([damping(damp, n, t) for t in tokens[e0:e0 + step]], dtype=torch.float64,
                             device=h.device)
        parts.append((perm, dead, _inverse_cholesky(h, damps, names[e0:e0 + step]).to(torch.float32)))
    if len(parts) == 1:
        return Prepared(*parts[0], n)
    return Prepared(*(torch.cat(t) for t in zip(*parts)), n)


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
    """GPTQ of several weights of one shape [out, in], each with its own prepared Hessian, in one column loop
    (gptq_columns). -> one EXL2 tensor set each (on the CPU)."""
    names = list(names or [f"weight{i}" for i in range(len(weights))])
    if not weights or len(preps) != len(weights) or len(names) != len(weights):
        raise ValueError(f"{len(weights)} weights, {len(preps)} Hessians and {len(names)} names: one of each")
    shape = weights[0].shape
    for w, p, name in zip(weights, preps, names):
        if w.dim() != 2 or w.shape != shape or w.shape[1] != p.in_features:
            raise fmt.Exl2FormatError(name, f"weight of shape {list(w.shape)} with a Hessian of {p.in_features} "
                                            f"inputs among weights of shape {list(shape)}")
    fmt.quantize(weights[0][:1], bits, group_size, bits_prop=bits_prop, name=names[0])  # widths, sizes, range
    mix, props = fmt.resolve_bits(bits, bits_prop, names[0])
    gs = dict(group_size) if isinstance(group_size, Mapping) else {b: int(group_size) for b in mix}
    plan = fmt.plan_groups(shape[1], mix, props, gs)
    prep = Prepared(torch.stack([p.perm for p in preps]), torch.stack([p.dead for p in preps]),
                    torch.stack([p.u for p in preps]), shape[1])
    sets = quantize_stacked([[w] for w in weights], prep, [plan], [[n] for n in names])[0]
    return [s[0][0] for s in sets]


# ---------------------------------------------------------------------------------------------
# The batched loop

def pack_weights(weights: Sequence[Sequence[torch.Tensor]], prep: Prepared, copies: int,
                 names: Sequence[Sequence[str]]) -> torch.Tensor:
    """weights[e][p] ([out, in], any float dtype and device) -> wp [in, E, P x copies, N] float32 on the Hessians'
    device: each transposed into packed order (prep's permutation, its own where prep is a batch, else the shared
    one), channels that never saw input zeroed, output columns padded with zeros to N, each repeated `copies`
    times (one per candidate width)."""
    dev = prep.u.device
    out, in_features = weights[0][0].shape
    n, parts = out + (-out % 32), len(weights[0])
    wp = torch.zeros((in_features, len(weights), parts * copies, n), device=dev)
    batched = prep.perm.dim() == 2
    for e, ws in enumerate(weights):
        perm = prep.perm[e] if batched else prep.perm
        for p, w in enumerate(ws):
            wp[:, e, p * copies, :out] = w.detach().to(dev, torch.float32).t()[perm]
    finite = torch.isfinite(wp[:, :, ::copies]).flatten(2).all(dim=2).all(dim=0)       # [E, P]
    if not finite.all():
        e, p = (int(i) for i in torch.nonzero(~finite)[0])
        raise fmt.Exl2FormatError(names[e][p], "weight has non-finite values")
    dead = prep.dead.gather(-1, prep.perm)                       # [E, in] or [in], in packed order
    wp.masked_fill_((dead.t() if batched else dead.unsqueeze(1)).unsqueeze(-1).unsqueeze(-1), 0.0)
    for p in range(parts):
        wp[:, :, p * copies + 1:(p + 1) * copies] = wp[:, :, p * copies:p * copies + 1]
    return wp


def gptq_columns(wp: torch.Tensor, u: torch.Tensor, gbits: torch.Tensor, group_rows: Sequence[int]):
    """The GPTQ column loop over a batch (see the module's docstring).
    wp [in, E, M, N] float32 in packed order, rewritten in place; u [E or 1, in, in] the upper Cholesky factors of
    the damped inverse Hessians in packed order (1: one shared by all E); gbits [M, G] the code width of group g
    of copy m (every copy's groups span the same `group_rows`).
    -> (codes [in, E, M, N] int8 centred, qscale [G, E, M, N] float 1..16, q_scale_max [G, E, M] fp16)."""
    in_features, n_e, m, n = wp.shape
    codes = torch.empty(wp.shape, dtype=torch.int8, device=wp.device)
    qscale = torch.empty((len(group_rows), n_e, m, n), device=wp.device)
    qsm = torch.empty((len(group_rows), n_e, m), dtype=torch.float16, device=wp.device)
    zero = torch.exp2(gbits.to(torch.float32) - 1)                  # [M, G]
    shared = u.shape[0] == 1
    b0 = 0
    for g, rows in enumerate(group_rows):
        b1 = b0 + rows
        wb = wp[b0:b1]                                               # [rows, E, M, N], a view
        # the group's scales from its weights as the error feedback has left them (exllamav2 does the same)
        qscale[g], qsm[g], step = fmt.search_scales(wb, gbits[:, g])  # [E, M, N], [E, M], [E, M, N]
        lo, hi = -zero[:, g].view(1, m, 1), (zero[:, g] - 1).view(1, m, 1)
        ub = u[:, b0:b1, b0:b1].permute(1, 2, 0)                     # [rows, rows, E or 1]
        diag = torch.diagonal(ub).t().unsqueeze(-1).unsqueeze(-1)    # [rows, E or 1, 1, 1]
        err = torch.empty_like(wb)
        for j, (w, e, d) in enumerate(zip(wb.unbind(0), err.unbind(0), diag.unbind(0))):
            q = torch.div(w, step).round_().clamp_(lo, hi)
            torch.mul(q, step, out=e)
            torch.sub(w, e, out=e).div_(d)
            codes[b0 + j] = q
            if j + 1 < rows:                                         # spread the error over the group's rest
                wb[j + 1:] -= ub[j, j + 1:].unsqueeze(-1).unsqueeze(-1) * e
        if b1 < in_features:                                         # and, once, over the columns after it
            rest = in_features - b1
            if shared:
                wp[b1:].view(rest, -1).addmm_(u[0, b0:b1, b1:].t(), err.view(rows, -1), alpha=-1)
            else:
                for i in range(n_e):
                    wp[b1:, i].view(rest, -1).addmm_(u[i, b0:b1, b1:].t(), err[:, i].reshape(rows, -1), alpha=-1)
        b0 = b1
    return codes, qscale, qsm


def assemble_many(codes: torch.Tensor, qscale: torch.Tensor, qsm: torch.Tensor, out: int,
                  plans: Sequence[Sequence[tuple[int, int]]], perm: torch.Tensor, name: str) -> list[list[dict]]:
    """gptq_columns' results for E weights x M copies (copy m in `plans[m]`'s groups) -> EXL2 tensor sets on the
    CPU, [E][M]: codes and scales packed on their device for all E at once (bitpack), then moved in one
    transfer per tensor kind. perm [E, in] or [in]: the packed order (q_invperm is its inverse)."""
    in_features, n_e, m, n = codes.shape
    codes[..., out:] = 0                                # padded columns hold the zero code
    qscale[..., out:] = 16                              # as the plain quantizer leaves them
    perm = perm if perm.dim() == 2 else perm.expand(n_e, -1)
    invperm = torch.argsort(perm.to(torch.int64), dim=1).to(torch.int32).cpu()
    sets = [[None] * m for _ in range(n_e)]
    for c, groups in enumerate(plans):
        words, r = [], 0
        for b in dict.fromkeys(b for b, _ in groups):               # one run of equal widths at a time
            rows = sum(gr for bb, gr in groups if bb == b)
            run = codes[r:r + rows, :, c].reshape(rows, n_e * n)                     # int8, centred
            words.append(fmt.pack_codes(run, b, offset=1 << (b - 1)).view(-1, n_e, n))
            r += rows
        q_weight = torch.cat(words).cpu()
        q_scale = fmt.pack_scales(qscale[:, :, c].reshape(len(groups), n_e * n)).view(len(groups), n_e, -1).cpu()
        q_scale_max = qsm[:, :, c].cpu()
        q_groups = fmt.group_table(groups, name)
        own = {"q_weight": q_weight, "q_scale": q_scale, "q_scale_max": q_scale_max}     # expert e at [:, e]
        for e in range(n_e):
            sets[e][c] = {k: v[:, e].clone(memory_format=torch.contiguous_format) for k, v in own.items()}
            sets[e][c].update(q_groups=q_groups.clone(), q_invperm=invperm[e].clone())
    return sets


def plan_bits(plans: Sequence[Sequence[tuple[int, int]]], device) -> tuple[torch.Tensor, list[int]]:
    """The group widths of several plans that cut the rows alike -> (gbits [plans, G], rows of each group)."""
    rows = [r for _, r in plans[0]]
    for groups in plans[1:]:
        if [r for _, r in groups] != rows:
            raise ValueError("plans batched in one loop must cut the rows into the same groups")
    return torch.tensor([[b for b, _ in groups] for groups in plans], device=device), rows


def quantize_stacked(weights: Sequence[Sequence[torch.Tensor]], prep: Prepared,
                     plans: Sequence[Sequence[tuple[int, int]]], names: Sequence[Sequence[str]],
                     keep: torch.Tensor | None = None) -> tuple[list, torch.Tensor | None]:
    """GPTQ of E weights of P parts each ([out, in], weights[e][p]; part p of expert e named names[e][p]) with
    E prepared Hessians (or one shared), each at every plan of `plans` (candidate widths), in one batched loop.
    -> (tensor sets [E][P][K] on the CPU, and with `keep` (the raw Hessians [E or 1, in, in], in the original
    order) the relative output errors [E, P, K] of each (allocate.relative_errors), else None)."""
    k = len(plans)
    out = weights[0][0].shape[0]
    gbits, rows = plan_bits(plans, prep.u.device)
    wp = pack_weights(weights, prep, k, names)                       # [in, E, P x K, N]
    parts = len(weights[0])
    original = wp[:, :, ::k, :out].clone() if keep is not None else None
    u = prep.u if prep.u.dim() == 3 else prep.u.unsqueeze(0)
    codes, qscale, qsm = gptq_columns(wp, u, gbits.repeat(parts, 1), rows)
    del wp
    errors = None
    if keep is not None:
        errors = relative_errors(original, codes[..., :out], qscale, qsm, rows, keep, prep.perm, k)
    sets = assemble_many(codes, qscale, qsm, out, list(plans) * parts, prep.perm, names[0][0])
    return [[sets[e][p * k:(p + 1) * k] for p in range(parts)] for e in range(len(weights))], errors
