"""Attention's decode prologue in one launch: the input RMSNorm, the q/k/v projections through the split-K GEMV,
the q and k head norms (RMS) and RoPE (NEOX, the whole head rotated); the decode graphs' prologue wherever the
attention allows it (runtime/backends/exl2_gemv.py).

exllamav2's prologue (`q_attn_forward_1`) is seven launches (the norm, three GEMMs, two head norms, one RoPE).
Here one program per head of q, k and v and K slice (grid: heads x KSPLIT):
- each program sums the squares of its rows of x itself (a few KB, read from L2 by every program), then reads
  its K slice of the head's packed weights, x normalized on the fly through the part's permutation and
  rounded to fp16 as exllamav2's norm stores it;
- a head whose K is cut adds its slices into the split-K workspace of runtime/experts/shapes.py and
  counts them there; the slice that comes last takes the head whole, rounds it to fp16 as exllamav2's GEMM
  stores it, applies the head's RMSNorm (rounded again) and the rotation at positions pos[0] + t, stores it
  into q, k or v, and leaves the workspace and the counter at zero.
The rotation is summed in fp32 where exllamav2's runs in fp16: results differ in their last bits.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from runtime.experts.linear_gemv import FMA_MAX_ROWS, FMA_MAX_TILE, LINEAR_MAX_ROWS, linear_rows_block
from runtime.experts.pack import PackedExperts
from runtime.experts.shapes import CHOSEN, SplitK, choose, ksplit, tile, workspace
from runtime.experts.tiles import _dequant_tile, last_slice, take_sums

XB = 256            # columns of x per step of the programs' sums of squares


@triton.jit
def _slice_sum(x_ptr, nw_ptr, r, q_ptr, s_ptr, p_ptr, col0, offs_t, mask_t, ks, K: tl.constexpr, N: tl.constexpr,
               BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
               KSPLIT: tl.constexpr, DOT: tl.constexpr):
    """One head's D columns (from col0) of one part over the K slice from ks: fp32 [BT, D], x normalized
    (x * w * r, rounded to fp16) on the way in."""
    offs_n = col0 + tl.arange(0, D)
    mask_n = offs_n < N
    acc = tl.zeros([BT, D], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        idx = tl.load(p_ptr + k0 + tl.arange(0, BK))
        xv = tl.load(x_ptr + offs_t[:, None] * K + idx[None, :], mask=mask_t[:, None], other=0.0).to(tl.float32)
        xn = (xv * tl.load(nw_ptr + idx).to(tl.float32)[None, :] * r[:, None]).to(tl.float16)      # [BT, BK]
        w = _dequant_tile(q_ptr, 0, s_ptr, 0, k0, offs_n, mask_n, K, N, BITS, G, BK, D)
        if BT == 1:
            x1 = tl.sum(xn.to(tl.float32), axis=0)                                   # the one row, [BK]
            acc += tl.sum(x1[:, None] * w, axis=0)[None, :]
        elif DOT:
            acc = tl.dot(xn, w.to(tl.float16), acc)
        else:
            acc += tl.sum(xn.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def _store_head(y, offs_t, mask_t, hn_ptr, hns, heps, sin_ptr, cos_ptr, pos_ptr, out_ptr, LDO, head,
                D: tl.constexpr, BT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr):
    """A finished head y fp32 [BT, D]: rounded as exllamav2's GEMM stores it, then (NORM) its RMSNorm by
    the head's weights (hns apart: 0, one row for every head) and (ROPE) the NEOX rotation at positions
    pos[0] + t, stored into out's rows (LDO apart)."""
    cols = tl.arange(0, D)
    y = y.to(tl.float16).to(tl.float32)
    if NORM:
        hr = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + heps)
        w = tl.load(hn_ptr + head * hns + cols).to(tl.float32)
        y = (y * w[None, :] * hr[:, None]).to(tl.float16).to(tl.float32)
    if ROPE:
        HALF: tl.constexpr = D // 2
        pos = tl.load(pos_ptr) + offs_t
        at = pos[:, None] * D + (cols % HALF)[None, :]                      # exllamav2: both halves at col % half
        c = tl.load(cos_ptr + at, mask=mask_t[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + at, mask=mask_t[:, None], other=0.0).to(tl.float32)
        lo, hi = tl.split(tl.permute(tl.reshape(y, (BT, 2, HALF)), (0, 2, 1)))     # the halves, [BT, HALF] each
        other = tl.reshape(tl.permute(tl.join(hi, lo), (0, 2, 1)), (BT, D))      # each column's partner
        y = y * c + tl.where(cols < HALF, -1.0, 1.0)[None, :] * other * s
    tl.store(out_ptr + offs_t[:, None] * LDO + head * D + cols[None, :], y.to(tl.float16), mask=mask_t[:, None])


@triton.jit
def _finish(acc, hb, offs_t, mask_t, ws_ptr, cnt_ptr, hn_ptr, hns, heps, sin_ptr, cos_ptr, pos_ptr, out_ptr, LDO, head,
            NT: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, KSPLIT: tl.constexpr, NORM: tl.constexpr,
            ROPE: tl.constexpr):
    """This slice's sums of head block hb: stored when K is whole; else added into the workspace, and the last
    slice stores the head (tiles.last_slice, take_sums)."""
    if KSPLIT == 1:
        _store_head(acc, offs_t, mask_t, hn_ptr, hns, heps, sin_ptr, cos_ptr, pos_ptr, out_ptr, LDO, head, D, BT,
                    NORM, ROPE)
    else:
        wptrs = ws_ptr + offs_t[:, None] * (NT * D) + hb * D + tl.arange(0, D)[None, :]
        mask = mask_t[:, None] & (tl.arange(0, D) < D)[None, :]
        tl.atomic_add(wptrs, acc, mask=mask)
        if last_slice(cnt_ptr + hb, KSPLIT):
            total = tl.where(mask, take_sums(wptrs, acc, mask), 0.0)      # rows past T: nothing defined was read
            _store_head(total, offs_t, mask_t, hn_ptr, hns, heps, sin_ptr, cos_ptr, pos_ptr, out_ptr, LDO, head, D,
                        BT, NORM, ROPE)
            tl.store(cnt_ptr + hb, 0)


@triton.jit
def _qkv_prologue(x_ptr, nw_ptr, eps, q1, s1, p1, q2, s2, p2, q3, s3, p3, qn_ptr, kn_ptr, qns, kns, qeps, keps,
                  sin_ptr, cos_ptr, pos_ptr, qo_ptr, ko_ptr, vo_ptr, ws_ptr, cnt_ptr, T,
                  K: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                  N1: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr, N2: tl.constexpr, BITS2: tl.constexpr,
                  G2: tl.constexpr, N3: tl.constexpr, BITS3: tl.constexpr, G3: tl.constexpr, BK: tl.constexpr,
                  BT: tl.constexpr, KSPLIT: tl.constexpr, DOT: tl.constexpr, HEADNORM: tl.constexpr,
                  ROPE: tl.constexpr, XB: tl.constexpr):
    """x fp16 [T, K] (the residual) -> q [T, HQ*D], k and v [T, HK*D] fp16 (rows contiguous): see the module
    docstring. Parts i = 1, 2, 3 (q, k, v) packed as single experts (codes q_i, scales s_i, permutation p_i,
    N_i stored columns). nw: the input norm's weights (eps); qn, kn: the head norms' (HEADNORM; a head's row
    qns / kns apart, 0: one row for all); sin, cos:
    fp16 tables of rows of D (ROPE); pos int32 [1]. Grid (HQ + 2 HK, KSPLIT)."""
    NT: tl.constexpr = HQ + 2 * HK
    hb = tl.program_id(0)
    offs_t = tl.arange(0, BT)
    mask_t = offs_t < T
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, XB):
        xs = tl.load(x_ptr + offs_t[:, None] * K + k0 + tl.arange(0, XB)[None, :], mask=mask_t[:, None],
                     other=0.0).to(tl.float32)
        ss += tl.sum(xs * xs, axis=1)
    r = 1.0 / tl.sqrt(ss / K + eps)
    ks = tl.program_id(1) * (K // KSPLIT)
    if hb < HQ:
        acc = _slice_sum(x_ptr, nw_ptr, r, q1, s1, p1, hb * D, offs_t, mask_t, ks, K, N1, BITS1, G1, BK, D, BT,
                         KSPLIT, DOT)
        _finish(acc, hb, offs_t, mask_t, ws_ptr, cnt_ptr, qn_ptr, qns, qeps, sin_ptr, cos_ptr, pos_ptr, qo_ptr, HQ * D,
                hb, NT, D, BT, KSPLIT, HEADNORM, ROPE)
    elif hb < HQ + HK:
        acc = _slice_sum(x_ptr, nw_ptr, r, q2, s2, p2, (hb - HQ) * D, offs_t, mask_t, ks, K, N2, BITS2, G2, BK, D,
                         BT, KSPLIT, DOT)
        _finish(acc, hb, offs_t, mask_t, ws_ptr, cnt_ptr, kn_ptr, kns, keps, sin_ptr, cos_ptr, pos_ptr, ko_ptr, HK * D,
                hb - HQ, NT, D, BT, KSPLIT, HEADNORM, ROPE)
    else:
        acc = _slice_sum(x_ptr, nw_ptr, r, q3, s3, p3, (hb - HQ - HK) * D, offs_t, mask_t, ks, K, N3, BITS3, G3,
                         BK, D, BT, KSPLIT, DOT)
        _finish(acc, hb, offs_t, mask_t, ws_ptr, cnt_ptr, kn_ptr, kns, keps, sin_ptr, cos_ptr, pos_ptr, vo_ptr, HK * D,
                hb - HQ - HK, NT, D, BT, KSPLIT, False, False)


def candidates(K: int, heads: int, bk: int, D: int, rows: int = 1) -> list[SplitK]:
    """Launch shapes for `heads` head blocks of D columns (bn is D): the default first (the interpreter's and a
    capture's), then K whole or cut in 2, 4, 8 whole tiles, at 4 and 8 warps; at 2 to FMA_MAX_ROWS rows also
    without the tensor-core dot where the [rows, BK, D] block is small enough."""
    out = [SplitK(D, ksplit(K, bk, heads))]
    for ks in (1, 2, 4, 8):
        for warps in (4, 8):
            c = SplitK(D, ks, warps)
            if K % (ks * bk) == 0 and c not in out:
                out.append(c)
    if 1 < rows <= FMA_MAX_ROWS:
        fma = [SplitK(D, c.ksplit, c.warps, dot=False) for c in out]
        out += [c for c in fma if linear_rows_block(rows, c) * bk * D <= FMA_MAX_TILE and c not in out]
    return out


def _check(x: torch.Tensor, norm_w: torch.Tensor, packs: Sequence[PackedExperts], heads: tuple[int, int, int],
           outs: Sequence[torch.Tensor], head_w, tables) -> None:
    T, K = x.shape
    Hq, Hk, D = heads
    if not 0 < T <= LINEAR_MAX_ROWS or x.dtype != torch.float16 or not x.is_contiguous():
        raise ValueError(f"qkv_prologue: x fp16 [1..{LINEAR_MAX_ROWS}, K] contiguous, got {x.dtype} {list(x.shape)}")
    if D < 16 or D & (D - 1) or K % XB:
        raise ValueError(f"qkv_prologue: head size {D} (a power of two from 16) and hidden size {K} (a multiple "
                         f"of {XB}) not taken")
    if norm_w.shape != (K,):
        raise ValueError(f"qkv_prologue: input norm of {list(norm_w.shape)} weights for hidden size {K}")
    if len(packs) != 3 or len(outs) != 3:
        raise ValueError(f"qkv_prologue: q, k and v, got {len(packs)} parts and {len(outs)} destinations")
    for name, p, o, h in zip("qkv", packs, outs, (Hq, Hk, Hk)):
        if p.num_experts != 1 or p.in_features != K or p.out_features < h * D:
            raise ValueError(f"qkv_prologue: part {name} [K {p.in_features}, N {p.out_features}] for {h} heads of "
                             f"{D} from {K} inputs")
        if o.dtype != torch.float16 or tuple(o.shape) != (T, h * D) or not o.is_contiguous():
            raise ValueError(f"qkv_prologue: {name} fp16 [{T}, {h * D}] contiguous, got {o.dtype} {list(o.shape)}")
    if head_w is not None and any(tuple(w.shape) not in ((D,), (h, D)) or w.stride(-1) != 1 or w.dim() == 2
                                  and w.stride(0) != D for w, h in zip(head_w, (Hq, Hk))):
        raise ValueError(f"qkv_prologue: head norms of {[list(w.shape) for w in head_w]} weights for {Hq} and {Hk} "
                         f"heads of {D} (one row for all, or one for each, rows contiguous)")
    if tables is not None:
        sin, cos, pos = tables
        if sin.shape[-1] != D or cos.shape != sin.shape or not sin.is_contiguous() or not cos.is_contiguous() \
                or pos.dtype != torch.int32 or pos.numel() < 1:
            raise ValueError(f"qkv_prologue: RoPE tables of rows of {D} (got {list(sin.shape)}, {list(cos.shape)}) "
                             f"and an int32 position (got {pos.dtype})")


def qkv_prologue(x: torch.Tensor, norm_w: torch.Tensor, eps: float, packs: Sequence[PackedExperts],
                 heads: tuple[int, int, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 head_w: Optional[tuple[torch.Tensor, torch.Tensor]] = None, head_eps: tuple[float, float] = (0., 0.),
                 tables: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> None:
    """x fp16 [T, K] (1..9 rows; the residual, unchanged) -> q [T, Hq*D], k, v [T, Hk*D]: RMSNorm by norm_w,
    the projections packs = (q, k, v) (heads = (Hq, Hk, D)), the head norms head_w = (q's, k's: [D], or
    [heads, D] as exllamav2 holds them) with their eps, and the NEOX rotation by tables = (sin, cos, pos):
    sin and cos fp16 [.., S, D], the first row's position pos int32 [1] on the device. One launch; the shape
    timed once per shape and row count on the GPU (in a graph, shapes.choose). Nothing read on the host:
    capturable once the shape is chosen."""
    _check(x, norm_w, packs, heads, (q, k, v), head_w, tables)
    T, K = x.shape
    Hq, Hk, D = heads
    NT = Hq + 2 * Hk
    bk = tile(*packs, cap=128)
    ws = workspace(x.device, T * NT * D, NT)
    hn = head_w if head_w is not None else (norm_w, norm_w)                  # not read without HEADNORM
    strides = [D if w.dim() == 2 else 0 for w in hn]
    sin, cos, pos = tables if tables is not None else (norm_w, norm_w, norm_w)      # not read without ROPE

    def launch(c: SplitK, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        c = c if ws is not None or c.ksplit == 1 else SplitK(D, 1, c.warps, c.dot)   # no workspace in a capture
        w, n = ws if ws is not None else (q, q)                                       # (unread with K whole)
        p1, p2, p3 = packs
        _qkv_prologue[(NT, c.ksplit)](
            x, norm_w, float(eps), p1.qweight, p1.scales, p1.perm, p2.qweight, p2.scales, p2.perm, p3.qweight,
            p3.scales, p3.perm, hn[0], hn[1], *strides, float(head_eps[0]), float(head_eps[1]), sin, cos, pos, q, k,
            v, w, n,
            T, K=K, HQ=Hq, HK=Hk, D=D, N1=p1.out_features, BITS1=p1.bits, G1=p1.group, N2=p2.out_features,
            BITS2=p2.bits, G2=p2.group, N3=p3.out_features, BITS3=p3.bits, G3=p3.group, BK=bk,
            BT=linear_rows_block(T, c), KSPLIT=c.ksplit, DOT=c.dot, HEADNORM=head_w is not None,
            ROPE=tables is not None, XB=XB, num_warps=c.warps)

    key = ("qkv", K, Hq, Hk, D, T, tuple((p.out_features, p.bits, p.group) for p in packs), head_w is not None,
           tables is not None, x.device)
    c = CHOSEN.get(key)
    if c is None:           # timed into scratch outputs, as its launch runs in the step
        scratch = [torch.empty_like(t) for t in (q, k, v)]
        c = choose(key, candidates(K, NT, bk, D, T), lambda c: launch(c, *scratch), graph=True)
    launch(c, q, k, v)
