"""Fused expert kernels (Triton): dequantize packed expert weights on the fly for the selected experts.

Letters: T tokens (rows), A = top-k experts per token, P = T*A (token, expert) pairs, E experts,
H hidden size, I expert (intermediate) size, K/N a kernel's input/output features.

Two regimes, both reading the expert indices on the device (no host synchronisation, so a decode
step can be captured in a CUDA graph):
- few pairs (decode, verify): one program per (pair, column block), a GEMV over K;
- many pairs (prefill): pairs sorted by expert into blocks of BM rows (`align`, on the device),
  one program per (block, column block), tensor-core dots on dequantized tiles.
Each regime is two kernels: gate+up with SiLU(gate)*up fused, then down scaled by the routing weight.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts

# Up to this many (token, expert) pairs, the split-K GEMVs (one weight read per pair); above, the grouped
# kernels (one read per expert and block of rows). MOEDESK_GEMV_MAX_PAIRS overrides it, to compare.
GEMV_MAX_PAIRS = int(os.environ.get("MOEDESK_GEMV_MAX_PAIRS", 64))
# Every entry of an expert offset table (PackedExperts.woff) is a multiple of this many int32 words
# (runtime/experts/offload.py checks it), so the code loads stay 128-bit vectors.
WALIGN: tl.constexpr = tl.constexpr(16)


@triton.jit
def _dequant_tile(qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of expert e: float32 [BK, BN]. Its codes start
    `base` int32 words after qw_ptr (the expert's entry in the offset table: a VRAM slot or host memory).
    A tile lies within one scale group (GROUP a multiple of BK) or spans whole groups (BK a multiple
    of GROUP, both powers of two)."""
    if BITS == 3:
        # two planes (runtime/experts/pack.py): K/16 words of low 2-bit pairs, then K/32 of high bits
        lo_rows = k0 // 16 + tl.arange(0, BK // 16)
        lo = tl.load(qw_ptr + base + lo_rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        u = tl.reshape((lo[:, None, :] >> (tl.arange(0, 16) * 2)[None, :, None]) & 3, (BK, BN))
        if BK >= 64:
            hi_rows = K // 16 + k0 // 32 + tl.arange(0, BK // 32)
            hi = tl.load(qw_ptr + base + hi_rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
            u |= tl.reshape(((hi[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1) << 2, (BK, BN))
        else:                                   # one word row: gather it per code row
            kk = k0 + tl.arange(0, BK)
            hi = tl.load(qw_ptr + base + (K // 16 + kk // 32)[:, None] * N + offs_n[None, :],
                         mask=mask_n[None, :], other=0)
            u |= ((hi >> (kk % 32)[:, None]) & 1) << 2
    else:
        PER: tl.constexpr = 32 // BITS
        rows_w = k0 // PER + tl.arange(0, BK // PER)
        words = tl.load(qw_ptr + base + rows_w[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        shifts = tl.arange(0, PER) * BITS
        u = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)     # [BK/PER, PER, BN]
        u = tl.reshape(u, (BK, BN))
    if BK > GROUP:                              # several scale groups in the tile (grouped kernels)
        NG: tl.constexpr = BK // GROUP
        g_rows = k0 // GROUP + tl.arange(0, NG)
        s = tl.load(sc_ptr + e * (K // GROUP) * N + g_rows[:, None] * N + offs_n[None, :],
                    mask=mask_n[None, :], other=0.0)
        w = tl.reshape((u - (1 << (BITS - 1))).to(tl.float32), (NG, GROUP, BN)) * s.to(tl.float32)[:, None, :]
        return tl.reshape(w, (BK, BN))
    s = tl.load(sc_ptr + e * (K // GROUP) * N + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)
    return (u - (1 << (BITS - 1))).to(tl.float32) * s.to(tl.float32)[None, :]


@triton.jit
def _gate_up_grouped(x_ptr, pairs_ptr, bexp_ptr, q1, o1, s1, p1, q3, o3, s3, p3, h_ptr, K: tl.constexpr,
                     N: tl.constexpr, A: tl.constexpr, P,
                     BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr, G3: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
        wb1 = tl.multiple_of(tl.load(o1 + e), WALIGN)                                   # codes: offset table
        wb3 = tl.multiple_of(tl.load(o3 + e), WALIGN)
        rows = tl.load(pairs_ptr + b * BM + tl.arange(0, BM))                  # [BM] pair ids, P = empty
        valid = rows < P
        t = rows // A
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        acc1 = tl.zeros([BM, BN], dtype=tl.float32)
        acc3 = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            i1 = tl.load(p1 + e * K + kk)
            xa = tl.load(x_ptr + t[:, None] * K + i1[None, :], mask=valid[:, None], other=0.0)
            w1 = _dequant_tile(q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
            acc1 = tl.dot(xa.to(tl.float16), w1.to(tl.float16), acc1)
            i3 = tl.load(p3 + e * K + kk)
            xb = tl.load(x_ptr + t[:, None] * K + i3[None, :], mask=valid[:, None], other=0.0)
            w3 = _dequant_tile(q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
            acc3 = tl.dot(xb.to(tl.float16), w3.to(tl.float16), acc3)
        h = acc1 / (1.0 + tl.exp(-acc1)) * acc3
        tl.store(h_ptr + rows[:, None] * N + offs_n[None, :], h.to(tl.float16),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_grouped(h_ptr, pairs_ptr, bexp_ptr, rw_ptr, q2, o2, s2, p2, y_ptr, K: tl.constexpr, N: tl.constexpr,
                  HS: tl.constexpr, P,
                  BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  BN: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
        wb2 = tl.multiple_of(tl.load(o2 + e), WALIGN)                                   # codes: offset table
        rows = tl.load(pairs_ptr + b * BM + tl.arange(0, BM))
        valid = rows < P
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            i2 = tl.load(p2 + e * K + kk)
            xa = tl.load(h_ptr + rows[:, None] * HS + i2[None, :], mask=valid[:, None], other=0.0)
            w = _dequant_tile(q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
            acc = tl.dot(xa, w.to(tl.float16), acc)
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
        tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], acc * rw[:, None],
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _router_logits(x_ptr, w_ptr, out_ptr, nw_ptr, H: tl.constexpr, E: tl.constexpr, EB: tl.constexpr,
                   BH: tl.constexpr, NW: tl.constexpr):
    """logits[t, e] = x[t] . w[e] accumulated in fp32 (router weights [E, H], fp16 or fp32); grid (T, E / EB).
    NW: x[t] scaled by the norm weight nw [H] first (a prediction from the residual stream)."""
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * EB + tl.arange(0, EB)
    mask_e = offs_e < E
    acc = tl.zeros([EB], dtype=tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        xv = tl.load(x_ptr + t * H + offs_h).to(tl.float32)
        if NW:
            xv = xv * tl.load(nw_ptr + offs_h).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None] * H + offs_h[None, :], mask=mask_e[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    tl.store(out_ptr + t * E + offs_e, acc, mask=mask_e)


@triton.jit
def _softmax_topk(logits_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr, step_ptr, N, E: tl.constexpr,
                  BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr, RENORM: tl.constexpr,
                  FORCED: tl.constexpr):
    """Softmax over E, the A largest (ties: lowest index first), renormalised; counts chosen experts.
    FORCED (benchmarks): the same work, then the picks replaced by the next of N rows of `table`
    (A distinct experts each; the row taken by an atomic counter at `step_ptr`), weights 1 / A."""
    t = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    mask_e = offs_e < E
    z = tl.load(logits_ptr + t * E + offs_e, mask=mask_e, other=float("-inf"))
    p = tl.exp(z - tl.max(z, axis=0))
    p = tl.where(mask_e, p, 0.0)
    p = p / tl.sum(p, axis=0)
    offs_a = tl.arange(0, BA)
    sel_w = tl.zeros([BA], dtype=tl.float32)
    sel_i = tl.zeros([BA], dtype=tl.int32)
    for j in tl.static_range(A):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, offs_e, BE), axis=0)
        sel_w = tl.where(offs_a == j, m, sel_w)
        sel_i = tl.where(offs_a == j, i, sel_i)
        p = tl.where(offs_e == i, -1.0, p)
    mask_a = offs_a < A
    if RENORM:
        sel_w = sel_w / tl.sum(tl.where(mask_a, sel_w, 0.0), axis=0)
    if FORCED:
        row = tl.atomic_add(step_ptr, 1) % N
        sel_i = tl.load(table_ptr + row * A + offs_a, mask=mask_a, other=0)
        sel_w = tl.where(mask_a, 1.0 / A, 0.0)
    tl.store(ids_ptr + t * A + offs_a, sel_i, mask=mask_a)
    tl.store(rw_ptr + t * A + offs_a, sel_w, mask=mask_a)
    tl.atomic_add(cnt_ptr + sel_i, tl.full([BA], 1, tl.int32), mask=mask_a)


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
        w1 = _dequant_tile(q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
        acc1 += tl.sum(x1[:, None] * w1, axis=0)
        x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + rows)).to(tl.float32)
        w3 = _dequant_tile(q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
        acc3 += tl.sum(x3[:, None] * w3, axis=0)
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
               HS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    idx = tl.load(p2 + e * K + k0 + tl.arange(0, BK))
    g = tl.load(gu_ptr + p * HS + idx)
    u = tl.load(gu_ptr + P * HS + p * HS + idx)
    h = (g / (1.0 + tl.exp(-g)) * u).to(tl.float16).to(tl.float32)
    w = _dequant_tile(q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
    return acc + tl.sum(h[:, None] * w, axis=0)


@triton.jit
def _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K: tl.constexpr,
                      N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                      BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr, CUT: tl.constexpr):
    wb2 = tl.multiple_of(tl.load(o2 + e), WALIGN)                                       # codes: offset table
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    ks = tl.program_id(2) * (K // KSPLIT)
    for kk in range(0, K // KSPLIT, BK):
        if CUT:          # tiles below k_start (known at run time) are the CPU's
            if ks + kk >= k_start:
                acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                                 BITS, G, BK, BN)
        else:
            acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                             BITS, G, BK, BN)
    rw = tl.load(rw_ptr + p)
    tl.atomic_add(out_ptr + t * NOUT + offs_n, acc * rw, mask=offs_n < NOUT)


@triton.jit
def _down_splitk(gu_ptr, ids_ptr, skip_ptr, cut_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, K: tl.constexpr,
                 N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr,
                 SKIP: tl.constexpr):
    """h = SiLU(gate) * up (rounded to fp16, as the tensor-core path), then down over one K slice,
    weighted by the routing weight and added into out fp32 [T, NOUT] (zeroed by the caller).
    SKIP: as _gate_up_splitk: a marked pair's first cut_ptr[0] rows of K (a multiple of BK) are the
    CPU's; a cut of K or more leaves the whole expert."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    ks = tl.program_id(2) * (K // KSPLIT)
    if SKIP:
        k_start = tl.maximum(ks, tl.where(tl.load(skip_ptr + e) != 0, tl.load(cut_ptr), 0))
        if k_start < ks + K // KSPLIT:
            _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K, N, HS, NOUT,
                              BITS, G, BK, BN, KSPLIT, True)
    else:
        _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, ks, K, N, HS, NOUT,
                          BITS, G, BK, BN, KSPLIT, False)


def _bk(*packs: PackedExperts, cap: int = 64) -> int:  # noqa: C901
    """K tile: within one scale group, a whole number of words, at most `cap` rows."""
    bk = cap
    for p in packs:
        bk = min(bk, p.group)
    for p in packs:
        if p.group % bk or p.in_features % bk or bk % (32 if p.bits == 3 else 32 // p.bits):
            raise ValueError(f"expert layout: group {p.group} / K {p.in_features} do not fit a K tile of {bk}")
    return bk


def _bk_span(*packs: PackedExperts, want: int) -> int:
    """K tile of the grouped kernels: `want` rows when that spans whole scale groups of every
    projection (powers of two, dividing K), else a tile of at most `want` rows within one group (`_bk`)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    if pow2(want) and all(pow2(p.group) and want % p.group == 0 and p.in_features % want == 0 for p in packs):
        return want
    return _bk(*packs, cap=want)


@dataclass(frozen=True)
class Grouped:
    """Launch shape of the grouped (prefill) kernels: rows per block (below / from 4096 pairs), columns
    per block, K tile (it may span several scale groups), warps, pipeline stages (0: Triton's default).

    The default is the fastest of 14 shapes that bench.grouped timed on the H200 for
    q125-a11 at 3 bits, 2048 rows: 16.6 ms per layer (37 TFLOP/s) against 32.5 ms for the shape
    before it (16,64,64,64,4,0: 64 columns per block)."""
    bm_small: int = 16
    bm_large: int = 64
    bn: int = 128
    bk: int = 64
    warps: int = 4
    stages: int = 0

    @staticmethod
    def parse(text: str) -> "Grouped":
        """'bm_small,bm_large,bn,bk,warps,stages', e.g. '16,64,128,64,4,0' (MOEDESK_GROUPED)."""
        try:
            v = [int(t) for t in text.split(",")]
            if len(v) != 6:
                raise ValueError
            g = Grouped(*v)
        except (TypeError, ValueError):
            raise ValueError(f"grouped kernel shape {text!r}: want six integers "
                             "bm_small,bm_large,bn,bk,warps,stages, e.g. 16,64,128,64,4,0") from None
        for name in ("bm_small", "bm_large", "bn", "bk", "warps"):
            n = getattr(g, name)
            if n < 1 or n & (n - 1):
                raise ValueError(f"grouped kernel shape {text!r}: {name} {n} is not a power of two")
        if g.bm_small < 16 or g.bm_large < 16 or g.bn < 16 or g.bk < 16:
            raise ValueError(f"grouped kernel shape {text!r}: blocks and tiles of at least 16 (tensor-core dots)")
        return g


GROUPED = Grouped.parse(os.environ["MOEDESK_GROUPED"]) if os.environ.get("MOEDESK_GROUPED") else Grouped()


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to whole blocks of bm rows; all on the device.

    ids: int [P] expert of each pair. Returns (pairs int32 [B*bm], P = padding; block_expert int32 [B],
    -1 = unused block), B an upper bound that depends only on P, so no host synchronisation."""
    P = ids.numel()
    nblocks = (P + min(num_experts, P) * (bm - 1)) // bm
    ids = ids.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids))                                        # [E]; bincount would sync
    nb = (counts + bm - 1) // bm                                             # blocks per expert
    cum_nb = torch.cumsum(nb, 0)
    order = torch.argsort(ids, stable=True)                                  # [P]
    se = ids[order]
    rank = torch.arange(P, device=ids.device) - (torch.cumsum(counts, 0) - counts)[se]
    dest = (cum_nb - nb)[se] * bm + rank
    pairs = torch.full((nblocks * bm,), P, dtype=torch.int32, device=ids.device)
    pairs[dest] = order.to(torch.int32)
    bexp = torch.searchsorted(cum_nb, torch.arange(nblocks, device=ids.device), right=True)
    bexp = torch.where(bexp < num_experts, bexp, -1).to(torch.int32)
    return pairs, bexp


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                    w3: PackedExperts, w2: PackedExperts, union_reads: bool = False,
                    skip: torch.Tensor | None = None, cut: torch.Tensor | None = None) -> torch.Tensor:
    """x fp16 [T, H], ids int [T, A], weights fp32 [T, A] -> fp32 [T, H] (sum of weighted experts).

    skip: uint8 [E] on the device, with cut: int32 [1] on the device. A pair whose expert is marked
    leaves the first `cut` rows of its intermediate (gate/up columns, down rows; a multiple of
    CUT_ALIGN) to the CPU (runtime/experts/cpu_path.py), which adds its part elsewhere; a cut of the
    expert's width or more leaves the whole expert. The intermediate must then be in down's packed
    order (pack.align_intermediate). Split-K GEMVs only (few pairs, no union_reads).

    union_reads: use the grouped kernels even for few pairs, so each chosen expert's weights are read
    once per block of rows instead of once per (row, expert) pair. For offloaded layers, whose cold
    experts are read over PCIe: on the H200 (qwen3-30b-a3b, 8 GB budget) verifying 8 rows per pair
    cost 6.5x the one-row step, 9 rows through the grouped kernels 1.3x.

    Stored column counts may be padded to 32 (padding dequantizes to 0): gate/up write I' >= I
    columns of h, down reads its first I; down's H' >= H columns are cut to H."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    if P <= GEMV_MAX_PAIRS and not (union_reads and T > 1):
        return experts_decode(x, ids, weights, w1, w3, w2, skip, cut)
    if skip is not None:
        raise ValueError(f"a skip mask needs the split-K GEMVs: {T} rows x {A} experts is more than "
                         f"{GEMV_MAX_PAIRS} pairs, or union_reads is set")
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    x = x.contiguous()
    ids_f = ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32).contiguous()
    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    y = torch.empty((P, H2), dtype=torch.float32, device=x.device)
    g = GROUPED
    bk1, bk2 = _bk_span(w1, w3, want=g.bk), _bk_span(w2, want=g.bk)
    bm, bn = (g.bm_large if P >= 4096 else g.bm_small), g.bn
    launch = dict(num_warps=g.warps, **({"num_stages": g.stages} if g.stages else {}))
    pairs, bexp = align(ids_f, w1.num_experts, bm)
    nb = bexp.numel()
    _gate_up_grouped[(nb, triton.cdiv(I1, bn))](
        x, pairs, bexp, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, h,
        H, I1, A, P, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group,
        BM=bm, BK=bk1, BN=bn, **launch)
    _down_grouped[(nb, triton.cdiv(H2, bn))](
        h, pairs, bexp, rw, w2.qweight, w2.woff, w2.scales, w2.perm, y, I2, H2, I1, P,
        BITS=w2.bits, G=w2.group, BM=bm, BK=bk2, BN=bn, **launch)
    return y.view(T, A, H2)[:, :, :H].sum(dim=1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


SM_TARGET = 528          # programs to aim for in decode (about 4 per multiprocessor of an H200)


def _ksplit(K: int, bk: int, programs: int) -> int:
    """Largest power-of-two split of K (in whole tiles) that brings the grid near SM_TARGET programs."""
    ks = 1
    while programs * ks * 2 <= SM_TARGET and K % (ks * 2 * bk) == 0:
        ks *= 2
    return ks


def _cut_align(text: str) -> int:
    if text not in ("32", "64", "128"):
        raise ValueError(f"MOEDESK_CUT_ALIGN={text!r}: want 32, 64 or 128 (rows of a cut's step)")
    return int(text)


# A CPU cut (experts_forward) is a multiple of this many rows of the intermediate: down's K tile
# where a cut is given, and whole 32-row words and 16-column tiles on the CPU's side. 64 was measured
# (runtime/experts/NOTES.md); MOEDESK_CUT_ALIGN=32 gives finer steps (a 32-row tile reads a 3-bit
# expert's high-bit plane row by row: not measured yet).
CUT_ALIGN = _cut_align(os.environ.get("MOEDESK_CUT_ALIGN", "64"))
SHARE_DEN = 1024       # cpu_share_mask: the CPU's share of a token's cold picks in 1/1024ths


@triton.jit
def _cpu_share_mask(ids_ptr, owned_ptr, resident_ptr, out_ptr, share, E: tl.constexpr, BE: tl.constexpr,
                    A: tl.constexpr, BA: tl.constexpr, DEN: tl.constexpr):
    a = tl.arange(0, BA)
    am = a < A
    ids = tl.load(ids_ptr + a, mask=am, other=0)
    cold = am & (tl.load(resident_ptr + ids, mask=am, other=1) == 0)
    cand = cold & (tl.load(owned_ptr + ids, mask=am, other=0) != 0)
    n_cold = tl.sum(cold.to(tl.int32), axis=0)
    target = (n_cold * share + DEN // 2) // DEN
    rank = tl.cumsum(cand.to(tl.int32), axis=0)
    keep = cand & (rank <= target)
    e = tl.arange(0, BE)
    hit = (e[:, None] == ids[None, :]) & keep[None, :]
    tl.store(out_ptr + e, tl.max(hit.to(tl.int32), axis=1).to(tl.uint8), mask=e < E)


def cpu_share_mask(ids: torch.Tensor, owned: torch.Tensor, resident: torch.Tensor, share: int,
                   out: torch.Tensor) -> torch.Tensor:
    """The experts the CPU computes for one token (one decode row), on the device: of the token's
    cold picks (resident[e] == 0), those the CPU has copies of (owned[e] != 0), in pick order, up to
    round(share / SHARE_DEN * cold picks); the rest go over PCIe. So every layer's split follows the
    token's own picks instead of only the average (runtime/experts/cpu_path.py, balanced split).

    ids int32 [1, A]; owned uint8 [E]; resident int32 [E]; out uint8 [E] (written whole)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"cpu_share_mask: one row of expert ids, got shape {list(ids.shape)}")
    if not 0 <= share <= SHARE_DEN:
        raise ValueError(f"cpu_share_mask: share {share} outside 0..{SHARE_DEN}")
    E, A = owned.numel(), ids.shape[1]
    _cpu_share_mask[(1,)](ids.contiguous(), owned, resident, out, share, E=E, BE=triton.next_power_of_2(E),
                          A=A, BA=triton.next_power_of_2(A), DEN=SHARE_DEN)
    return out


@triton.jit
def _cpu_inputs(x_ptr, ids_ptr, w_ptr, m_ptr, dx, di, dw, dm, H, A, E, BH: tl.constexpr, BA: tl.constexpr,
                BE: tl.constexpr):
    h = tl.arange(0, BH)
    tl.store(x_ptr + dx + h, tl.load(x_ptr + h, mask=h < H), mask=h < H)
    a = tl.arange(0, BA)
    tl.store(ids_ptr + di + a, tl.load(ids_ptr + a, mask=a < A), mask=a < A)
    tl.store(w_ptr + dw + a, tl.load(w_ptr + a, mask=a < A), mask=a < A)
    e = tl.arange(0, BE)
    tl.store(m_ptr + dm + e, tl.load(m_ptr + e, mask=e < E), mask=e < E)


def _elements_apart(dst: torch.Tensor, src: torch.Tensor) -> int:
    d = dst.data_ptr() - src.data_ptr()
    if d % src.element_size():
        raise ValueError(f"buffers {d} bytes apart: not a whole number of {src.dtype} elements")
    return d // src.element_size()


def cpu_inputs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, x_h: torch.Tensor,
               ids_h: torch.Tensor, w_h: torch.Tensor, mask_h: torch.Tensor) -> None:
    """One launch instead of four copies: a decode row's x fp16 [1, H], ids int32 [1, A], weights fp32
    [1, A] and mask uint8 [E] (device) written into the CPU path's page-locked buffers of the same
    shapes, through their addresses (unified addressing: stores over PCIe). The stream operation
    that rings the worker after it fences them (cpu_path.py)."""
    for src, dst in ((x, x_h), (ids, ids_h), (w, w_h), (mask, mask_h)):
        if src.dtype != dst.dtype or src.numel() != dst.numel() or not src.is_contiguous():
            raise ValueError(f"cpu_inputs: {src.dtype} {list(src.shape)} into {dst.dtype} {list(dst.shape)}")
    H, A, E = x.numel(), ids.numel(), mask.numel()
    _cpu_inputs[(1,)](x, ids, w, mask, _elements_apart(x_h, x), _elements_apart(ids_h, ids), _elements_apart(w_h, w),
                      _elements_apart(mask_h, mask), H, A, E, BH=triton.next_power_of_2(H),
                      BA=triton.next_power_of_2(A), BE=triton.next_power_of_2(E))


@triton.jit
def _add_from_host(y_ptr, dy, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    part = tl.load(y_ptr + dy + i, mask=i < N, cache_modifier=".cv")      # fetched again, never a cached line
    tl.store(y_ptr + i, tl.load(y_ptr + i, mask=i < N) + part, mask=i < N)


def add_from_host(y: torch.Tensor, y_h: torch.Tensor) -> torch.Tensor:
    """y (device fp32) += y_h (page-locked fp32, same shape) read in place over PCIe: one launch
    instead of a copy and an add. Stream-ordered after the wait for the CPU that wrote y_h."""
    if y.dtype != y_h.dtype or y.numel() != y_h.numel() or not y.is_contiguous():
        raise ValueError(f"add_from_host: {y_h.dtype} {list(y_h.shape)} into {y.dtype} {list(y.shape)}")
    N, BLOCK = y.numel(), 1024
    _add_from_host[(triton.cdiv(N, BLOCK),)](y, _elements_apart(y_h, y), N, BLOCK=BLOCK)
    return y


def router_logits(x: torch.Tensor, gate_w: torch.Tensor, out: torch.Tensor,
                  norm_w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out fp32 [T, E] = (x [T, H], times norm_w [H] if given) . gate_w[e], one launch."""
    T, H = x.shape
    E = gate_w.shape[0]
    eb = 2                                 # E / 2 programs per token, each reading its rows in one or two loads
    bh = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 1) if H % b == 0)   # whole rows in few loads
    _router_logits[(T, triton.cdiv(E, eb))](x, gate_w, out, norm_w if norm_w is not None else x, H=H, E=E, EB=eb,
                                            BH=bh, NW=norm_w is not None, num_warps=4)
    return out


def route_fused(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, counts: torch.Tensor,
                renormalize: bool = True, forced: Optional["UniformPicks"] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp16 [T, H], gate_w fp16 or fp32 [E, H] -> (ids int32 [T, A], weights fp32 [T, A]); two
    launches, counts[e] += times chosen. forced (benchmarks): the router runs as always, then each
    row takes the next pick set of `forced` instead (equal weights)."""
    T, H = x.shape
    E = gate_w.shape[0]
    logits = router_logits(x, gate_w, torch.empty((T, E), dtype=torch.float32, device=x.device))
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    rw = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    if forced is not None and forced.table.shape[1] != top_k:
        raise ValueError(f"route_fused: pick sets of {forced.table.shape[1]} experts for top-k {top_k}")
    table, step = (forced.table, forced.step) if forced is not None else (ids, ids)
    _softmax_topk[(T,)](logits, ids, rw, counts, table, step, table.shape[0], E=E, BE=triton.next_power_of_2(E),
                        A=top_k, BA=triton.next_power_of_2(top_k), RENORM=renormalize,
                        FORCED=forced is not None, num_warps=4)
    return ids, rw


@dataclass
class UniformPicks:
    """Benchmarks only: `rows` sets of A distinct experts drawn uniformly at random (int32 [rows, A],
    on the device), and a counter (int64 [1]) that hands each routed row the next set; a layer's
    counter starts at its own offset, so layers draw independently. Graph-capturable: the counter
    lives on the device."""
    table: torch.Tensor
    step: torch.Tensor

    @staticmethod
    def draw(E: int, top_k: int, device, rows: int = 1 << 16, seed: int = 0) -> "UniformPicks":
        g = torch.Generator().manual_seed(seed)
        table = torch.rand((rows, E), generator=g).topk(top_k, dim=-1).indices.to(torch.int32)
        return UniformPicks(table.to(device), torch.zeros(1, dtype=torch.int64, device=device))

    def for_layer(self, index: int) -> "UniformPicks":
        """The same sets, read from an offset of its own (a counter per layer)."""
        start = (index * 7919 * 97) % self.table.shape[0]
        return UniformPicks(self.table, torch.full((1,), start, dtype=torch.int64, device=self.table.device))


@dataclass(frozen=True)
class SplitK:
    """Launch shape of a split-K GEMV: BN output columns per program, the K range cut in KSPLIT."""
    bn: int
    ksplit: int
    warps: int = 4


# Launch shapes chosen by timing on this GPU, per (kernel, shapes, pairs); filled on first use.
_CHOSEN: dict[tuple, SplitK] = {}


def _candidates(K: int, N: int, P: int, bk: int) -> list[SplitK]:
    """The default first (what the interpreter and a capture use), then the shapes worth timing."""
    default = SplitK(64, _ksplit(K, bk, P * triton.cdiv(N, 64)))
    forced = os.environ.get("MOEDESK_SPLITK")             # "BNxKSPLIT": one shape, for tests and experiments
    if forced:
        bn, ks = (int(v) for v in forced.split("x"))
        return [SplitK(bn, ks) if K % (ks * bk) == 0 else default]
    out = [default]
    for bn in (32, 64, 128):
        for ks in (1, 2, 3, 4, 6, 8, 12, 16):
            programs = P * triton.cdiv(N, bn) * ks
            c = SplitK(bn, ks)
            if K % (ks * bk) == 0 and 128 <= programs <= 4096 and c not in out:
                out.append(c)          # each new shape is one more compilation on first use: keep few
    return out


def _choose(key: tuple, candidates: list[SplitK], launch) -> SplitK:
    """Time each candidate launch (CUDA events, after one untimed call that compiles it) and keep the
    fastest for `key`. Not while a graph is being captured, and not under the interpreter: there the
    default runs. The caller's launches write to scratch buffers."""
    if key in _CHOSEN:
        return _CHOSEN[key]
    if len(candidates) == 1:
        return candidates[0]
    if interpreting() or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    best, best_t = candidates[0], float("inf")
    for c in candidates:
        launch(c)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            launch(c)
        end.record()
        end.synchronize()
        t = start.elapsed_time(end)
        if t < best_t:
            best, best_t = c, t
    _CHOSEN[key] = best
    return best


def experts_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                   w3: PackedExperts, w2: PackedExperts, skip: torch.Tensor | None = None,
                   cut: torch.Tensor | None = None) -> torch.Tensor:
    """Few rows: split-K GEMVs with atomic accumulation; x fp16 [T, H] -> fp32 [T, H]. Three launches
    (one memset, gate+up, down); no intermediate leaves fp32. Launch shapes are timed once per shape
    on the GPU (`_choose`). skip, cut: see experts_forward (the launch shapes chosen without them
    serve them too: a pair's programs for the CPU's part only return)."""
    if skip is not None and (skip.dtype != torch.uint8 or skip.numel() != w1.num_experts
                             or skip.device != x.device):
        raise ValueError(f"skip mask: expected uint8 [{w1.num_experts}] on {x.device}, got "
                         f"{skip.dtype} {list(skip.shape)} on {skip.device}")
    if (skip is None) != (cut is None) or cut is not None and (
            cut.dtype != torch.int32 or cut.numel() != 1 or cut.device != x.device):
        raise ValueError("a skip mask comes with its cut, int32 [1] on the same device"
                         + ("" if cut is None else f"; got {cut.dtype} {list(cut.shape)} on {cut.device}"))
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
    # with a cut, down's K tile divides CUT_ALIGN, so the GPU's part of a split expert starts on a tile
    bk1, bk2 = _bk(w1, w3, cap=128), _bk(w2, cap=CUT_ALIGN if has_skip else 128)
    x = x.contiguous()

    def gate_up(c: SplitK, dst: torch.Tensor):
        grid = (P, triton.cdiv(I1, c.bn), c.ksplit)
        _gate_up_splitk[grid](
            x, ids_f, skip_t, cut_t, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, dst, P,
            K=H, N=I1, A=A, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group, BK=bk1, BN=c.bn,
            KSPLIT=c.ksplit, SKIP=has_skip, num_warps=c.warps)

    def down(c: SplitK, dst: torch.Tensor):
        grid = (P, triton.cdiv(H2, c.bn), c.ksplit)
        _down_splitk[grid](
            gu, ids_f, skip_t, cut_t, rw, w2.qweight, w2.woff, w2.scales, w2.perm, dst, P, K=I2, N=H2, HS=I1, NOUT=H, A=A,
            BITS=w2.bits, G=w2.group, BK=bk2, BN=c.bn, KSPLIT=c.ksplit, SKIP=has_skip, num_warps=c.warps)

    key1 = ("gate_up", H, I1, P, w1.bits, w1.group, w3.bits, w3.group, x.device)
    key2 = ("down", I2, H2, P, w2.bits, w2.group, bk2, x.device)
    if key1 not in _CHOSEN or key2 not in _CHOSEN:
        scratch = torch.empty_like(buf)
        c1 = _choose(key1, _candidates(H, I1, P, bk1), lambda c: gate_up(c, scratch[: 2 * P * I1]))
        c2 = _choose(key2, _candidates(I2, H2, P, bk2), lambda c: down(c, scratch[2 * P * I1:].view(T, H)))
    else:
        c1, c2 = _CHOSEN[key1], _CHOSEN[key2]
    gate_up(c1, gu)
    down(c2, out)
    return out


# -- decode prefetch of the next layer's likely cold experts (runtime/experts/prefetch.py) ------------

@triton.jit
def _prefetch_plan(logits_ptr, mask_ptr, o1, o2, o3, s1, s2, s3, page_ptr, skip_ptr, sskip_ptr,
                   cand_ptr, copy_ptr, on_ptr, ids_ptr, pcand_ptr, pcopy_ptr, score_ptr,
                   otab_ptr, ostep_ptr, n_rows, oracle_q,
                   E: tl.constexpr, BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr,
                   P: tl.constexpr, BP: tl.constexpr, PLAN: tl.constexpr, SCORE: tl.constexpr,
                   SKIP: tl.constexpr, ORACLE: tl.constexpr):
    """One program. SCORE: this layer's prediction (made by the layer before) against its picks `ids`:
    score[0..3] += candidates, candidates picked, copies, copies picked. PLAN: the next layer's
    candidates, its top-A predicted picks (by `logits`) that are cold there (mask 0), the first P in
    rank order; the copies are the candidates when *on_ptr, none otherwise; its step tables s1..s3
    are its tables o1..o3 with each copied expert pointed at its page (page_ptr [3, P] word offsets),
    and (SKIP) its step mask the CPU mask without the copied experts. ORACLE (benchmarks, uniform
    routing): the picks the next layer will draw from `otab` (row *ostep_ptr), each kept with
    probability oracle_q and otherwise replaced by a pseudo-random expert."""
    a = tl.arange(0, BA)
    am = a < A
    k = tl.arange(0, BP)
    km = k < P
    if SCORE:
        ids = tl.load(ids_ptr + a, mask=am, other=-2)
        pc = tl.load(pcand_ptr + k, mask=km, other=-1)
        pp = tl.load(pcopy_ptr + k, mask=km, other=-1)
        c_hit = tl.max(((pc[:, None] == ids[None, :]) & (pc[:, None] >= 0)).to(tl.int64), axis=1)
        p_hit = tl.max(((pp[:, None] == ids[None, :]) & (pp[:, None] >= 0)).to(tl.int64), axis=1)
        tl.store(score_ptr + 0, tl.load(score_ptr + 0) + tl.sum((pc >= 0).to(tl.int64), axis=0))
        tl.store(score_ptr + 1, tl.load(score_ptr + 1) + tl.sum(c_hit, axis=0))
        tl.store(score_ptr + 2, tl.load(score_ptr + 2) + tl.sum((pp >= 0).to(tl.int64), axis=0))
        tl.store(score_ptr + 3, tl.load(score_ptr + 3) + tl.sum(p_hit, axis=0))
    if PLAN:
        e = tl.arange(0, BE)
        me = e < E
        if ORACLE:
            row = tl.load(ostep_ptr) % n_rows
            truth = tl.load(otab_ptr + row * A + a, mask=am, other=0)
            h = (row * 2654435761 + a * 40503 + 12345) % 1000003                  # a cheap hash of (row, pick)
            keep = (h.to(tl.float32) / 1000003.0) < oracle_q
            sel = tl.where(keep, truth, ((h * 7919) % E).to(tl.int32))
        else:
            z = tl.load(logits_ptr + e, mask=me, other=float("-inf"))
            sel = tl.zeros([BA], dtype=tl.int32)
            for j in tl.static_range(A):
                mx = tl.max(z, axis=0)
                i = tl.min(tl.where(z == mx, e, BE), axis=0)
                sel = tl.where(a == j, i, sel)
                z = tl.where(e == i, float("-inf"), z)
        cold = am & (tl.load(mask_ptr + sel, mask=am, other=1) == 0)
        rank = tl.cumsum(cold.to(tl.int32), axis=0)
        pick = cold[None, :] & (rank[None, :] == k[:, None] + 1)                 # [BP, BA]
        cand = tl.sum(tl.where(pick, sel[None, :] + 1, 0), axis=1) - 1           # -1: none
        on = tl.load(on_ptr)
        copy = tl.where(on != 0, cand, -1)
        tl.store(cand_ptr + k, cand, mask=km)
        tl.store(copy_ptr + k, copy, mask=km)
        v1 = tl.load(o1 + e, mask=me, other=0)
        v2 = tl.load(o2 + e, mask=me, other=0)
        v3 = tl.load(o3 + e, mask=me, other=0)
        if SKIP:
            sk = tl.load(skip_ptr + e, mask=me, other=0)
        for j in tl.static_range(P):
            cj = tl.sum(tl.where(k == j, copy, 0), axis=0)
            v1 = tl.where(e == cj, tl.load(page_ptr + j), v1)
            v2 = tl.where(e == cj, tl.load(page_ptr + P + j), v2)
            v3 = tl.where(e == cj, tl.load(page_ptr + 2 * P + j), v3)
            if SKIP:
                sk = tl.where(e == cj, 0, sk)
        tl.store(s1 + e, v1, mask=me)
        tl.store(s2 + e, v2, mask=me)
        tl.store(s3 + e, v3, mask=me)
        if SKIP:
            tl.store(sskip_ptr + e, sk, mask=me)


@triton.jit
def _prefetch_copy(base_ptr, desc_ptr, copy_ptr, P: tl.constexpr, D: tl.constexpr, NIT: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program (k, j, b): words [b, b + 1) x NIT x BLOCK of projection j of copy k's expert, from host
    memory to its page. desc [3, D] int64, words from base_ptr: [cold stack, words per expert, pages]."""
    kk = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    e = tl.load(copy_ptr + kk).to(tl.int64)
    if e >= 0:
        W = tl.load(desc_ptr + j * D + 1)
        src = tl.load(desc_ptr + j * D) + e * W
        dst = tl.load(desc_ptr + j * D + 2 + kk)
        for it in range(NIT):
            offs = (b * NIT + it) * BLOCK + tl.arange(0, BLOCK)
            m = offs < W
            tl.store(base_ptr + dst + offs, tl.load(base_ptr + src + offs, mask=m, cache_modifier=".cg"), mask=m)


def predict_logits(h: torch.Tensor, norm_w: Optional[torch.Tensor], gate_w: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """out fp32 [E] = (h [1, H] * norm_w [H]) . gate_w[e]: the next layer's router on the residual stream,
    normed by its weight only (the RMS factor does not change the ranking)."""
    H, E = h.shape[-1], gate_w.shape[0]
    if h.numel() != H or out.numel() != E or out.dtype != torch.float32:
        raise ValueError(f"predict_logits: one row of {H} into fp32 [{E}], got {list(h.shape)} into "
                         f"{out.dtype} {list(out.shape)}")
    return router_logits(h.reshape(1, H), gate_w, out, norm_w)


def prefetch_plan(logits, mask, tables, steps, pages, skip, step_skip, cand, copy, on, ids, prev_cand,
                  prev_copy, score, top_k: int, plan: bool, oracle: Optional[tuple["UniformPicks", float]] = None) -> None:
    """Launch `_prefetch_plan` (one program). tables/steps: the next layer's three offset tables and
    their step copies (int64 [E]); pages int64 [3, P]; skip/step_skip uint8 [E] or None; cand/copy
    int32 [P] (the next layer's); ids int32 [1, A] and prev_cand/prev_copy int32 [P] (this layer's,
    None: nothing to score); score int64 [4]."""
    E, P = mask.numel(), cand.numel()
    score_it = ids is not None
    dummy = score
    t = oracle[0] if oracle is not None else None
    _prefetch_plan[(1,)](
        logits if plan else dummy, mask, *(tables if plan else (dummy,) * 3), *(steps if plan else (dummy,) * 3),
        pages if plan else dummy, skip if skip is not None else dummy, step_skip if step_skip is not None else dummy,
        cand, copy, on, ids if score_it else dummy, prev_cand if score_it else dummy,
        prev_copy if score_it else dummy, score, t.table if t is not None else dummy,
        t.step if t is not None else dummy, t.table.shape[0] if t is not None else 1,
        float(oracle[1]) if oracle is not None else 0.0,
        E=E, BE=triton.next_power_of_2(E), A=top_k, BA=triton.next_power_of_2(top_k), P=P,
        BP=max(2, triton.next_power_of_2(P)), PLAN=plan, SCORE=score_it, SKIP=skip is not None,
        ORACLE=oracle is not None, num_warps=4)


PREFETCH_BLOCKS = 16      # programs per projection and page of a prefetch copy


def prefetch_copy(base: torch.Tensor, desc: torch.Tensor, copy: torch.Tensor, words: int) -> None:
    """Copy each expert of `copy` (int32 [P], -1: none) from host memory into its VRAM page, reading it
    in place over PCIe; addresses in desc (int64 [3, 2 + P], words from base's address); `words`: the
    most words of one projection of an expert."""
    P, block = copy.numel(), 2048
    nit = triton.cdiv(triton.cdiv(words, PREFETCH_BLOCKS), block)
    _prefetch_copy[(P, 3, PREFETCH_BLOCKS)](base, desc, copy, P=P, D=desc.shape[1], NIT=nit, BLOCK=block,
                                            num_warps=4)
