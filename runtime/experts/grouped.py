"""The experts of many rows (prefill): the (token, expert) pairs sorted by expert into blocks of BM rows on the
device, then one program per (block, column block), tensor-core dots on dequantized tiles (`tl.dot`), each
chosen expert's weights read once per block of rows. Offloaded layers verify their rows here too
(layer.union_reads), so a cold expert several rows chose crosses PCIe once.

The sort is two launches over runs of the pairs, a program each (`align`): the counts of each run
(`_align_count`, pairs compared with every expert, a chunk at a time) and the padding; then in each run's
program the blocks per expert and their starts, each pair's rank among the earlier pairs of its expert (the
order of a stable sort) and each block's expert (`_align_place`). It replaced about twenty torch launches per
MoE layer and prefill chunk. Its first form was one program for all the pairs (+26% prefill at 512 tokens on
the H100, bench/results/cuda-qwen3-30b-a3b-{align,default2}-4.0bpw-20261205-*.json): a chunk of 2048 rows x 8
picks took its 128 chunks one after another on one multiprocessor, while the torch sort's launches hid behind
the experts' kernels; the 4096-token prefill was 0.79-0.89x the commit before it on the H200
(docs/engine-notes.md). bench.align_sort times the two forms and the torch sort.

The launch shape is Tuning.grouped (bm_small / bm_large rows per block below / from 4096 pairs, bn columns,
K tile, warps, stages), handed over by the layer. The input is read in the layer's order (`InputOrder`).
Letters: T tokens, A experts per token, P = T*A pairs, E experts, H hidden, I expert size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts, intermediate_aligned
from runtime.experts.shapes import tile
from runtime.experts.tiles import WALIGN, _dequant_tile
from runtime.tuning import Grouped


CHUNK = 128               # pairs compared with every expert at a time
SORT_PROGRAMS = 128       # most programs of the sort's two launches (about one per multiprocessor)


def align_blocks(P: int, num_experts: int, bm: int) -> int:
    """Blocks of bm rows that P pairs take at most, each expert's run padded to whole blocks (both aligns)."""
    return (P + min(num_experts, P) * (bm - 1)) // bm


def align_programs(P: int, most: int = SORT_PROGRAMS) -> tuple[int, int]:
    """(programs, span): the sort's launches cut the P pairs into runs of `span` (whole chunks of CHUNK), one a
    program, at most `most` programs: a prefill chunk of 2048 rows x 8 picks is 128 programs of one chunk each,
    where one program would take the 128 chunks one after another."""
    chunks = max(1, triton.cdiv(P, CHUNK))
    span = CHUNK * triton.cdiv(chunks, max(1, most))
    return triton.cdiv(max(P, 1), span), span


@triton.jit
def _align_count(ids_ptr, hist_ptr, pairs_ptr, P, R, SPAN, PSPAN, BE: tl.constexpr, CH: tl.constexpr):
    """Program c: hist[c] int32 [BE] = the pairs per expert of its run (pairs c*SPAN .. (c+1)*SPAN), and its
    share of pairs [R] (rows c*PSPAN .. (c+1)*PSPAN) set to padding (P), before `_align_place` stores pairs."""
    pid = tl.program_id(0)
    e = tl.arange(0, BE)
    c = tl.arange(0, CH)
    counts = tl.zeros([BE], dtype=tl.int32)
    for i in range(0, SPAN, CH):
        s = pid * SPAN + i
        ids = tl.load(ids_ptr + s + c, mask=s + c < P, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + pid * BE + e, counts)
    for i in range(0, PSPAN, CH):
        s = pid * PSPAN + i
        tl.store(pairs_ptr + s + c, tl.zeros([CH], dtype=tl.int32) + P, mask=s + c < R)


@triton.jit
def _align_place(ids_ptr, hist_ptr, pairs_ptr, bexp_ptr, P, NB, NP, SPAN, BSPAN, E: tl.constexpr,
                 BE: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr, BC: tl.constexpr, BB: tl.constexpr):
    """Program c of NP: from every run's counts (hist [NP, BE]), the blocks per expert and their starts and how
    many pairs of each expert the runs before c hold; then each pair of its run stored at its row (its rank
    among the earlier pairs of its expert: the order of a stable sort), and its share of the blocks' experts
    (bexp int32 [NB], -1: unused; blocks c*BSPAN .. (c+1)*BSPAN)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    r = tl.arange(0, BC)
    counts = tl.zeros([BE], dtype=tl.int32)
    seen = tl.zeros([BE], dtype=tl.int32)                       # pairs of each expert before this program's
    for j0 in range(0, NP, BC):
        j = j0 + r
        h = tl.load(hist_ptr + j[:, None] * BE + e[None, :], mask=(j < NP)[:, None], other=0)
        counts += tl.sum(h, axis=0)
        seen += tl.sum(h * (j < pid).to(tl.int32)[:, None], axis=0)
    nb = (counts + BM - 1) // BM                                # blocks per expert
    cum_nb = tl.cumsum(nb, axis=0)
    start = (cum_nb - nb) * BM                                  # each expert's first row
    c = tl.arange(0, CH)
    for i in range(0, SPAN, CH):
        s = pid * SPAN + i
        ids = tl.load(ids_ptr + s + c, mask=s + c < P, other=-1)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)         # [CH, BE]
        before = tl.cumsum(hit, axis=0) - hit                   # earlier pairs of the same expert in the chunk
        row = tl.sum(hit * (start[None, :] + seen[None, :] + before), axis=1)    # the pair's row: its expert's
        tl.store(pairs_ptr + row, s + c, mask=s + c < P)
        seen += tl.sum(hit, axis=0)
    b = tl.arange(0, BB)
    for i in range(0, BSPAN, BB):                               # each block's expert: cum_nb's first > block
        blk = pid * BSPAN + i + b
        owner = tl.sum((cum_nb[None, :] <= blk[:, None]).to(tl.int32) * em[None, :].to(tl.int32), axis=1)
        tl.store(bexp_ptr + blk, tl.where(owner < E, owner, -1), mask=blk < NB)


@triton.jit
def _gate_up_grouped(x_ptr, pairs_ptr, bexp_ptr, q1, o1, s1, p1, q3, o3, s3, p3, h_ptr, K: tl.constexpr,
                     N: tl.constexpr, A: tl.constexpr, P,
                     BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr, G3: tl.constexpr,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, XMODE: tl.constexpr = 0):
    """h[pair] = SiLU(x . gate) * (x . up) for one block of BM pairs of one expert, BN columns. XMODE: how x
    is read. 0: x [T, K], gathered through each projection's permutation per tile; 1: x already in the
    layer's one input order [T, K] (row = token); 2: x gathered per pair [P, K] (row = pair; gate and up
    share each expert's order). In 1 and 2 a tile is a contiguous run of each row, read once for both."""
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
            if XMODE == 0:
                i1 = tl.load(p1 + e * K + kk)
                xa = tl.load(x_ptr + t[:, None] * K + i1[None, :], mask=valid[:, None], other=0.0)
                i3 = tl.load(p3 + e * K + kk)
                xb = tl.load(x_ptr + t[:, None] * K + i3[None, :], mask=valid[:, None], other=0.0)
            elif XMODE == 1:
                xa = tl.load(x_ptr + t[:, None] * K + kk[None, :], mask=valid[:, None], other=0.0)
                xb = xa
            else:
                xa = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=valid[:, None], other=0.0)
                xb = xa
            w1 = _dequant_tile(q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN)
            acc1 = tl.dot(xa.to(tl.float16), w1.to(tl.float16), acc1)
            w3 = _dequant_tile(q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN)
            acc3 = tl.dot(xb.to(tl.float16), w3.to(tl.float16), acc3)
        h = acc1 / (1.0 + tl.exp(-acc1)) * acc3
        tl.store(h_ptr + rows[:, None] * N + offs_n[None, :], h.to(tl.float16),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_grouped(h_ptr, pairs_ptr, bexp_ptr, rw_ptr, q2, o2, s2, p2, y_ptr, K: tl.constexpr, N: tl.constexpr,
                  HS: tl.constexpr, P,
                  BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  BN: tl.constexpr, ORDERED: tl.constexpr = False):
    """y[pair] = rw[pair] * (h[pair] . down) for one block of BM pairs of one expert, BN columns. ORDERED:
    down's permutation is the identity (pack.align_intermediate), so h's tiles are read as runs."""
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
            if ORDERED:
                xa = tl.load(h_ptr + rows[:, None] * HS + kk[None, :], mask=valid[:, None], other=0.0)
            else:
                i2 = tl.load(p2 + e * K + kk)
                xa = tl.load(h_ptr + rows[:, None] * HS + i2[None, :], mask=valid[:, None], other=0.0)
            w = _dequant_tile(q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN)
            acc = tl.dot(xa, w.to(tl.float16), acc)
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
        tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], acc * rw[:, None],
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _gather_pairs(x_ptr, ids_ptr, perm_ptr, out_ptr, K: tl.constexpr, A: tl.constexpr, BK: tl.constexpr):
    """out[p, k] = x[p // A, perm[ids[p], k]]: each (token, expert) pair's input in its expert's order, for
    the grouped kernels' XMODE 2; grid (P, cdiv(K, BK))."""
    p = tl.program_id(0)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = kk < K
    e = tl.load(ids_ptr + p).to(tl.int64)
    idx = tl.load(perm_ptr + e * K + kk, mask=mask, other=0)
    v = tl.load(x_ptr + (p // A).to(tl.int64) * K + idx, mask=mask, other=0.0)
    tl.store(out_ptr + p.to(tl.int64) * K + kk, v, mask=mask)


def align(ids: torch.Tensor, num_experts: int, bm: int,
          most: int = SORT_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to whole blocks of bm rows, in two launches of up to
    `most` programs each (`align_programs`): ids int [P] -> (pairs int32 [B * bm], P = padding; block_expert
    int32 [B], -1 = unused block), B an upper bound that depends only on P (`align_blocks`), so no host
    synchronisation. most=1: one program does it all, as the sort's first kernel did (bench.align_sort)."""
    P = ids.numel()
    nblocks = align_blocks(P, num_experts, bm)
    ids = ids.to(torch.int32).contiguous()
    pairs = torch.empty(nblocks * bm, dtype=torch.int32, device=ids.device)
    bexp = torch.empty(nblocks, dtype=torch.int32, device=ids.device)
    programs, span = align_programs(P, most)
    BE = triton.next_power_of_2(num_experts)
    hist = torch.empty((programs, BE), dtype=torch.int32, device=ids.device)
    pspan = CHUNK * triton.cdiv(triton.cdiv(nblocks * bm, programs), CHUNK)
    bspan = 64 * triton.cdiv(triton.cdiv(nblocks, programs), 64)
    _align_count[(programs,)](ids, hist, pairs, P, nblocks * bm, span, pspan, BE=BE, CH=CHUNK, num_warps=8)
    _align_place[(programs,)](ids, hist, pairs, bexp, P, nblocks, programs, span, bspan, E=num_experts, BE=BE,
                              BM=bm, CH=CHUNK, BC=32, BB=64, num_warps=8)
    return pairs, bexp


def tile_span(*packs: PackedExperts, want: int) -> int:
    """K tile of the grouped kernels: `want` rows when that spans whole scale groups of every
    projection (powers of two, dividing K), else a tile of at most `want` rows within one group (shapes.tile)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    if pow2(want) and all(pow2(p.group) and want % p.group == 0 and p.in_features % want == 0 for p in packs):
        return want
    return tile(*packs, cap=want)


@dataclass(frozen=True)
class InputOrder:
    """How a layer's grouped kernels read their inputs, from its permutations (found once, `input_order`).

    shared: int64 [H]: every expert's gate and up take the input in this one order, as exllamav2's converter
    writes MoE layers (all of a layer's gate and up projections quantized with one Hessian): the input is
    permuted once per call. per_expert: gate and up of each expert share an order (not across experts, as
    our converter writes them): the input is gathered once per (token, expert) pair. Neither: each tile is
    gathered through each projection's permutation, again for every block of columns. ordered_down: down's
    permutation is the identity (pack.align_intermediate), so h is read in runs."""
    shared: Optional[torch.Tensor] = None
    per_expert: bool = False
    ordered_down: bool = False


def input_order(w1: PackedExperts, w3: PackedExperts, w2: PackedExperts) -> InputOrder:
    """The layer's InputOrder, compared on the device (one host synchronisation: at load, not per call)."""
    per_expert = w1.perm.shape == w3.perm.shape and bool(torch.equal(w1.perm, w3.perm))
    shared = None
    if per_expert and bool((w1.perm == w1.perm[:1]).all()):
        shared = w1.perm[0].long().contiguous()
    return InputOrder(shared, per_expert, intermediate_aligned(w2))


def experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                    w3: PackedExperts, w2: PackedExperts, order: Optional[InputOrder] = None,
                    grouped: Grouped = Grouped()) -> torch.Tensor:
    """x fp16 [T, H], ids int [T, A], weights fp32 [T, A] -> fp32 [T, H] (the weighted experts' sum). Stored
    column counts may be padded to 32 (padding dequantizes to 0): gate/up write I' >= I columns of h, down
    reads its first I; down's H' >= H columns are cut to H. order None: each tile gathered through its
    permutation."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    x = x.contiguous()
    ids_f = ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32).contiguous()
    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    y = torch.empty((P, H2), dtype=torch.float32, device=x.device)
    g = grouped
    bk1, bk2 = tile_span(w1, w3, want=g.bk), tile_span(w2, want=g.bk)
    bm, bn = (g.bm_large if P >= 4096 else g.bm_small), g.bn
    launch = dict(num_warps=g.warps, **({"num_stages": g.stages} if g.stages else {}))
    pairs, bexp = align(ids_f, w1.num_experts, bm)
    nb = bexp.numel()
    order = order or InputOrder()
    xin, xmode = x, 0
    if order.shared is not None:              # the input permuted once: contiguous tiles
        xin, xmode = x.index_select(1, order.shared), 1
    elif order.per_expert:                    # gathered once per pair, not once per column block
        xin, xmode = torch.empty((P, H), dtype=x.dtype, device=x.device), 2
        bkg = min(1024, triton.next_power_of_2(H))
        _gather_pairs[(P, triton.cdiv(H, bkg))](x, ids_f, w1.perm, xin, K=H, A=A, BK=bkg, num_warps=4)
    _gate_up_grouped[(nb, triton.cdiv(I1, bn))](
        xin, pairs, bexp, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, h,
        H, I1, A, P, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group,
        BM=bm, BK=bk1, BN=bn, XMODE=xmode, **launch)
    _down_grouped[(nb, triton.cdiv(H2, bn))](
        h, pairs, bexp, rw, w2.qweight, w2.woff, w2.scales, w2.perm, y, I2, H2, I1, P,
        BITS=w2.bits, G=w2.group, BM=bm, BK=bk2, BN=bn, ORDERED=order.ordered_down, **launch)
    return y.view(T, A, H2)[:, :, :H].sum(dim=1)
