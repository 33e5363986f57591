"""The split-K GEMV for dense EXL2 linears (attention's o projection in the decode graphs; qkv_prologue.py
uses its row blocks), each packed as a single expert: `_linear_splitk` launched on 1..LINEAR_MAX_ROWS rows.

One launch per part of a fused projection, each program computing every row for its columns and K slice, so
the weights are read once per call. A part whose chosen shape cuts K in KSPLIT slices adds its slices into a
float32 workspace and counts them in a counter per column block; the slice that comes last stores the block
into the destination and leaves the workspace and the counter at zero again. So every part is one launch into
its destination (a decode graph's q, k and v; or, adding, the residual stream): no memset, no cast, no copy.
The workspace and the counters are shapes.workspace's. Where none fits during a capture, the parts that cut K
go into a zeroed float32 buffer by atomics and are cast after.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts
from runtime.experts.shapes import CHOSEN, SplitK, choose, ksplit, tile, workspace
from runtime.experts.tiles import _dequant_tile, last_slice, take_sums

LINEAR_MAX_ROWS = 9       # a decode step or a verify of up to 8 drafts
FMA_MAX_ROWS = 8          # the GEMV sums rows on the CUDA cores up to this many (more: the dot only)
FMA_MAX_TILE = 16384      # ... with at most this many products in a program's [rows, BK, BN] block


def linear_tile(p: PackedExperts) -> int:
    """K tile for one packed dense linear; ValueError when its layout fits none."""
    if p.num_experts != 1:
        raise ValueError(f"a dense linear is one packed expert, got {p.num_experts}")
    return tile(p, cap=128)


def linear_rows_block(T: int, c: SplitK) -> int:
    """The row block (BT) `_linear_splitk` runs T rows in under shape c: 1, 16 for the dot, else the
    power of two >= T."""
    return 1 if T == 1 else 16 if c.dot else 1 << (T - 1).bit_length()


def linear_candidates(K: int, N: int, bk: int, rows: int = 1, forced: Optional[tuple[int, int]] = None) -> list[SplitK]:
    """Launch shapes for one part (every row in each program, so the grid is cdiv(N, BN) x KSPLIT whatever
    the rows): the default first (what the interpreter and a capture use), then the shapes worth timing,
    KSPLIT 1 among them; at 2 to FMA_MAX_ROWS rows each also without the tensor-core dot (which pads a
    verify's few rows to 16); the timing keeps whichever is faster on this GPU. forced (BN, KSPLIT): that
    shape alone, where K takes it."""
    default = SplitK(64, ksplit(K, bk, triton.cdiv(N, 64)))
    if forced:
        bn, ks = forced
        return [SplitK(bn, ks) if K % (ks * bk) == 0 else default]
    out = [default]
    for bn in (16, 32, 64, 128):
        for ks in (1, 2, 4, 8):
            c, programs = SplitK(bn, ks), triton.cdiv(N, bn) * ks
            if K % (ks * bk) == 0 and (ks == 1 or 32 <= programs <= 2048) and c not in out:
                out.append(c)
    if 1 < rows <= FMA_MAX_ROWS:           # K whole or halved only: each shape is one more compilation at load
        fma = [SplitK(c.bn, c.ksplit, c.warps, dot=False) for c in out if c.ksplit <= 2]
        out += [c for c in fma if linear_rows_block(rows, c) * bk * c.bn <= FMA_MAX_TILE and c not in out]
    return out


def _launch(x: torch.Tensor, p: PackedExperts, bk: int, c: SplitK, dst: torch.Tensor,
            ws: Optional[tuple[torch.Tensor, torch.Tensor]], add: bool) -> None:
    """Part p of x into dst [T, n] (rows dst.stride(0) apart): stored (or added, `add`), in one launch; with
    ws None and K cut, added into dst (float32, zeroed by the caller)."""
    T, K = x.shape
    n_out = dst.shape[1]
    finish = c.ksplit > 1 and ws is not None
    _linear_splitk[(triton.cdiv(n_out, c.bn), c.ksplit)](
        x, p.qweight, p.scales, p.perm, dst, ws[0] if finish else dst, ws[1] if finish else dst, T, dst.stride(0), 0,
        K=K, N=p.out_features, NOUT=n_out, BITS=p.bits, G=p.group, BK=bk, BN=c.bn, BT=linear_rows_block(T, c),
        KSPLIT=c.ksplit, DOT=c.dot, ADD=add, FINISH=finish, num_warps=c.warps)


def linear_into(x: torch.Tensor, packs: Sequence[PackedExperts], dests: Sequence[torch.Tensor],
                add: bool = False, splitk: Optional[tuple[int, int]] = None) -> None:
    """Dense EXL2 linears (each packed as one expert, the same K) on few rows: part i of x fp16 [T, K] into
    dests[i] fp16 [T, n_i] (its first n_i columns; rows may lie further apart, as in a wider tensor), stored,
    or added to what dests hold (`add`: the residual). Shapes timed once per shape and row count on the
    GPU (`shapes.choose`, in a graph); splitk: one forced shape (Tuning.splitk). Nothing read on the host: capturable once the shapes are chosen."""
    T, K = x.shape
    if not 0 < T <= LINEAR_MAX_ROWS:
        raise ValueError(f"linear_into: {T} rows, the split-K GEMV takes 1..{LINEAR_MAX_ROWS}")
    if x.dtype != torch.float16:
        raise ValueError(f"linear_into: fp16 input expected, got {x.dtype}")
    if len(packs) != len(dests):
        raise ValueError(f"linear_into: {len(packs)} parts, {len(dests)} destinations")
    x = x.contiguous()
    for p, d in zip(packs, dests):
        if p.in_features != K or d.dim() != 2 or d.shape[0] != T or not 0 < d.shape[1] <= p.out_features \
                or d.dtype != torch.float16 or d.stride(1) != 1:
            raise ValueError(f"linear_into: part [K {p.in_features}, N {p.out_features}] into {d.dtype} "
                             f"{list(d.shape)} from {T} rows of {K}")
    ws = workspace(x.device, T * max(d.shape[1] for d in dests),
                   max(triton.cdiv(d.shape[1], 16) for d in dests))
    plan = []
    for p, d in zip(packs, dests):
        n_out, bk = d.shape[1], linear_tile(p)
        key = ("linear", K, p.out_features, n_out, T, p.bits, p.group, splitk, x.device)
        c = CHOSEN.get(key)
        if c is None:         # each shape timed alone, into a scratch output, as its launch runs in the step
            scratch = torch.empty((T, n_out), dtype=torch.float16, device=x.device)
            c = choose(key, linear_candidates(K, n_out, bk, T, splitk),
                                lambda c, p=p, bk=bk, s=scratch: _launch(x, p, bk, c, s, ws, False), graph=True)
        plan.append((p, d, bk, c))
    for p, d, bk, c in plan:
        if ws is not None or c.ksplit == 1:
            _launch(x, p, bk, c, d, ws, add)
        else:                                 # K cut during a capture without a workspace that fits
            acc = torch.zeros(d.shape, dtype=torch.float32, device=x.device)
            _launch(x, p, bk, c, acc, None, False)
            d.add_(acc) if add else d.copy_(acc)


@triton.jit
def _linear_splitk(x_ptr, q_ptr, s_ptr, p_ptr, out_ptr, ws_ptr, cnt_ptr, T, LDO, COL0, K: tl.constexpr,
                   N: tl.constexpr, NOUT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
                   BN: tl.constexpr, BT: tl.constexpr, KSPLIT: tl.constexpr, DOT: tl.constexpr = True,
                   ADD: tl.constexpr = False, FINISH: tl.constexpr = False):
    """One dense linear packed as a single expert (no routing weight, no SiLU): x fp16 [T, K] @ W for all
    T <= BT rows over one K slice, into columns COL0..COL0+NOUT of out [T, LDO] (NOUT <= N stored
    columns). Each weight tile is dequantized once for all rows: BT 1 a GEMV; DOT, BT 16 (rows padded) a
    tensor-core dot on the fp16 tile; not DOT, the rows' products summed in fp32 on the CUDA cores (BT a
    power of two >= T: no padding to 16 for a verify's few rows). KSPLIT 1 stores in out's dtype (ADD: added
    to what out holds). KSPLIT > 1: FINISH, the slices add into ws fp32 [T, NOUT] and count in cnt_ptr's
    entry of their column block; the last one stores the sum as KSPLIT 1 does and sets both back to zero
    (they start at zero); not FINISH, they add into out fp32 (zeroed by the caller). Grid (cdiv(NOUT, BN),
    KSPLIT)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mask_n = offs_n < NOUT
    offs_t = tl.arange(0, BT)
    mask_t = offs_t < T
    ks = tl.program_id(1) * (K // KSPLIT)
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        idx = tl.load(p_ptr + k0 + tl.arange(0, BK))
        xv = tl.load(x_ptr + offs_t[:, None] * K + idx[None, :], mask=mask_t[:, None], other=0.0)   # [BT, BK]
        w = _dequant_tile(q_ptr, 0, s_ptr, 0, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
        if BT == 1:
            x1 = tl.sum(xv.to(tl.float32), axis=0)                                   # the one row, [BK]
            acc += tl.sum(x1[:, None] * w, axis=0)[None, :]
        elif DOT:
            acc = tl.dot(xv.to(tl.float16), w.to(tl.float16), acc)
        else:
            acc += tl.sum(xv.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)      # [BT, BK, BN] -> [BT, BN]
    ptrs = out_ptr + offs_t[:, None] * LDO + COL0 + offs_n[None, :]
    mask = mask_t[:, None] & mask_n[None, :]
    if KSPLIT == 1:
        if ADD:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif FINISH:
        wptrs = ws_ptr + offs_t[:, None] * NOUT + offs_n[None, :]
        tl.atomic_add(wptrs, acc, mask=mask)
        if last_slice(cnt_ptr + tl.program_id(0), KSPLIT):
            total = take_sums(wptrs, acc, mask)
            if ADD:
                total += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tl.program_id(0), 0)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)
