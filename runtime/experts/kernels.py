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

import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts

GEMV_MAX_PAIRS = 64          # up to 8 tokens at top-8: the GEMV path


@triton.jit
def _dequant_tile(qw_ptr, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of expert e: float32 [BK, BN]."""
    PER: tl.constexpr = 32 // BITS
    rows_w = k0 // PER + tl.arange(0, BK // PER)
    base = e * (K // PER) * N
    words = tl.load(qw_ptr + base + rows_w[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
    shifts = tl.arange(0, PER) * BITS
    u = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)     # [BK/PER, PER, BN]
    u = tl.reshape(u, (BK, BN))
    s = tl.load(sc_ptr + e * (K // GROUP) * N + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)
    return (u - (1 << (BITS - 1))).to(tl.float32) * s.to(tl.float32)[None, :]


@triton.jit
def _gate_up_gemv(x_ptr, ids_ptr, q1, s1, p1, q3, s3, p3, h_ptr, K: tl.constexpr, N: tl.constexpr, A: tl.constexpr,
                  BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr, G3: tl.constexpr,
                  BK: tl.constexpr, BN: tl.constexpr):
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc1 = tl.zeros([BN], dtype=tl.float32)
    acc3 = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        x1 = tl.load(x_ptr + t * K + tl.load(p1 + e * K + kk)).to(tl.float32)
        w1 = _dequant_tile(q1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
        acc1 += tl.sum(x1[:, None] * w1, axis=0)
        x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + kk)).to(tl.float32)
        w3 = _dequant_tile(q3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
        acc3 += tl.sum(x3[:, None] * w3, axis=0)
    h = acc1 / (1.0 + tl.exp(-acc1)) * acc3
    tl.store(h_ptr + p * N + offs_n, h.to(tl.float16), mask=mask_n)


@triton.jit
def _down_gemv(h_ptr, ids_ptr, rw_ptr, q2, s2, p2, y_ptr, K: tl.constexpr, N: tl.constexpr, HS: tl.constexpr,
               BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        xh = tl.load(h_ptr + p * HS + tl.load(p2 + e * K + kk)).to(tl.float32)
        w = _dequant_tile(q2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
        acc += tl.sum(xh[:, None] * w, axis=0)
    rw = tl.load(rw_ptr + p)
    tl.store(y_ptr + p * N + offs_n, acc * rw, mask=mask_n)


@triton.jit
def _gate_up_grouped(x_ptr, pairs_ptr, bexp_ptr, q1, s1, p1, q3, s3, p3, h_ptr, K: tl.constexpr,
                     N: tl.constexpr, A: tl.constexpr, P,
                     BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr, G3: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
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
            w1 = _dequant_tile(q1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
            acc1 = tl.dot(xa.to(tl.float16), w1.to(tl.float16), acc1)
            i3 = tl.load(p3 + e * K + kk)
            xb = tl.load(x_ptr + t[:, None] * K + i3[None, :], mask=valid[:, None], other=0.0)
            w3 = _dequant_tile(q3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
            acc3 = tl.dot(xb.to(tl.float16), w3.to(tl.float16), acc3)
        h = acc1 / (1.0 + tl.exp(-acc1)) * acc3
        tl.store(h_ptr + rows[:, None] * N + offs_n[None, :], h.to(tl.float16),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_grouped(h_ptr, pairs_ptr, bexp_ptr, rw_ptr, q2, s2, p2, y_ptr, K: tl.constexpr, N: tl.constexpr,
                  HS: tl.constexpr, P,
                  BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  BN: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= 0:
        rows = tl.load(pairs_ptr + b * BM + tl.arange(0, BM))
        valid = rows < P
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            i2 = tl.load(p2 + e * K + kk)
            xa = tl.load(h_ptr + rows[:, None] * HS + i2[None, :], mask=valid[:, None], other=0.0)
            w = _dequant_tile(q2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
            acc = tl.dot(xa, w.to(tl.float16), acc)
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
        tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], acc * rw[:, None],
                 mask=valid[:, None] & mask_n[None, :])


def _bk(*packs: PackedExperts, cap: int = 64) -> int:
    """K tile: within one scale group, a whole number of words, at most `cap` rows."""
    bk = cap
    for p in packs:
        bk = min(bk, p.group)
    for p in packs:
        if p.group % bk or p.in_features % bk or bk % (32 // p.bits):
            raise ValueError(f"expert layout: group {p.group} / K {p.in_features} do not fit a K tile of {bk}")
    return bk


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to whole blocks of bm rows; all on the device.

    ids: int [P] expert of each pair. Returns (pairs int32 [B*bm], P = padding; block_expert int32 [B],
    -1 = unused block), B an upper bound that depends only on P, so no host synchronisation."""
    P = ids.numel()
    nblocks = (P + min(num_experts, P) * (bm - 1)) // bm
    ids = ids.long()
    counts = torch.bincount(ids, minlength=num_experts)                     # [E]
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
                    w3: PackedExperts, w2: PackedExperts) -> torch.Tensor:
    """x fp16 [T, H], ids int [T, A], weights fp32 [T, A] -> fp32 [T, H] (sum of weighted experts).

    Stored column counts may be padded to 32 (padding dequantizes to 0): gate/up write I' >= I
    columns of h, down reads its first I; down's H' >= H columns are cut to H."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    x = x.contiguous()
    ids_f = ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32).contiguous()
    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    y = torch.empty((P, H2), dtype=torch.float32, device=x.device)
    bk1, bk2 = _bk(w1, w3), _bk(w2)
    if P <= GEMV_MAX_PAIRS:
        bn = 32
        _gate_up_gemv[(P, triton.cdiv(I1, bn))](
            x, ids_f, w1.qweight, w1.scales, w1.perm, w3.qweight, w3.scales, w3.perm, h, H, I1, A,
            BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group, BK=bk1, BN=bn, num_warps=4)
        _down_gemv[(P, triton.cdiv(H2, bn))](
            h, ids_f, rw, w2.qweight, w2.scales, w2.perm, y, I2, H2, I1,
            BITS=w2.bits, G=w2.group, BK=bk2, BN=bn, num_warps=4)
    else:
        bm, bn = (64 if P >= 4096 else 16), 64
        pairs, bexp = align(ids_f, w1.num_experts, bm)
        nb = bexp.numel()
        _gate_up_grouped[(nb, triton.cdiv(I1, bn))](
            x, pairs, bexp, w1.qweight, w1.scales, w1.perm, w3.qweight, w3.scales, w3.perm, h,
            H, I1, A, P, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group,
            BM=bm, BK=bk1, BN=bn, num_warps=4)
        _down_grouped[(nb, triton.cdiv(H2, bn))](
            h, pairs, bexp, rw, w2.qweight, w2.scales, w2.perm, y, I2, H2, I1, P,
            BITS=w2.bits, G=w2.group, BM=bm, BK=bk2, BN=bn, num_warps=4)
    return y.view(T, A, H2)[:, :, :H].sum(dim=1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
