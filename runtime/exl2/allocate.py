"""Bit allocation between the linears of a layer, measured on the calibration data.

Each linear is quantized (GPTQ) at a few candidate sizes around the target (one bit under it to one over,
and from 4 bits on two over: see STEPS), each the widest mix of two adjacent widths that stores at most
that many bits per weight (format.stored_target: the first, act-order rows get the wider codes, as in
exllamav2's mixes). The error of each candidate is measured
on the layer's real inputs as the relative output error
    ||X W^T - X Wq^T||^2 / ||X W^T||^2 = tr(D H D^T) / tr(W H W^T),   D = W - Wq,  H = 2 X^T X,
and candidates are chosen greedily: starting from the smallest everywhere, the upgrade with the
largest error reduction per extra stored bit is taken while the layer stays within its budget of
target x (its weights) bits (with a heap of each linear's best upgrade: a layer of 256 experts has 768
linears, and a scan of all of them per upgrade took seconds). The bits counted are all the tensor stores (codes, scales, group table,
permutation), as exllamav2's -b counts them, so the model's quantized linears average the target up to
the granularity of the candidates. exllamav2's measurement pass works on the same principle with a
global search over whole layers' options; this is its per-layer form, which a streaming conversion allows.

The measurement is only as good as the calibration's Hessians: below CONVERT_MEASURE_MIN_TOKENS calibration
tokens (runtime/options.py says why) `choose_allocation` falls back to uniform widths unless asked to measure.
"""
from __future__ import annotations

import heapq
from typing import Mapping, Optional, Sequence

import torch

from runtime.options import CONVERT_MEASURE_MIN_TOKENS

from . import format as fmt

# Candidate stored bits per weight around the target, and the one more two bits over it from WIDE_FROM bits
# on. Measured on the demo model (bench.convert_quality, the per-layer allocation from the same candidates'
# errors): at 4.0 the +2 candidate went to every layer's v_proj and lowered the perplexity by about 3%, at
# 6.0 slightly; at 2.5 and 3.0 it raised it (2.5: 177 -> 254): where every linear's error is large, the
# relative error of a small projection's own output overstates what a wide code there is worth beside the
# MLP's large matrices.
STEPS = (-1.0, -0.5, 0.0, 0.5, 1.0)
WIDE_STEP, WIDE_FROM = 2.0, 4.0


def choose_allocation(tokens: int, measure: Optional[bool] = None, min_tokens: Optional[int] = None) -> dict:
    """How a conversion with `tokens` calibration tokens allocates widths. `measure`: True measures whatever
    the calibration (asked for), False gives every linear the target (asked for), None measures only from
    `min_tokens` tokens on (None: CONVERT_MEASURE_MIN_TOKENS).
    -> {"widths": "measured" | "uniform", "requested": "measure" | "uniform" | "auto", "calibration_tokens",
    "min_tokens", "reason"} (the record quantization_config keeps)."""
    min_tokens = CONVERT_MEASURE_MIN_TOKENS if min_tokens is None else min_tokens
    if tokens < 1 or min_tokens < 1:
        raise ValueError(f"calibration tokens {tokens} and min_tokens {min_tokens} must be at least 1")
    requested = {True: "measure", False: "uniform", None: "auto"}[measure]
    if measure is None:
        measure = tokens >= min_tokens
        reason = (f"{tokens} calibration tokens, at least the {min_tokens} the measurement needs" if measure else
                  f"{tokens} calibration tokens are fewer than the {min_tokens} the measurement needs; every linear "
                  f"at the target width instead (more rows or a longer sequence measure; --measure forces it)")
    elif measure:
        reason = f"measured as asked, on {tokens} calibration tokens" + (
            f" (fewer than the {min_tokens} the measurement needs)" if tokens < min_tokens else "")
    else:
        reason = "uniform widths as asked"
    return {"widths": "measured" if measure else "uniform", "requested": requested, "calibration_tokens": tokens,
            "min_tokens": min_tokens, "reason": reason}


def candidates(bits: float) -> list[float]:
    steps = STEPS + ((WIDE_STEP,) if bits >= WIDE_FROM else ())
    return sorted({min(8.5, max(2.0, bits + s)) for s in steps})


def stored_bpw(tensors: Mapping[str, torch.Tensor], weights: int) -> float:
    """Stored bits per weight of a quantized tensor set of `weights` weights (what exllamav2's -b counts)."""
    return fmt.stored_bits(tensors) / weights


def relative_error(weight: torch.Tensor, deq: torch.Tensor, hessian: torch.Tensor) -> float:
    h = hessian.to(torch.float64)
    w = weight.to(torch.float64)
    d = w - deq.to(torch.float64)
    return float(((d @ h) * d).sum() / ((w @ h) * w).sum().clamp(min=1e-30))


MEASURE_ELEMENTS = 1 << 24       # elements of one [in, experts, out] temporary of relative_errors at most


def relative_errors(original: torch.Tensor, codes: torch.Tensor, qscale: torch.Tensor, qsm: torch.Tensor,
                    group_rows: Sequence[int], hessians: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """`relative_error` of a batch, where the quantizer left it (gptq.quantize_stacked), without unpacking:
    original [in, E, P, out] (packed order), codes [in, E, P x k, out] int8 and scales qscale [G, E, P x k, N],
    qsm [G, E, P x k] (copy p x k + c is part p at candidate c), hessians [E or 1, in, in] (the channels' own
    order), perm [E, in] or [in]. The dequantized weights are exllamav2's (fp16 products, as format.dequantize),
    the sums in float64 on a CPU and float32 on a GPU (where float64 is slow on consumer cards; the errors rank
    candidates, differences of 1e-6 do not matter). -> [E, P, k]."""
    in_features, n_e, parts, out = original.shape
    dt = torch.float64 if original.device.type == "cpu" else torch.float32
    perm = perm if perm.dim() == 2 else perm.unsqueeze(0)
    hp = hessians.to(dt).gather(1, perm.unsqueeze(2).expand(-1, -1, in_features))
    hp = hp.gather(2, perm.unsqueeze(1).expand(-1, in_features, -1))          # [E or 1, in, in], packed order
    row_group = torch.repeat_interleave(torch.arange(len(group_rows), device=codes.device),
                                        torch.tensor(list(group_rows), device=codes.device))
    errors = torch.empty((n_e, parts, k), dtype=dt, device=original.device)
    step_e = max(1, MEASURE_ELEMENTS // (in_features * out))

    def quad(x: torch.Tensor, e0: int, e1: int) -> torch.Tensor:     # x [in, e, out] -> sum_o x_o^T H x_o, [e]
        xe = x.transpose(0, 1)                                        # [e, in, out]
        h = hp if hp.shape[0] == 1 else hp[e0:e1]
        return (torch.matmul(h, xe) * xe).sum(dim=(1, 2))

    for e0 in range(0, n_e, step_e):
        e1 = min(n_e, e0 + step_e)
        for p in range(parts):
            w = original[:, e0:e1, p].to(dt)                         # [in, e, out]
            den = quad(w, e0, e1).clamp(min=1e-30)
            for c in range(k):
                m = p * k + c
                step = fmt.group_steps(qscale[:, e0:e1, m, :out], qsm[:, e0:e1, m].unsqueeze(-1))   # [G, e, out]
                deq = (codes[:, e0:e1, m].to(torch.float32) * step[row_group]).to(torch.float16)
                errors[e0:e1, p, c] = quad(w - deq.to(dt), e0, e1) / den
    return errors


def code_bits(tensors: Mapping[str, torch.Tensor]) -> float:
    """Code bits per weight of a quantized tensor set (its groups' widths; small matrices may get a
    single group of the wider width of a mix, so this is not always the nominal width)."""
    _, _, groups = fmt.read_layout(tensors)
    return sum(g.bits * g.rows for g in groups) / sum(g.rows for g in groups)


def allocate(options: Mapping[str, Mapping[float, tuple[float, float]]], sizes: Mapping[str, int],
             bits: float) -> dict[str, float]:
    """options: per linear, candidate -> (stored bits per weight, measured error); sizes: weights per linear.
    -> chosen candidate per linear, with sum(code bits x size) <= bits x sum(size) where possible.
    Greedy: the upgrade of largest error reduction per extra bit that fits, the first linear (in `options`' order)
    and its first candidate on ties. Each linear's best upgrade waits in a heap; an upgrade that no longer fits is
    looked at again when it comes to the top (the budget only shrinks, so a linear's best gain never grows
    unless it is upgraded), so the choices are those of a scan of every linear per step."""
    keys = list(options)
    chosen = {k: min(opts, key=lambda c: opts[c][0]) for k, opts in options.items()}
    budget = bits * sum(sizes.values()) + 1e-6
    spent = sum(options[k][chosen[k]][0] * sizes[k] for k in chosen)
    heap: list[tuple[float, int, float, float]] = []

    def push(i: int) -> None:                     # linear i's best upgrade that fits now, if any
        k = keys[i]
        now_bits, now_err = options[k][chosen[k]]
        best = None
        for c, (b, err) in options[k].items():
            cost = (b - now_bits) * sizes[k]
            if cost <= 0 or err >= now_err or spent + cost > budget:
                continue
            gain = (now_err - err) / cost
            if best is None or gain > best[0]:
                best = (gain, c, cost)
        if best is not None:
            heapq.heappush(heap, (-best[0], i, best[1], best[2]))

    for i in range(len(keys)):
        push(i)
    while heap:
        _, i, c, cost = heapq.heappop(heap)
        if spent + cost <= budget:
            chosen[keys[i]], spent = c, spent + cost
        push(i)                                   # its next upgrade, or this one's best that still fits
    return chosen
