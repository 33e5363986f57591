"""One GPTQ-family linear (runtime/gptq_spec.py): its packed tensors unpacked and checked, then written as EXL2.

Legend: K input rows, N output columns (padded to 32 in EXL2), G groups, R rows of a group, b the source's bits,
B the EXL2 width (B >= b), j = q - zero the source's centred code, s its fp16 scale.

The source's weight is W[o, i] = fp16(s[g, o] * j[i, o]), g = g_idx[i] (`dequantize`: the product is exact in
float32, so this is what an fp16 kernel computes). EXL2 (format.py) stores per group one q_scale_max and per
column a 4-bit qscale, its step t = fp16(fp16(qscale**2) * fp16(q_scale_max / 256)): 16 steps per group to choose
from, where the source has an arbitrary fp16 scale per group and column; and, optionally, the exact fp16 scale of
each group and column (q_scale_exact), which our own readers take instead. So:

- Rows: EXL2 groups are contiguous runs of packed rows. Packed row k is input row perm[k], perm the rows sorted
  by their group (stable), so a desc_act build's groups become EXL2 groups through q_invperm. Every group must
  hold a multiple of 32 rows (EXL2's kernels step 32 rows at a time); a g_idx that makes other counts is refused.
- Exact (`exact=True`, where every j of the linear is a B-bit code: symmetric builds at any B >= b, asymmetric
  ones, whose j = q - zero spans 2**(b+1) - 1 values, at B > b): the codes are j, q_scale_exact is s, so
  fp16(j * s) is W bit for bit (s rounded to fp16 where the build stored bf16 or fp32 scales: exact for bf16
  within fp16's range). q_scale and q_scale_max hold, for readers of those alone, the step nearest each s, the
  codes as they are (on the demo model's linears, bench/gptq_quality.py: more squared error than the search's at
  B = b, yet a lower perplexity; the search's error falls with B, this one's does not).
- Steps (the rest): per group, q_scale_max is chosen so that the column of the largest ideal step gets it exactly (where
  q_scale_max / 256 is a normal fp16 number); each column then takes, of the three steps nearest its ideal, the
  one of least squared error, its codes rounded to nearest (`_search`). The ideal step is s * 2**(b - B) (the
  source's grid, finer when B > b); asymmetric builds also try the step that spans the column's range without
  clipping. A column whose scale is one of the 16 steps comes out bit-exact: W's values themselves. Others
  carry an error: measured and returned (`RepackStats`), never hidden.

Measured on random GPTQ-like groups (32 rows, columns' scales spread as trained weights' are): at B = b = 4 the
search adds about 37% to the noise energy the 4-bit source already has against its original weights
(`added_noise`), about 10% at B = 5, 3% at B = 6, 0.2% at B = 8; trying every one of the 16 steps instead of the
nearest three changes that by under 0.1%.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch

from runtime.errors import InvalidModel
from runtime.gptq_spec import GptqSpec, LinearLayout

from runtime.folder_check import EXL2_EXACT

from . import format as fmt

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # nibble n of an AWQ word holds column AWQ_ORDER[n] of its eight
SEARCH_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 25}   # float32 elements of one chunk of the step search's groups


@dataclass
class GptqLinear:
    """One source linear unpacked: codes, zero points, scales and each input row's group."""
    codes: torch.Tensor        # int16 [K, N] in 0..2**b-1
    zeros: torch.Tensor        # int16 [G, N] (the checkpoint's offset applied)
    scales: torch.Tensor       # float32 [G, N], the stored fp16 / bf16 values
    group: torch.Tensor        # int64 [K]
    bits: int


@dataclass
class RepackStats:
    """How far the EXL2 tensors are from the source's weights: squared error, the weights' squared sum, the
    noise energy of the source's own rounding (R * s**2 / 12 per group and column), the largest error."""
    weights: int = 0
    exact: int = 0             # linears whose EXL2 weights equal the source's, bit for bit
    linears: int = 0
    sq_error: float = 0.0
    sq_weight: float = 0.0
    source_noise: float = 0.0
    max_error: float = 0.0
    worst: dict = field(default_factory=dict)   # {"name", "relative_rms"} of the linear with the largest error

    def add(self, other: "RepackStats", name: str) -> None:
        rel = (other.sq_error / other.sq_weight) ** 0.5 if other.sq_weight else 0.0
        if rel > self.worst.get("relative_rms", -1.0):
            self.worst = {"name": name, "relative_rms": round(rel, 6)}
        self.weights += other.weights
        self.exact += other.exact
        self.linears += other.linears
        self.sq_error += other.sq_error
        self.sq_weight += other.sq_weight
        self.source_noise += other.source_noise
        self.max_error = max(self.max_error, other.max_error)

    def report(self) -> dict:
        """For quantization_config and the log: counts, relative RMS error, the noise added."""
        return {"linears": self.linears, "bit_exact_linears": self.exact, "weights": self.weights,
                "relative_rms_error": round((self.sq_error / self.sq_weight) ** 0.5, 6) if self.sq_weight else 0.0,
                "added_noise": round(self.sq_error / self.source_noise, 4) if self.source_noise else 0.0,
                "max_abs_error": self.max_error, "worst": self.worst}

    def state(self) -> dict:
        """The raw sums (for a resumed import's state file; RepackStats(**state) gives them back)."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Unpacking

def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R / (32/b), C] -> int16 [R, C]: word r holds rows r*(32/b) .. , the first in the low bits."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    parts = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & mask                  # [R/per, per, C]
    return parts.reshape(-1, words.shape[1]).to(torch.int16)


def _unpack_cols(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 [R, C / (32/b)] -> int16 [R, C]: word c holds columns c*(32/b) .. (in `order` when given)."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    parts = (words.unsqueeze(2) >> shifts) & mask                                  # [R, C/per, per]: nibble n
    if order is not None:
        parts = parts[:, :, torch.argsort(torch.tensor(order, device=words.device))]   # column c of each eight
    return parts.reshape(words.shape[0], -1).to(torch.int16)


def unpack(parts: Mapping[str, torch.Tensor], spec: GptqSpec, lay: LinearLayout, name: str,
           device="cpu") -> GptqLinear:
    """The stored tensors of `name` (qweight, qzeros, scales, optional g_idx; shapes checked by gptq_spec) ->
    GptqLinear; a g_idx out of range is a named InvalidModel."""
    qw = parts["qweight"].to(device)
    if spec.packing == "gptq":
        codes = _unpack_rows(qw, lay.bits)
        zeros = _unpack_cols(parts["qzeros"].to(device), lay.bits)
    else:
        codes = _unpack_cols(qw, lay.bits, AWQ_ORDER)
        zeros = _unpack_cols(parts["qzeros"].to(device), lay.bits, AWQ_ORDER)
    zeros = zeros + spec.zero_offset
    k = codes.shape[0]
    if parts.get("g_idx") is None:
        group = torch.arange(k, device=device) // lay.group_rows
    else:
        group = parts["g_idx"].to(device, torch.int64)
        lo, hi = int(group.min()), int(group.max())
        if lo < 0 or hi >= lay.groups:
            raise InvalidModel(f"{name}.g_idx", f"holds group {lo if lo < 0 else hi}, outside 0..{lay.groups - 1} "
                                                f"(the groups its scales hold)")
    scales = parts["scales"].to(device, torch.float32)
    if not bool(torch.isfinite(scales.half()).all()):
        raise InvalidModel(f"{name}.scales", "holds values that are not finite fp16 numbers (beyond +-65504)")
    return GptqLinear(codes, zeros.to(torch.int16), scales, group, lay.bits)


def dequantize(lin: GptqLinear) -> torch.Tensor:
    """The source's weight [N, K] as float32: fp16(s * (q - zero)), the fp16 rounding of an exact product."""
    j = lin.codes.to(torch.float32) - lin.zeros[lin.group].to(torch.float32)      # [K, N]
    return (j * lin.scales[lin.group]).to(torch.float16).to(torch.float32).t().contiguous()


# ---------------------------------------------------------------------------------------------
# EXL2 groups and steps

def _group_rows(lin: GptqLinear, name: str) -> list[int]:
    """Input rows of each source group; a group of other than a multiple of 32 rows is refused, naming g_idx."""
    counts = torch.bincount(lin.group, minlength=lin.scales.shape[0]).tolist()
    for g, n in enumerate(counts):
        if n % 32:
            raise InvalidModel(f"{name}.g_idx", f"group {g} holds {n} input rows: EXL2 groups hold multiples of 32 "
                                                f"rows, so this act-order layout cannot be represented")
    return counts


def _levels(top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, from its largest wanted step `top` [g]: (mx fp16 [g] = fp16(top / 256), the 16 steps [g, 16])."""
    mx = (top.clamp(min=2.0 ** -24) * (1 / 256)).to(torch.float16)
    mx = torch.where(mx == 0, torch.full_like(mx, 2.0 ** -24), mx)                  # the smallest fp16 step
    k = torch.arange(1, 17, dtype=torch.float32, device=top.device)
    return mx, fmt.group_steps(k.unsqueeze(0), (mx.float() * 256).to(torch.float16).unsqueeze(1))   # [g, 16]


def _nearest(levels: torch.Tensor, ideal: torch.Tensor) -> torch.Tensor:
    """Index (0..15) of the step nearest each ideal step: levels [g, 16], ideal [g, N]."""
    idx = torch.searchsorted(levels.contiguous(), ideal.contiguous()).clamp(1, 15)
    lo, hi = torch.gather(levels, 1, idx - 1), torch.gather(levels, 1, idx)
    return torch.where(ideal - lo <= hi - ideal, idx - 1, idx)


def _codes(w: torch.Tensor, t: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes rounded to nearest at steps t [g, 1, N] and what EXL2 makes of them: fp16(code * t)."""
    c = torch.div(w, t).round_().clamp_(-half, half - 1)
    return c, (c * t).to(torch.float16).float()


def _search(w: torch.Tensor, ideals: list[torch.Tensor], levels: torch.Tensor, width: int):
    """Per group and column of w [g, R, N], the step of least squared error among the three nearest each ideal
    step [g, N] -> (qscale [g, N] in 1..16, codes [g, R, N] centred, dequantized [g, R, N] float32)."""
    half = 1 << (width - 1)
    best_err = best_k = None
    for ideal in ideals:
        k0 = _nearest(levels, ideal)
        for k in (k0 - 1, k0, k0 + 1):
            k = k.clamp(0, 15)
            _, d = _codes(w, torch.gather(levels, 1, k).unsqueeze(1), half)
            err = (w - d).square_().sum(dim=1)                                      # [g, N]
            if best_err is None:
                best_err, best_k = err, k
            else:
                better = err < best_err
                best_err, best_k = torch.where(better, err, best_err), torch.where(better, k, best_k)
    c, d = _codes(w, torch.gather(levels, 1, best_k).unsqueeze(1), half)
    return best_k + 1, c, d


def _chunks(groups: list[tuple[int, int]], n_cols: int, device: torch.device):
    """Runs of consecutive groups of equal rows, cut so that [groups, rows, N] stays under SEARCH_ELEMENTS."""
    i, elements = 0, SEARCH_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    while i < len(groups):
        rows, j = groups[i][1], i + 1
        cap = max(1, elements // (rows * n_cols))
        while j < len(groups) and groups[j][1] == rows and j - i < cap:
            j += 1
        yield i, j, rows
        i = j


def _stack(lins: list[GptqLinear]) -> GptqLinear:
    """Linears of one shape as one: rows stacked, each one's groups after the previous ones' (they stay apart)."""
    if len(lins) == 1:
        return lins[0]
    offsets = [0]
    for lin in lins[:-1]:
        offsets.append(offsets[-1] + lin.scales.shape[0])
    return GptqLinear(torch.cat([x.codes for x in lins]), torch.cat([x.zeros for x in lins]),
                      torch.cat([x.scales for x in lins]), torch.cat([x.group + o for x, o in zip(lins, offsets)]),
                      lins[0].bits)


def repack(lin: GptqLinear, width: int, name: str, exact: bool = False) -> tuple[dict[str, torch.Tensor], RepackStats]:
    """EXL2 tensors (format.py) of width `width` >= the source's bits, and how far they are from the source;
    `exact`: with q_scale_exact where the codes fit the width (the module docstring)."""
    return repack_many([lin], width, [name], exact)[0]


def fits(lin: GptqLinear, width: int) -> bool:
    """Whether every centred code j = q - zero of the linear is a `width`-bit EXL2 code."""
    j = lin.codes - lin.zeros[lin.group]
    return -(1 << (width - 1)) <= int(j.min()) and int(j.max()) < 1 << (width - 1)


def repack_many(lins: list[GptqLinear], width: int, names: list[str],
                exact: bool = False) -> list[tuple[dict[str, torch.Tensor], RepackStats]]:
    """`repack` of linears of one shape and width in one pass (an MoE layer's experts: their groups searched
    together, hundreds of small linears without a loop over them); each result as `repack` gives it."""
    k_in, out = lins[0].codes.shape
    if width < lins[0].bits or (width,) not in fmt.SUPPORTED_MIXES:
        raise ValueError(f"{names[0]}: EXL2 width {width} for {lins[0].bits}-bit codes (4, 5, 6 or 8, at least the "
                         f"source's)")
    if k_in % 32 or k_in > fmt.MAX_IN_FEATURES:
        raise InvalidModel(names[0], f"{k_in} inputs: EXL2 takes multiples of 32 up to {fmt.MAX_IN_FEATURES}")
    counts = [_group_rows(lin, name) for lin, name in zip(lins, names)]
    as_is = [exact and fits(lin, width) for lin in lins]
    results: list = [None] * len(lins)
    for mode in (False, True):                     # searched, then exact (each a pass over its own linears)
        idx = [i for i, e in enumerate(as_is) if e == mode]
        if idx:
            done = _repack_stacked([lins[i] for i in idx], width, [names[i] for i in idx], [counts[i] for i in idx],
                                   mode)
            for i, r in zip(idx, done):
                results[i] = r
    return results


def _repack_stacked(lins: list[GptqLinear], width: int, names: list[str], counts: list[list[int]], exact: bool):
    k_in, out = lins[0].codes.shape
    lin = _stack(lins)
    perm = torch.sort(lin.group, stable=True).indices                 # packed row k is input row perm[k]
    groups = [(g, n) for g, n in enumerate(c for cs in counts for c in cs) if n]
    codes, qscale, mx, scales, per_group = _encode(lin, width, perm, groups, exact)
    results, row, g0 = [], 0, 0
    for i, name in enumerate(names):
        rows = [n for n in counts[i] if n]
        g1 = g0 + len(rows)
        stats = RepackStats(weights=k_in * out, linears=1, exact=int(bool((per_group["max"][g0:g1] == 0).all())),
                            sq_error=float(per_group["err"][g0:g1].sum()), sq_weight=float(per_group["w"][g0:g1].sum()),
                            source_noise=float(per_group["noise"][g0:g1].sum()),
                            max_error=float(per_group["max"][g0:g1].max()))
        tensors = fmt.assemble(codes[row:row + k_in], qscale[g0:g1], (mx[g0:g1].float() * 256).to(torch.float16),
                               [(width, r) for r in rows], perm[row:row + k_in] - i * k_in, name)
        if exact:
            tensors[EXL2_EXACT] = scales[g0:g1].clone()
        results.append((tensors, stats))
        row, g0 = row + k_in, g1
    return results


def _encode(lin: GptqLinear, width: int, perm: torch.Tensor, groups: list[tuple[int, int]], exact: bool):
    """Every group's codes and steps: the source's as they are (`exact`) or searched -> (centred codes [K, N] in
    packed order, qscale [G, N], mx fp16 [G], exact scales fp16 [G, N] (zeros unless `exact`), per group float64
    sums on the CPU: "err" squared error, "w" squared weights, "noise" the source's rounding noise, "max")."""
    k_in, out = lin.codes.shape
    dev, n = lin.codes.device, out + (-out % 32)
    codes = torch.zeros((k_in, n), dtype=torch.int16, device=dev)
    qscale = torch.full((len(groups), n), 16.0, device=dev)
    mx = torch.empty(len(groups), dtype=torch.float16, device=dev)
    scales = torch.zeros((len(groups), n), dtype=torch.float16, device=dev)
    sums = {k: torch.empty(len(groups), dtype=torch.float64, device=dev) for k in ("err", "w", "noise", "max")}
    src_groups, row = torch.tensor([g for g, _ in groups], device=dev), 0
    for i, j, rows in _chunks(groups, out, dev):
        src = src_groups[i:j]
        rows_in = perm[row:row + (j - i) * rows].view(j - i, rows)                   # [g, R] input rows
        jc = lin.codes[rows_in].float() - lin.zeros[src].unsqueeze(1).float()         # [g, R, N]
        s = lin.scales[src]                                                            # [g, N]
        w = (jc * s.unsqueeze(1)).to(torch.float16).float()                            # the source's weights
        if exact:                      # the codes as they are, s in fp16; for other readers the nearest steps
            se = s.to(torch.float16)
            mx[i:j], levels = _levels(se.float().amax(1))
            qs, c, d = _nearest(levels, se.float()) + 1, jc, (jc * se.float().unsqueeze(1)).to(torch.float16).float()
            scales[i:j, :out] = se
        else:
            ideals = [s * 2.0 ** (lin.bits - width)]
            if not bool((lin.zeros[src] == 1 << (lin.bits - 1)).all()):             # asymmetric: no-clip step too
                half = 1 << (width - 1)
                ideals.append(torch.maximum(w.amax(1) / (half - 1), -w.amin(1) / half))
            mx[i:j], levels = _levels(torch.stack(ideals).amax(0).amax(1))
            qs, c, d = _search(w, ideals, levels, width)
        qscale[i:j, :out], codes[row:row + (j - i) * rows, :out] = qs, c.view(-1, out).to(torch.int16)
        err = (d - w).abs()
        sums["err"][i:j] = err.double().square().sum(dim=(1, 2))
        sums["w"][i:j] = w.double().square().sum(dim=(1, 2))
        sums["noise"][i:j] = (s.double().square() * rows / 12).sum(dim=1)
        sums["max"][i:j] = err.amax(dim=(1, 2)).double()
        row += (j - i) * rows
    return codes.cpu(), qscale.cpu(), mx.cpu(), scales.cpu(), {k: v.cpu() for k, v in sums.items()}
