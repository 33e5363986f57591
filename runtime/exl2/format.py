"""The EXL2 tensor format (exllamav2 0.3.x) in pure PyTorch: dequantize exactly, quantize by rounding.

On-disk layout of one quantized linear layer `K` (HF weight W of shape [out, in], y = x @ W.T):

    K.q_weight     int32  [sum of qrows, N]   b-bit codes, packed down each column (see bitpack.py)
    K.q_scale      int32  [G, N/8]            4-bit per-column group scales, stored as qscale-1
    K.q_scale_max  fp16   [G]                 per-group maximum scale
    K.q_groups     int16  [2G]                pairs (bits of group g, first q_weight row of group g)
    K.q_invperm    int32  [in]                inverse input permutation (q_perm = argsort(q_invperm))
    K.bias         fp16   [N]                 optional, left to the caller
    K.q_scale_exact fp16  [G, N]              optional (ours, not exllamav2's): the exact scale of each group
                                              and column, taken instead of q_scale / q_scale_max below

N = out rounded up to a multiple of 32: padded columns hold the zero code 2**(b-1), so their weights
dequantize to 0. Rows are input channels in "packed order" (the quantizer's activation order, here
the identity unless a permutation is given). The rows are cut into G groups; each group has one bit
width b in {8, 6, 5, 4, 3, 2}, widths descend from the first group to the last (exllamav2's kernels
walk rows 8 -> 6 -> 5 -> 4 -> 3 -> 2), and a group of R rows takes R*b/32 rows of q_weight. The
number of rows of a group follows from the next group's first qrow (the last group takes the rest).
Every group here is a multiple of 32 rows, as exllamav2's kernels advance 32 rows at a time.

Dequantization, as exllamav2 reconstructs it (q_matrix.cu reconstruct_kernel, qdq_util.cuh dq_scale,
ext.py make_q_matrix), all in fp16 with one rounding per operation:

    mx[g]      = fp16(q_scale_max[g] * 1/256)                     (may be subnormal; kept as is)
    scale[g,n] = fp16(fp16((qscale[g,n])**2) * mx[g])             qscale in 1..16
    Wt[k,n]    = fp16((code[k,n] - 2**(b_g-1)) * scale[g(k),n])   k a packed row in group g(k)
    W.T        = Wt[q_invperm]                                    [in, N];  W = (W.T).T, first `out` rows

With `q_scale_exact`, scale[g,n] = q_scale_exact[g,n]: any fp16 value, where q_scale / q_scale_max give one of
16 steps per group. The GPTQ import (gptq_tensors.py) writes it so that a build's free per-column scales survive
bit for bit; q_scale / q_scale_max then hold the nearest steps, for readers that know only those (exllamav2's
own QMatrix). Every reader here that makes a dense scale per group and column takes it: `dequantize` (the CPU
engine, the oracle), runtime/experts/pack.py (the GPU experts) and the CPU experts' packing. Its values must be
finite (`read_layout` checks them).

Bit mixes: any descending subset of {8,6,5,4,3,2} runs (exllamav2 falls back to its general GEMM
kernel); `SUPPORTED_MIXES` are the ones with a specialised kernel (comp_units/kernel_select.cuh)
plus [8, 4], which exllamav2's own converter emits. The quantizer only produces those.

Quantizer (round to nearest, no Hessian): per group and column the step is chosen from the absolute
maximum so that every code is in range, q_scale_max is rounded up in fp16 and qscale rounded up,
so for every weight  |w - deq| <= step/2 + 2**-11 * |deq| + 2**-25  (half a step, plus the fp16
rounding of the product; `step_sizes` returns the steps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from runtime.folder_check import EXL2_EXACT

from .bitpack import pack_codes, pack_scales, unpack_codes, unpack_scales

WIDTHS = (8, 6, 5, 4, 3, 2)
SUPPORTED_MIXES = frozenset(tuple(m) for m in (
    (2,), (3, 2), (3,), (4, 3, 2), (4, 3), (4,), (5, 4), (5,), (6, 5), (6,),
    (8,), (6, 3, 2), (5, 3), (8, 4, 3), (8, 5, 4), (8, 6, 5), (8, 6, 4, 3), (4, 2), (6, 4), (8, 6),
    (8, 4),
))
REQUIRED_KEYS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
MAX_IN_FEATURES = 65536          # q_perm is uint16 inside exllamav2


class Exl2FormatError(ValueError):
    """A tensor set or a request that is not valid EXL2; `name` says which tensor or layer."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


@dataclass(frozen=True)
class Group:
    bits: int
    rows: int          # input rows (packed order)
    first_row: int
    first_qrow: int


# ---------------------------------------------------------------------------------------------
# Bit mixes and group plans

def mix_for_bpw(bpw: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Bits of the codes (excluding scale overhead, ~4/group_size bpw) -> (widths, proportions)."""
    if not 2.0 <= bpw <= 8.0:
        raise Exl2FormatError("bits", f"{bpw} bits per weight is outside EXL2's range 2..8")
    if float(bpw).is_integer() and int(bpw) in WIDTHS:
        return (int(bpw),), (1.0,)
    asc = sorted(WIDTHS)
    lo = max(b for b in asc if b <= bpw)
    hi = min(b for b in asc if b > bpw)
    p_hi = round((bpw - lo) / (hi - lo), 4)
    return (hi, lo), (p_hi, round(1.0 - p_hi, 4))


def resolve_bits(bits, bits_prop=None, name: str = "bits") -> tuple[tuple[int, ...], tuple[float, ...]]:
    """int (one width), float (bpw target: 4.0 -> [4], 2.5 -> [3, 2], 7.0 -> [8, 6]) or a descending list
    of widths (+ proportions, default equal)."""
    if isinstance(bits, (int, float)) and not 2 <= bits <= 8:
        raise Exl2FormatError(name, f"{bits} bits per weight is outside EXL2's range 2..8")
    if isinstance(bits, float) and not (bits.is_integer() and int(bits) in WIDTHS):
        return mix_for_bpw(bits)                        # a bpw target such as 2.5 or 7.0
    if isinstance(bits, (int, float)):
        mix, props = (int(bits),), (1.0,)
    else:
        mix = tuple(int(b) for b in bits)
        props = tuple(float(p) for p in bits_prop) if bits_prop is not None else (1.0 / len(mix),) * len(mix)
    if mix not in SUPPORTED_MIXES:
        raise Exl2FormatError(name, f"bit mix {list(mix)} has no exllamav2 kernel; supported (rows in "
                                    f"descending bits): {sorted(list(m) for m in SUPPORTED_MIXES)}")
    if len(props) != len(mix) or any(p <= 0 for p in props) or abs(sum(props) - 1) > 1e-3:
        raise Exl2FormatError(name, f"proportions {list(props)} must be positive, one per width, sum 1")
    return mix, props


def plan_groups(in_features: int, mix: Sequence[int], props: Sequence[float],
                group_size: Mapping[int, int]) -> list[tuple[int, int]]:
    """(bits, rows) per group, as exllamav2's AdaptiveGPTQ.configure cuts them; widths left without
    rows (tiny matrices) are dropped, the last group of the matrix may be short."""
    remaining, groups = in_features, []
    for b, p in zip(mix, props):
        gsz = group_size[b]
        for _ in range(math.ceil(min(in_features * p, remaining) / gsz)):
            rows = min(gsz, remaining)
            groups.append((b, rows))
            remaining -= rows
    if remaining > 0:                                   # float rounding of the proportions
        b = groups[-1][0] if groups else mix[-1]
        while remaining > 0:
            rows = min(group_size[b], remaining)
            groups.append((b, rows))
            remaining -= rows
    return groups


def planned_bits(in_features: int, out_features: int, groups: Sequence[tuple[int, int]]) -> int:
    """Bits a tensor set with these groups stores (what `stored_bits` returns for it): codes of N columns
    (out rounded up to 32), a 4-bit scale per group and column, q_scale_max and the q_groups pair per
    group, and q_invperm; what exllamav2's converter counts towards its -b target."""
    n = out_features + (-out_features % 32)
    return (sum(b * rows for b, rows in groups) * n + len(groups) * (4 * n + 16 + 32) + 32 * in_features)


def stored_target(bpw: float, in_features: int, out_features: int,
                  group_size: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The widest mix of two adjacent widths (whole groups of `group_size` rows each) whose stored bits per
    weight, scales and permutation included, stay within `bpw` (-> widths, proportions for
    `resolve_bits`); the narrowest width (2 bits, ~2.2 stored) where even that is over."""
    if not 2.0 <= bpw <= 8.5:
        raise Exl2FormatError("bits", f"{bpw} stored bits per weight is outside EXL2's range 2..8.5")
    n_groups = math.ceil(in_features / group_size)
    budget = bpw * in_features * out_features
    asc = sorted(WIDTHS)
    best = ((asc[0],), (1.0,))
    for lo, hi in zip(asc, asc[1:]):
        for k in range(n_groups + 1):                   # k groups of `hi` first, the rest `lo`
            mix = ((hi,), (1.0,)) if k == n_groups else ((lo,), (1.0,)) if k == 0 else \
                ((hi, lo), ((k - 0.5) * group_size / in_features, 1 - (k - 0.5) * group_size / in_features))
            groups = plan_groups(in_features, *mix, {b: group_size for b in mix[0]})
            if planned_bits(in_features, out_features, groups) > budget:
                return best
            best = mix
    return best


# ---------------------------------------------------------------------------------------------
# Reading

def read_layout(tensors: Mapping[str, torch.Tensor], name: str = "tensor") -> tuple[int, int, list[Group]]:
    """Validate an EXL2 tensor set; return (in_features, padded out N, groups)."""
    missing = [k for k in REQUIRED_KEYS if k not in tensors]
    if missing:
        raise Exl2FormatError(name, f"missing EXL2 tensors {missing}")
    expect = {"q_weight": ((torch.int32,), 2), "q_scale": ((torch.int32,), 2), "q_scale_max": ((torch.float16,), 1),
              "q_groups": ((torch.int16,), 1), "q_invperm": ((torch.int16, torch.int32, torch.int64), 1)}
    for k, (dtypes, ndim) in expect.items():
        t = tensors[k]
        if t.dtype not in dtypes or t.dim() != ndim:
            raise Exl2FormatError(f"{name}.{k}", f"expected {ndim}-D {'/'.join(map(str, dtypes))}, "
                                                 f"got {t.dim()}-D {t.dtype} of shape {list(t.shape)}")
    qw, qs, qsm, qg, inv = (tensors[k] for k in REQUIRED_KEYS)
    in_features, n = inv.shape[0], qw.shape[1]
    ngroups = qg.shape[0] // 2
    if qg.shape[0] % 2 or ngroups == 0 or qs.shape[0] != ngroups or qsm.shape[0] != ngroups:
        raise Exl2FormatError(name, f"group counts disagree: q_groups {qg.shape[0]} entries (pairs), "
                                    f"q_scale {qs.shape[0]} rows, q_scale_max {qsm.shape[0]}")
    if qs.shape[1] * 8 != n:
        raise Exl2FormatError(f"{name}.q_scale", f"{qs.shape[1]} words hold {qs.shape[1] * 8} scales per group "
                                                 f"but q_weight has {n} columns")
    pairs = qg.to(torch.int64).view(ngroups, 2).tolist()
    groups, row = [], 0
    for i, (bits, qrow) in enumerate(pairs):
        next_qrow = pairs[i + 1][1] if i + 1 < ngroups else qw.shape[0]
        if bits not in WIDTHS or (i and bits > pairs[i - 1][0]):
            raise Exl2FormatError(f"{name}.q_groups", f"group {i} has {bits} bits; widths must be in "
                                                      f"{WIDTHS} and descend, got {[p[0] for p in pairs]}")
        if (qrow != 0 if i == 0 else qrow <= pairs[i - 1][1]) or next_qrow <= qrow:
            raise Exl2FormatError(f"{name}.q_groups", f"group {i} starts at q_weight row {qrow}: offsets must "
                                                      f"start at 0 and increase up to {qw.shape[0]}")
        rows = (next_qrow - qrow) * 32 // bits
        if (next_qrow - qrow) * 32 % bits or rows % 32:
            raise Exl2FormatError(f"{name}.q_groups", f"group {i} spans {next_qrow - qrow} packed rows at "
                                                      f"{bits} bits: not a whole multiple of 32 input rows")
        groups.append(Group(bits, rows, row, qrow))
        row += rows
    if row != in_features:
        raise Exl2FormatError(name, f"groups cover {row} input rows but q_invperm has {in_features}")
    if not torch.equal(torch.sort(inv.to(torch.int64)).values, torch.arange(in_features, device=inv.device)):
        raise Exl2FormatError(f"{name}.q_invperm", f"not a permutation of 0..{in_features - 1}")
    exact = tensors.get(EXL2_EXACT)
    if exact is not None:
        if exact.dtype != torch.float16 or tuple(exact.shape) != (ngroups, n):
            raise Exl2FormatError(f"{name}.{EXL2_EXACT}", f"expected float16 [{ngroups}, {n}] (a scale per group and "
                                                          f"column), got {exact.dtype} {list(exact.shape)}")
        if not bool(torch.isfinite(exact).all()):
            raise Exl2FormatError(f"{name}.{EXL2_EXACT}", "holds scales that are not finite numbers")
    return in_features, n, groups


def _group_scales(tensors) -> torch.Tensor:
    """-> the fp16 scale of each group and column [G, N] (tensors checked by read_layout)."""
    if EXL2_EXACT in tensors:
        return tensors[EXL2_EXACT]                                              # [G, N] fp16
    mx = tensors["q_scale_max"].to(torch.float16) * (1 / 256)                  # [G] fp16, as make_q_matrix
    qscale = unpack_scales(tensors["q_scale"])                                  # [G, N]
    return (qscale * qscale).to(torch.float16) * mx.unsqueeze(1)               # [G, N] fp16, as dq_scale


def group_scales(tensors: Mapping[str, torch.Tensor], *, name: str = "tensor") -> torch.Tensor:
    """The quantization step of each group and column, fp16 [G, N] (G in packed order, N padded): what
    step_sizes spreads over the group's rows, without unpacking the codes."""
    tensors = {k: v.cpu() for k, v in tensors.items()}
    read_layout(tensors, name)
    return _group_scales(tensors)


def _decode(tensors, name):
    """-> (centred codes [in, N] in packed order, fp16 scale per packed row and column [in, N], invperm)."""
    in_features, n, groups = read_layout(tensors, name)
    qw = tensors["q_weight"]
    codes = torch.empty((in_features, n), dtype=torch.int64, device=qw.device)
    i = 0
    while i < len(groups):                              # one pass per run of equal widths (<= 6)
        j = i
        while j < len(groups) and groups[j].bits == groups[i].bits:
            j += 1
        b, r0, r1 = groups[i].bits, groups[i].first_row, groups[j - 1].first_row + groups[j - 1].rows
        q1 = groups[j].first_qrow if j < len(groups) else qw.shape[0]
        codes[r0:r1] = unpack_codes(qw[groups[i].first_qrow:q1], b) - (1 << (b - 1))
        i = j
    scale = _group_scales(tensors)
    row_group = torch.repeat_interleave(torch.arange(len(groups), device=qw.device),
                                        torch.tensor([g.rows for g in groups], device=qw.device))
    return codes, scale[row_group], tensors["q_invperm"].to(torch.int64)


def dequantize(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32, *,
               out_features: int | None = None, name: str = "tensor", device="cpu") -> torch.Tensor:
    """EXL2 tensors -> HF weight [out, in] (padded N rows unless out_features), values as exllamav2's fp16.
    device: where the codes are unpacked and the weight is made (the same integer and fp16 steps anywhere)."""
    tensors = {k: v.to(device) for k, v in tensors.items()}
    codes, scale, inv = _decode(tensors, name)
    wt = codes.to(torch.float16) * scale                                       # [in, N] fp16 product
    w = wt[inv].t()                                                             # [N, in]
    if out_features is not None:
        if not 0 < out_features <= w.shape[0]:
            raise Exl2FormatError(name, f"out_features {out_features} exceeds the {w.shape[0]} stored columns")
        w = w[:out_features]
    return w.to(dtype).contiguous()


def step_sizes(tensors: Mapping[str, torch.Tensor], *, name: str = "tensor") -> torch.Tensor:
    """Quantization step of every weight, [N, in] float32 (HF orientation, padded like dequantize)."""
    tensors = {k: v.cpu() for k, v in tensors.items()}
    _, scale, inv = _decode(tensors, name)
    return scale[inv].t().float().contiguous()


def stored_bits(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bits the tensor set takes on disk (for bits-per-weight figures)."""
    return sum(t.numel() * t.element_size() * 8 for t in tensors.values())


# ---------------------------------------------------------------------------------------------
# Writing

def _half_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= x (x >= 0, float32)."""
    h = x.to(torch.float16)
    low = h.float() < x
    return torch.where(low, (h.view(torch.int16) + 1).view(torch.float16), h)


@dataclass(frozen=True)
class _Run:
    """Consecutive groups of one width: rows [r0, r1), groups [g0, g1), full groups of `size` rows."""
    bits: int
    r0: int
    r1: int
    g0: int
    g1: int
    size: int

    def views(self, wt: torch.Tensor) -> list[torch.Tensor]:
        """[k, size, N] over the full groups, plus [1, rest, N] for a short last group."""
        full = (self.r1 - self.r0) // self.size
        parts = [wt[self.r0:self.r0 + full * self.size].view(full, self.size, -1)] if full else []
        if self.r0 + full * self.size < self.r1:
            parts.append(wt[self.r0 + full * self.size:self.r1].unsqueeze(0))
        return parts


def _runs(groups: list[tuple[int, int]], group_size: Mapping[int, int]) -> list[_Run]:
    runs, r, g = [], 0, 0
    for b in dict.fromkeys(b for b, _ in groups):
        idx = [i for i, (bb, _) in enumerate(groups) if bb == b]
        rows = sum(groups[i][1] for i in idx)
        runs.append(_Run(b, r, r + rows, g, g + len(idx), group_size[b]))
        r, g = r + rows, g + len(idx)
    return runs


def quantize(weight: torch.Tensor, bits=4, group_size: int | Mapping[int, int] = 128, *,
             bits_prop: Sequence[float] | None = None, perm: torch.Tensor | None = None,
             name: str = "weight") -> dict[str, torch.Tensor]:
    """Round-to-nearest EXL2 quantization of an HF weight [out, in].

    bits: int (uniform), a fractional bpw target (mapped by mix_for_bpw) or a descending list of
    widths with `bits_prop`. group_size: one size, or one per width; multiples of 32. perm: optional
    input-row order (packed row k is input channel perm[k]); the first rows get the most bits.
    """
    if weight.dim() != 2:
        raise Exl2FormatError(name, f"expected a 2-D weight [out, in], got shape {list(weight.shape)}")
    if not weight.is_floating_point():
        raise Exl2FormatError(name, f"expected a floating-point weight, got {weight.dtype}")
    w = weight.detach().cpu().to(torch.float32)
    out, in_features = w.shape
    if in_features % 32 or not 0 < in_features <= MAX_IN_FEATURES or out == 0:
        raise Exl2FormatError(name, f"in_features {in_features} must be a positive multiple of 32 "
                                    f"up to {MAX_IN_FEATURES} (out {out})")
    peak = torch.maximum(w.amax(), -w.amin())          # NaN propagates
    if not torch.isfinite(peak) or peak > 60000:
        raise Exl2FormatError(name, "weight has non-finite values or values beyond fp16 range")
    mix, props = resolve_bits(bits, bits_prop, name)
    gs = dict(group_size) if isinstance(group_size, Mapping) else {b: int(group_size) for b in mix}
    if any(b not in gs or gs[b] <= 0 or gs[b] % 32 for b in mix):
        raise Exl2FormatError(name, f"group size {group_size} must give every width in {list(mix)} a positive "
                                    f"multiple of 32")
    if perm is None:
        perm = torch.arange(in_features)
    perm = perm.to(torch.int64)
    if perm.shape != (in_features,) or not torch.equal(torch.sort(perm).values, torch.arange(in_features)):
        raise Exl2FormatError(name, f"perm must be a permutation of 0..{in_features - 1}")

    groups = plan_groups(in_features, mix, props, gs)
    n = out + (-out % 32)
    wt = torch.nn.functional.pad(w.t()[perm], (0, n - out))                    # [in, N] packed order
    runs = _runs(groups, gs)

    # Steps: base[g, n] is the smallest step keeping |w|/step <= (2**b - 1)/2 in that group column
    absmax = torch.cat([torch.maximum(v.amax(dim=1), -v.amin(dim=1))
                        for run in runs for v in run.views(wt)])               # [G, N]
    gbits = torch.tensor([b for b, _ in groups])
    base = absmax / ((2.0 ** gbits - 1) / 2).unsqueeze(1)                      # [G, N]
    mx = _half_ceil(base.amax(dim=1).clamp(min=2.0 ** -16) / 256)             # [G] fp16 = q_scale_max/256
    qscale = torch.ceil(torch.sqrt(base / (mx.float() * 256).unsqueeze(1)) * 16).clamp(1, 16)
    for _ in range(2):                                  # fp16 rounding may leave a step just short
        step = ((qscale * qscale).to(torch.float16) * mx.unsqueeze(1)).float()
        qscale = torch.where(step < base, (qscale + 1).clamp(max=16), qscale)
    qscale[:, out:] = 16                                # as exllamav2's packer leaves padded columns
    step = ((qscale * qscale).to(torch.float16) * mx.unsqueeze(1)).float()

    # Codes, one run of equal widths at a time: round(w / step), clamped to the code range
    codes = torch.empty((in_features, n))
    for run in runs:
        zero = 1 << (run.bits - 1)
        g, r = run.g0, run.r0
        for v in run.views(wt):                         # [k, rows, N] full groups, then a short one
            k, rows = v.shape[0], v.shape[1]
            q = torch.div(v, step[g:g + k].unsqueeze(1)).round_().clamp_(-zero, zero - 1)
            codes[r:r + k * rows] = q.view(k * rows, n)
            g, r = g + k, r + k * rows
    return assemble(codes, qscale, (mx.float() * 256).to(torch.float16), groups, perm, name)


def assemble(codes: torch.Tensor, qscale: torch.Tensor, q_scale_max: torch.Tensor, groups: Sequence[tuple[int, int]],
             perm: torch.Tensor, name: str = "weight") -> dict[str, torch.Tensor]:
    """The EXL2 tensor set from centred codes [in, N] in packed order (integers in [-2**(b-1), 2**(b-1))),
    4-bit scales qscale [G, N] (1..16), q_scale_max [G] fp16 and the groups' (bits, rows)."""
    codes = codes.cpu()
    packed, r = [], 0
    q_groups = group_table(groups, name)
    for b in dict.fromkeys(b for b, _ in groups):
        rows = sum(gr for bb, gr in groups if bb == b)
        packed.append(pack_codes(codes[r:r + rows] + (1 << (b - 1)), b))
        r += rows
    return {
        "q_weight": torch.cat(packed, dim=0),
        "q_scale": pack_scales(qscale.cpu()),
        "q_scale_max": q_scale_max.cpu().to(torch.float16),
        "q_groups": q_groups,
        "q_invperm": torch.argsort(perm.cpu().to(torch.int64)).to(torch.int32),
    }


def group_table(groups: Sequence[tuple[int, int]], name: str = "weight") -> torch.Tensor:
    """q_groups for groups of (bits, rows): (bits, first q_weight row) per group, int16."""
    qgroups, qrow = [], 0
    for b, rows in groups:
        qgroups += [b, qrow]
        qrow += rows * b // 32
    if qrow >= 2 ** 15:
        raise Exl2FormatError(name, f"{qrow} packed rows overflow q_groups' int16 offsets")
    return torch.tensor(qgroups, dtype=torch.int16)


# ---------------------------------------------------------------------------------------------
# Scale search (the calibrated converter's groups)

SCALE_GRID = tuple(0.70 + 0.05 * i for i in range(11))   # multipliers of the absmax step tried per group,
SCALE_FINE = tuple(0.01 * i for i in (-4, -3, -2, -1, 1, 2, 3, 4))   # then these around the best of them
ERROR_NORM = 3.5                                         # the search minimises sum |w - deq| ** ERROR_NORM
SEARCH_ELEMENTS = {"cpu": 1 << 23, "cuda": 1 << 26}      # float32 temporaries of the search at most (per device)


def group_steps(qscale: torch.Tensor, q_scale_max: torch.Tensor) -> torch.Tensor:
    """Steps as exllamav2 computes them: fp16(fp16(qscale**2) * fp16(q_scale_max / 256)), float32."""
    mx = q_scale_max.to(torch.float16) * (1 / 256)
    return ((qscale * qscale).to(torch.float16) * mx).float()


def _clip_error(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w [R, B, N], step [B, N], zero [B, 1] -> per column sum over the rows of |w - code * step| ** ERROR_NORM,
    codes rounded and clamped to the b-bit range [-zero, zero - 1]."""
    q = torch.div(w, step).round_().clamp_(-zero, zero - 1)
    return (w - q * step).abs_().pow_(ERROR_NORM).sum(dim=0)


def _best_multiplier(w, qscale, top, grid, zero) -> torch.Tensor:
    """w [R, B, N], qscale [B, N], top [B], grid [B, P] float64 multipliers, zero [B, 1] -> the multiplier of each
    row of `grid` whose q_scale_max = fp16(top x it) gives the least error [B] (float64); B in slices that keep
    the temporaries [R, b, P, N] under SEARCH_ELEMENTS."""
    rows, b_all, n = w.shape
    p = grid.shape[1]
    qsms = (top.unsqueeze(1) * grid.to(torch.float32)).to(torch.float16)      # [B, P] candidate q_scale_max
    steps = group_steps(qscale.unsqueeze(1), qsms.unsqueeze(2))               # [B, P, N]
    limit = SEARCH_ELEMENTS.get(w.device.type, SEARCH_ELEMENTS["cpu"])
    per_b = rows * p * n
    total = torch.empty((b_all, p), device=w.device)
    b_step = max(1, limit // per_b)
    for b0 in range(0, b_all, b_step):
        b1 = min(b_all, b0 + b_step)
        if per_b <= limit:
            wc, sc, z = w[:, b0:b1].unsqueeze(2), steps[b0:b1], zero[b0:b1].unsqueeze(1)   # [R, b, 1, N]...
            total[b0:b1] = _clip_error(wc, sc, z).sum(dim=-1)
            continue
        for bi in range(b0, b1):                          # one slice of columns at a time (wide tensors)
            acc = torch.zeros(p, device=w.device)
            chunk = max(1, limit // (p * rows))
            for c0 in range(0, n, chunk):
                wc = w[:, bi, c0:c0 + chunk].unsqueeze(1)                          # [R, 1, c]
                acc += _clip_error(wc, steps[bi, :, c0:c0 + chunk], zero[bi].view(1, 1)).sum(dim=-1)
            total[bi] = acc
    return grid.gather(1, torch.argmin(total, dim=1, keepdim=True)).squeeze(1)


_GRIDS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _grids(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """SCALE_GRID and (0, *SCALE_FINE) as float64 tensors on `device`, made once (a copy from host memory to a
    GPU waits for the GPU's queue: once per group it would stall the loop)."""
    if device not in _GRIDS:
        _GRIDS[device] = (torch.tensor(SCALE_GRID, dtype=torch.float64, device=device),
                          torch.tensor((0.0, *SCALE_FINE), dtype=torch.float64, device=device))
    return _GRIDS[device]


def search_scales(w: torch.Tensor, bits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scales of groups w [rows, *B, N] (packed order: rows are input channels, N output columns; B any batch of
    independent groups, e.g. experts x candidate widths) that may clip the largest weights when that lowers the
    error, as exllamav2's quantizer does: each group's maximum step times a multiplier in 0.70-1.20 (q_scale_max;
    SCALE_GRID, then SCALE_FINE around the best: 19 tried where exllamav2 tries 97 on a GPU), the columns' 4-bit
    qscale rounded to their absmax step under it, the multiplier of least error kept; then each column's qscale
    moved by one where that lowers its error. `bits`: the code width, an int or a tensor broadcastable to B.
    Every group of the batch is searched at once, without leaving the device (no host synchronisation).
    -> (qscale [*B, N] float 1..16, q_scale_max [*B] fp16, step [*B, N] float32), on w's device."""
    rows, n, batch = w.shape[0], w.shape[-1], w.shape[1:-1]
    w = w.float().reshape(rows, -1, n)                                          # [R, B, N]
    bits = torch.as_tensor(bits, device=w.device).expand(batch).reshape(-1, 1).to(torch.float32)   # [B, 1]
    zero = torch.exp2(bits - 1)
    base = (w.abs().amax(dim=0) + 1e-12) / ((torch.exp2(bits) - 1) / 2)      # no-clipping step per column [B, N]
    top = base.amax(dim=1).clamp(min=2.0 ** -14)                               # [B]
    qscale = torch.clamp(torch.round(torch.sqrt(base / top.unsqueeze(1)) * 16), 1, 16)
    grid, fine = _grids(w.device)
    coarse = _best_multiplier(w, qscale, top, grid.expand(w.shape[1], -1), zero)
    mult = _best_multiplier(w, qscale, top, coarse.unsqueeze(1) + fine, zero)
    qsm = (top * mult.to(torch.float32)).to(torch.float16)                     # [B]
    err = _clip_error(w, group_steps(qscale, qsm.unsqueeze(1)), zero)
    for delta in (-1, 1):
        cand = (qscale + delta).clamp(1, 16)
        cerr = _clip_error(w, group_steps(cand, qsm.unsqueeze(1)), zero)
        better = cerr < err
        qscale, err = torch.where(better, cand, qscale), torch.where(better, cerr, err)
    step = group_steps(qscale, qsm.unsqueeze(1))
    return qscale.view(*batch, n), qsm.view(batch), step.view(*batch, n)
