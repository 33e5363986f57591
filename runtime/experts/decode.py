"""The experts of a few rows (decode, verify): split-K GEMVs over the chosen experts, their weights
dequantized on the fly, the expert ids read on the device (no host synchronisation: a decode step is
captured in a CUDA graph). One program per (pair, column block, K slice).

Two ways, the same sums (in the atomics' order):
- `experts_decode`, three launches: a memset of fp32 buffers, gate/up's K slices added into them, down's
  (SiLU(gate) x up computed on load, weighted by the routing weight, added into the token's row). It takes a
  skip mask and a CPU cut (runtime/cpu/path.py: the CPU computes the first `cut` intermediate rows of the
  marked experts) and offset tables pointing anywhere (runtime/offload/): every layer that is offloaded.
- `experts_finish`, two launches for layers all in VRAM, adding into the residual stream: gate/up's slice
  that comes last (counted in the workspace of runtime/experts/shapes.py) stores h = SiLU(gate) x up in fp16
  (as down rounded it); down's last slice of a row's pairs stores residual + sum in fp16 (one rounding, as
  torch's add of the fp32 sum). No buffer to zero, no add, no SiLU again in every program of down. With the
  norm and routing in one launch (routing.route_normed) the MoE block of a decode step is three launches.

Launch shapes are timed once per shape on the GPU (shapes.choose), unless one is forced (Tuning.splitk).
Letters: T tokens, A experts per token, P = T*A pairs, H hidden, I expert (intermediate) size, K/N a
kernel's input/output features.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts
from runtime.experts.shapes import CHOSEN, SplitK, candidates, choose, tile, workspace
from runtime.experts.tiles import WALIGN, _tile_dot, last_slice, silu_h, take_sums

GEMV_MAX_PAIRS = 64      # up to this many (token, expert) pairs the split-K GEMVs (one weight read per pair);
                         # above, the grouped kernels (grouped.py: one read per expert and block of rows)
# A CPU cut is a multiple of CUT_ALIGN rows of the intermediate: down's K tile where a cut is given, and whole
# 32-row words and 16-column tiles on the CPU's side. 64 is what was measured (docs/engine-notes.md); steps of
# 32 pass the interpreter checks but were never timed.
CUT_ALIGN = 64


@triton.jit
def _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, lo, K: tl.constexpr,
                         N: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr,
                         G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr):
    wb1 = tl.multiple_of(tl.load(o1 + e), WALIGN)                                       # codes: offset table
    wb3 = tl.multiple_of(tl.load(o3 + e), WALIGN)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = (offs_n < N) & (offs_n >= lo)          # columns below lo: the CPU's (masked lanes read nothing)
    ks = tl.program_id(2) * (K // KSPLIT)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    acc3 = tl.zeros([BN], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        rows = k0 + tl.arange(0, BK)
        x1 = tl.load(x_ptr + t * K + tl.load(p1 + e * K + rows)).to(tl.float32)
        acc1 += _tile_dot(x1, q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
        x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + rows)).to(tl.float32)
        acc3 += _tile_dot(x3, q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
    tl.atomic_add(gu_ptr + p * N + offs_n, acc1, mask=mask_n)
    tl.atomic_add(gu_ptr + P * N + p * N + offs_n, acc3, mask=mask_n)


@triton.jit
def _gate_up_splitk(x_ptr, ids_ptr, skip_ptr, cut_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P,
                    K: tl.constexpr, N: tl.constexpr, A: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr,
                    BITS3: tl.constexpr, G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                    KSPLIT: tl.constexpr, SKIP: tl.constexpr):
    """Partial gate and up sums over one K slice, added into gu fp32 [2, P, N] (zeroed by the caller).
    SKIP: a pair whose expert has skip_ptr[e] != 0 (uint8 [E]) leaves its first cut_ptr[0] columns
    (int32 [1]) to the CPU path, which computes them elsewhere: a cut of N or more leaves the whole
    expert. Without SKIP, skip_ptr and cut_ptr are not read."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    if SKIP:
        lo = tl.where(tl.load(skip_ptr + e) != 0, tl.load(cut_ptr), 0)
        if lo < (tl.program_id(1) + 1) * BN:
            _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, lo, K, N,
                                 BITS1, G1, BITS3, G3, BK, BN, KSPLIT)
    else:
        _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, 0, K, N,
                             BITS1, G1, BITS3, G3, BK, BN, KSPLIT)


@triton.jit
def _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
               HS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
               ORDERED: tl.constexpr):
    if ORDERED:                         # down's permutation is the identity: gate/up's columns in runs
        idx = k0 + tl.arange(0, BK)
    else:
        idx = tl.load(p2 + e * K + k0 + tl.arange(0, BK))
    h = silu_h(gu_ptr + p * HS, gu_ptr + P * HS + p * HS, idx)
    return acc + _tile_dot(h, q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)


@triton.jit
def _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K: tl.constexpr,
                      N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                      BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr, CUT: tl.constexpr,
                      ORDERED: tl.constexpr):
    wb2 = tl.multiple_of(tl.load(o2 + e), WALIGN)                                       # codes: offset table
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    ks = tl.program_id(2) * (K // KSPLIT)
    for kk in range(0, K // KSPLIT, BK):
        if CUT:          # tiles below k_start (known at run time) are the CPU's
            if ks + kk >= k_start:
                acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                                 BITS, G, BK, BN, ORDERED)
        else:
            acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                             BITS, G, BK, BN, ORDERED)
    rw = tl.load(rw_ptr + p)
    tl.atomic_add(out_ptr + t * NOUT + offs_n, acc * rw, mask=offs_n < NOUT)


@triton.jit
def _down_splitk(gu_ptr, ids_ptr, skip_ptr, cut_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, K: tl.constexpr,
                 N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr,
                 SKIP: tl.constexpr, ORDERED: tl.constexpr = False):
    """h = SiLU(gate) * up (rounded to fp16, as the tensor-core path), then down over one K slice,
    weighted by the routing weight and added into out fp32 [T, NOUT] (zeroed by the caller).
    SKIP: as _gate_up_splitk: a marked pair's first cut_ptr[0] rows of K (a multiple of BK) are the
    CPU's; a cut of K or more leaves the whole expert. ORDERED: down's permutation is the identity
    (pack.align_intermediate): gu is read in runs, the permutation not at all."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    ks = tl.program_id(2) * (K // KSPLIT)
    if SKIP:
        k_start = tl.maximum(ks, tl.where(tl.load(skip_ptr + e) != 0, tl.load(cut_ptr), 0))
        if k_start < ks + K // KSPLIT:
            _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K, N, HS, NOUT,
                              BITS, G, BK, BN, KSPLIT, True, ORDERED)
    else:
        _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, ks, K, N, HS, NOUT,
                          BITS, G, BK, BN, KSPLIT, False, ORDERED)


@triton.jit
def _gate_up_finish(x_ptr, ids_ptr, q1, o1, s1, p1, q3, o3, s3, p3, h_ptr, ws_ptr, cnt_ptr, P, K: tl.constexpr,
                    N: tl.constexpr, A: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr,
                    G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr):
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
        acc1 += _tile_dot(x1, q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
        x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + rows)).to(tl.float32)
        acc3 += _tile_dot(x3, q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
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
                 G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr, ORDERED: tl.constexpr):
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
        acc += _tile_dot(h, q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
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


def _check_cut(x: torch.Tensor, E: int, skip: Optional[torch.Tensor], cut: Optional[torch.Tensor]) -> None:
    if skip is not None and (skip.dtype != torch.uint8 or skip.numel() != E or skip.device != x.device):
        raise ValueError(f"skip mask: expected uint8 [{E}] on {x.device}, got "
                         f"{skip.dtype} {list(skip.shape)} on {skip.device}")
    if (skip is None) != (cut is None) or cut is not None and (
            cut.dtype != torch.int32 or cut.numel() != 1 or cut.device != x.device):
        raise ValueError("a skip mask comes with its cut, int32 [1] on the same device"
                         + ("" if cut is None else f"; got {cut.dtype} {list(cut.shape)} on {cut.device}"))


def experts_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                   w3: PackedExperts, w2: PackedExperts, skip: Optional[torch.Tensor] = None,
                   cut: Optional[torch.Tensor] = None, ordered: bool = False,
                   splitk: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Few rows: x fp16 [T, H] -> fp32 [T, H] in three launches (module docstring); no intermediate leaves
    fp32. skip uint8 [E] with cut int32 [1], on the device: a pair whose expert is marked leaves the first
    `cut` rows of its intermediate (gate/up columns, down rows; a multiple of CUT_ALIGN) to the CPU, which adds
    its part elsewhere; a cut of the expert's width or more leaves the whole expert. The intermediate must then
    be in down's packed order (pack.align_intermediate); the shapes chosen without a mask serve it too. ordered:
    down's permutation is the identity (grouped.InputOrder.ordered_down): down reads gate/up's output in runs."""
    _check_cut(x, w1.num_experts, skip, cut)
    has_skip = skip is not None
    skip_t = skip if has_skip else ids          # not read without SKIP
    cut_t = cut if has_skip else ids
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    buf = torch.zeros(2 * P * I1 + T * H, dtype=torch.float32, device=x.device)
    gu, out = buf[: 2 * P * I1], buf[2 * P * I1:].view(T, H)
    ids_f = ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32)
    x = x.contiguous()
    # with a cut, down's K tile divides CUT_ALIGN, so the GPU's part of a split expert starts on a tile
    bk1, bk2 = tile(w1, w3, cap=128), tile(w2, cap=CUT_ALIGN if has_skip else 128)

    def gate_up(c: SplitK, dst: torch.Tensor):
        _gate_up_splitk[(P, triton.cdiv(I1, c.bn), c.ksplit)](
            x, ids_f, skip_t, cut_t, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, dst, P,
            K=H, N=I1, A=A, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group, BK=bk1, BN=c.bn,
            KSPLIT=c.ksplit, SKIP=has_skip, num_warps=c.warps)

    def down(c: SplitK, dst: torch.Tensor):
        _down_splitk[(P, triton.cdiv(H2, c.bn), c.ksplit)](
            gu, ids_f, skip_t, cut_t, rw, w2.qweight, w2.woff, w2.scales, w2.perm, dst, P, K=I2, N=H2, HS=I1, NOUT=H, A=A,
            BITS=w2.bits, G=w2.group, BK=bk2, BN=c.bn, KSPLIT=c.ksplit, SKIP=has_skip, ORDERED=ordered,
            num_warps=c.warps)

    key1 = ("gate_up", H, I1, P, w1.bits, w1.group, w3.bits, w3.group, splitk, x.device)
    key2 = ("down", I2, H2, P, w2.bits, w2.group, bk2, splitk, x.device)
    c1, c2 = CHOSEN.get(key1), CHOSEN.get(key2)
    if c1 is None or c2 is None:                # timed into scratch, before any capture
        scratch = torch.empty_like(buf)
        c1 = choose(key1, candidates(H, I1, P, bk1, splitk), lambda c: gate_up(c, scratch[: 2 * P * I1]))
        c2 = choose(key2, candidates(I2, H2, P, bk2, splitk), lambda c: down(c, scratch[2 * P * I1:].view(T, H)))
    gate_up(c1, gu)
    down(c2, out)
    return out


def experts_finish(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                   w3: PackedExperts, w2: PackedExperts, residual: torch.Tensor, ordered: bool = False,
                   splitk: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
    """residual fp16 [T, H] + the weighted experts of x fp16 [T, H] (normed), as a new fp16 [T, H], in two
    launches (module docstring); None where no workspace fits during a graph capture (the caller then takes
    the three launches and an add). ordered: as experts_decode's."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    if residual.shape != (T, H) or residual.dtype != torch.float16 or not residual.is_contiguous():
        raise ValueError(f"experts_finish: residual fp16 [{T}, {H}] contiguous, got {residual.dtype} "
                         f"{list(residual.shape)}")
    bk1, bk2 = tile(w1, w3, cap=128), tile(w2, cap=128)
    key1 = ("gate_up_finish", H, I1, P, w1.bits, w1.group, w3.bits, w3.group, splitk, x.device)
    key2 = ("down_finish", I2, H2, P, w2.bits, w2.group, bk2, ordered, splitk, x.device)
    c1, c2 = CHOSEN.get(key1), CHOSEN.get(key2)
    c1s = [c1] if c1 else candidates(H, I1, P, bk1, splitk)          # the shapes to time, once per key
    c2s = [c2] if c2 else candidates(I2, H2, P, bk2, splitk)
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
            KSPLIT=c.ksplit, num_warps=c.warps)

    def down(c: SplitK, h: torch.Tensor, out: torch.Tensor):
        _down_finish[(P, triton.cdiv(H2, c.bn), c.ksplit)](
            h, ids_f, rw, w2.qweight, w2.woff, w2.scales, w2.perm, residual, out, ws[0], ws[1], K=I2, N=H2, HS=I1,
            NOUT=H, A=A, BITS=w2.bits, G=w2.group, BK=bk2, BN=c.bn, KSPLIT=c.ksplit, ORDERED=ordered,
            num_warps=c.warps)

    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    out = torch.empty_like(residual)
    if c1 is None or c2 is None:                # timed into scratch, before any capture
        hs, outs = torch.zeros_like(h), torch.empty_like(out)
        c1 = choose(key1, c1s, lambda c: gate_up(c, hs))
        c2 = choose(key2, c2s, lambda c: down(c, hs, outs))
    gate_up(c1, h)
    down(c2, h, out)
    return out
