"""The MoE block's decode experts in two launches, the residual added by the second (tuning switch
MOEDESK_MOE_FINISH; layers all in VRAM, without a CPU cut).

`kernels.experts_decode` takes three launches and the block a fourth: a memset of the fp32 buffers, gate/up's
split-K slices added into them, down's (SiLU(gate) x up computed again by every program for every row it
reads), and torch's add of the sum into the residual stream. Here:
- gate/up: each (pair, column block)'s K slices add into the split-K workspace of
  runtime/experts/linear_gemv.py and count there; the slice that comes last stores h = SiLU(gate) x up in
  fp16 (as down's programs rounded it) and leaves its workspace and counter at zero. K whole: stored at once;
- down: each (row, column block) counts the A x KSPLIT slices of its pairs; the last one stores
  residual + sum in fp16 (one rounding, as torch's add of the fp32 sum) into the new residual, and leaves the
  workspace and counter at zero.
No buffer to zero, no add; the sums are the same, in the atomics' order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from runtime import tuning
from runtime.experts import kernels
from runtime.experts.kernels import SplitK, _bk
from runtime.experts.linear_gemv import workspace
from runtime.experts.pack import PackedExperts
from runtime.experts.triton_kernels import WALIGN, _tile_dot, last_slice, take_sums


@triton.jit
def _gate_up_finish(x_ptr, ids_ptr, q1, o1, s1, p1, q3, o3, s3, p3, h_ptr, ws_ptr, cnt_ptr, P, K: tl.constexpr,
                    N: tl.constexpr, A: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr,
                    G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr,
                    COLUMNS: tl.constexpr):
    """h fp16 [P, N] = SiLU(x . gate) * (x . up) for pair p's columns of this block (module docstring); ws
    fp32 [2, P, N] and cnt int32 [P, cdiv(N, BN)] zero before and after. Grid (P, cdiv(N, BN), KSPLIT)."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    wb1 = tl.multiple_of(tl.load(o1 + e), WALIGN)                                       # codes: offset table
    wb3 = tl.multiple_of(tl.load(o3 + e), WALIGN)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    ks = tl.program_id(2) * (K // KSPLIT)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    acc3 = tl.zeros([BN], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        rows = k0 + tl.arange(0, BK)
        x1 = tl.load(x_ptr + t * K + tl.load(p1 + e * K + rows)).to(tl.float32)
        acc1 += _tile_dot(x1, q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN, COLUMNS)
        x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + rows)).to(tl.float32)
        acc3 += _tile_dot(x3, q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN, COLUMNS)
    if KSPLIT == 1:
        tl.store(h_ptr + p * N + offs_n, (acc1 / (1.0 + tl.exp(-acc1)) * acc3).to(tl.float16), mask=mask_n)
    else:
        g_ptrs = ws_ptr + p * N + offs_n
        u_ptrs = ws_ptr + P * N + p * N + offs_n
        tl.atomic_add(g_ptrs, acc1, mask=mask_n)
        tl.atomic_add(u_ptrs, acc3, mask=mask_n)
        c_ptr = cnt_ptr + p * tl.num_programs(1) + tl.program_id(1)
        if last_slice(c_ptr, KSPLIT):
            g = take_sums(g_ptrs, acc1, mask_n)
            u = take_sums(u_ptrs, acc3, mask_n)
            tl.store(h_ptr + p * N + offs_n, (g / (1.0 + tl.exp(-g)) * u).to(tl.float16), mask=mask_n)
            tl.store(c_ptr, 0)


@triton.jit
def _down_finish(h_ptr, ids_ptr, rw_ptr, q2, o2, s2, p2, res_ptr, out_ptr, ws_ptr, cnt_ptr, K: tl.constexpr,
                 N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr, ORDERED: tl.constexpr,
                 COLUMNS: tl.constexpr):
    """out fp16 [T, NOUT] = res + sum over row t's pairs of rw * (h . down) (module docstring); h fp16 [P, HS]
    (K <= HS rows read: through down's permutation, or in runs when ORDERED); ws fp32 [T, NOUT] and cnt int32
    [T, cdiv(N, BN)] zero before and after. Grid (P, cdiv(N, BN), KSPLIT)."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    wb2 = tl.multiple_of(tl.load(o2 + e), WALIGN)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    ks = tl.program_id(2) * (K // KSPLIT)
    acc = tl.zeros([BN], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        if ORDERED:
            idx = k0 + tl.arange(0, BK)
        else:
            idx = tl.load(p2 + e * K + k0 + tl.arange(0, BK))
        h = tl.load(h_ptr + p * HS + idx).to(tl.float32)
        acc += _tile_dot(h, q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN, COLUMNS)
    acc *= tl.load(rw_ptr + p)
    mask_o = offs_n < NOUT
    w_ptrs = ws_ptr + t * NOUT + offs_n
    tl.atomic_add(w_ptrs, acc, mask=mask_o)
    c_ptr = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
    if last_slice(c_ptr, A * KSPLIT):                         # the last of the row's pairs and slices
        total = take_sums(w_ptrs, acc, mask_o)
        res = tl.load(res_ptr + t * NOUT + offs_n, mask=mask_o, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * NOUT + offs_n, (res + total).to(tl.float16), mask=mask_o)
        tl.store(c_ptr, 0)


def experts_added(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts, w3: PackedExperts,
                  w2: PackedExperts, residual: torch.Tensor, order: Optional[kernels.InputOrder] = None) -> torch.Tensor:
    """residual fp16 [T, H] + kernels.experts_forward(x, ids, weights, ...) as a new fp16 [T, H] (one rounding):
    in two launches where `takes` (and a workspace fits), else the experts' kernels and torch's add."""
    out = None
    if takes(x, ids):
        out = experts_finish(x, ids, weights, w1, w3, w2, residual, bool(order and order.ordered_down))
    if out is None:
        y = kernels.experts_forward(x, ids, weights, w1, w3, w2, order=order)
        out = torch.add(residual, y, out=torch.empty_like(residual))
    return out


def takes(x: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether `experts_finish` serves this call: the switch on, few pairs (the split-K GEMVs' range), the
    tile summed by weights or columns (not MOEDESK_GEMV_SUMS=rows)."""
    t = tuning.current()
    return t.moe_finish and x.shape[0] * ids.shape[1] <= t.gemv_max_pairs and t.gemv_sums != "rows"


def experts_finish(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                   w3: PackedExperts, w2: PackedExperts, residual: torch.Tensor,
                   ordered: bool = False) -> Optional[torch.Tensor]:
    """residual fp16 [T, H] + the weighted experts of x fp16 [T, H] (normed), as a new fp16 [T, H], in two
    launches (module docstring); None where no workspace fits during a graph capture (the caller then takes
    the three launches and an add). ordered: down's permutation is the identity (InputOrder.ordered_down)."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    if residual.shape != (T, H) or residual.dtype != torch.float16 or not residual.is_contiguous():
        raise ValueError(f"experts_finish: residual fp16 [{T}, {H}] contiguous, got {residual.dtype} "
                         f"{list(residual.shape)}")
    cols = tuning.current().gemv_sums == "columns"
    bk1, bk2 = _bk(w1, w3, cap=128), _bk(w2, cap=128)
    key1 = ("gate_up_finish", H, I1, P, w1.bits, w1.group, w3.bits, w3.group, cols, x.device)
    key2 = ("down_finish", I2, H2, P, w2.bits, w2.group, bk2, cols, ordered, x.device)
    c1, c2 = kernels._CHOSEN.get(key1), kernels._CHOSEN.get(key2)
    c1s = [c1] if c1 else kernels._candidates(H, I1, P, bk1)          # the shapes to time, once per key
    c2s = [c2] if c2 else kernels._candidates(I2, H2, P, bk2)
    narrow = min(c.bn for c in c1s + c2s)
    ws = workspace(x.device, max(2 * P * I1, T * H), max(P * triton.cdiv(I1, narrow), T * triton.cdiv(H2, narrow)))
    if ws is None:
        return None
    x, ids_f = x.contiguous(), ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32)

    def gate_up(c: SplitK, h: torch.Tensor):
        _gate_up_finish[(P, triton.cdiv(I1, c.bn), c.ksplit)](
            x, ids_f, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, h, ws[0],
            ws[1], P, K=H, N=I1, A=A, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group, BK=bk1, BN=c.bn,
            KSPLIT=c.ksplit, COLUMNS=cols, num_warps=c.warps)

    def down(c: SplitK, h: torch.Tensor, out: torch.Tensor):
        _down_finish[(P, triton.cdiv(H2, c.bn), c.ksplit)](
            h, ids_f, rw, w2.qweight, w2.woff, w2.scales, w2.perm, residual, out, ws[0], ws[1], K=I2, N=H2, HS=I1,
            NOUT=H, A=A, BITS=w2.bits, G=w2.group, BK=bk2, BN=c.bn, KSPLIT=c.ksplit, ORDERED=ordered,
            COLUMNS=cols, num_warps=c.warps)

    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    out = torch.empty_like(residual)
    if c1 is None or c2 is None:                # timed into scratch, before any capture
        hs, outs = torch.zeros_like(h), torch.empty_like(out)
        c1 = kernels._choose(key1, c1s, lambda c: gate_up(c, hs))
        c2 = kernels._choose(key2, c2s, lambda c: down(c, hs, outs))
    gate_up(c1, h)
    down(c2, h, out)
    return out
