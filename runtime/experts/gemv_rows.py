"""The split-K GEMVs' tile summed by rows of code words (MOEDESK_GEMV_SUMS=rows; triton_kernels.py calls it).

A K tile of an expert's codes is BK / per rows of int32 words (per = 32 / bits codes in each) by BN columns. The
default sums (`triton_kernels._tile_dot`) unpack it into a [BK, BN] tile (a reshape) and sum that across the
threads holding its rows: both move data between threads through shared memory, with barriers, every tile. Here
the words tile stays as loaded: code j of every word is one shift and mask, multiplied by the inputs of rows j,
j + per, j + 2 per, ... (loaded as a vector of their own), and accumulated into a [BK / per, BN] float32 tile,
summed over its rows once per K tile; the codes' offset and the tile's scale are then applied once per column,
as the column sums do. With BN = 128 x warps (the launch shapes `kernels._candidates(..., rows=True)` times)
each thread holds every row of its four columns, so that sum stays in the thread: compiled for sm_90 at
qwen3-30b-a3b's shape, gate/up 5.83 and down 8.32 instructions per 4-bit weight and no barrier, against 7.90 /
8.17 and 6.19 / 6.47 with 10-24 barriers a pass for the weight and column sums (runtime/experts/NOTES.md).
Codes of 4 and 8 bits; 3-bit ones (two bit planes) sum by columns. Any BN gives the same sums; only the
threads' share of the work changes.

The inputs of a tile come from one of two places (SRC): gate/up's x row through the expert's permutation, or
down's h = SiLU(gate) * up from the gate/up output (in runs where down's permutation is the identity, else
through it), rounded to fp16 as the other sums round it.
"""
import triton
import triton.language as tl


@triton.jit
def silu_h(gate_ptr, up_ptr, idx):
    """h = SiLU(gate) * up of the gate/up output's entries idx (a pair's gate and up rows), rounded to fp16 as
    the tensor-core path rounds it, as float32: down's input, for every way of summing a tile."""
    g = tl.load(gate_ptr + idx)
    u = tl.load(up_ptr + idx)
    return (g / (1.0 + tl.exp(-g)) * u).to(tl.float16).to(tl.float32)


@triton.jit
def _inputs(src_ptr, perm_ptr, row_off, up_off, e, kj, K: tl.constexpr, SRC: tl.constexpr,
            ORDERED: tl.constexpr):
    """The inputs of rows kj (packed order) as float32. SRC 0: x[row_off + perm[e, kj]] (gate/up); 1: h from
    the gate/up output, gate at row_off + idx and up at up_off + idx, idx = kj in runs (ORDERED) or
    perm[e, kj] (down)."""
    if ORDERED:
        idx = kj
    else:
        idx = tl.load(perm_ptr + e * K + kj)
    if SRC == 0:
        v = tl.load(src_ptr + row_off + idx).to(tl.float32)
    else:
        v = silu_h(src_ptr + row_off, src_ptr + up_off, idx)
    return v


@triton.jit
def rows_dot(src_ptr, perm_ptr, row_off, up_off, qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr,
             N: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
             SRC: tl.constexpr, ORDERED: tl.constexpr):
    """The inputs of rows k0..k0+BK (packed order; `_inputs`) times expert e's tile there: float32 [BN]. The
    tile lies within one scale group (BK <= GROUP, as the split-K GEMVs' tiles do); BITS 4 or 8."""
    tl.static_assert(BITS == 4 or BITS == 8, "rows of code words: 4 or 8 bits")
    tl.static_assert(BK <= GROUP, "one scale group per tile")
    PER: tl.constexpr = 32 // BITS
    R: tl.constexpr = BK // PER
    words = tl.load(qw_ptr + base + (k0 // PER + tl.arange(0, R))[:, None] * N + offs_n[None, :],
                    mask=mask_n[None, :], other=0).to(tl.uint32, bitcast=True)               # [R, BN]
    acc = tl.zeros([R, BN], dtype=tl.float32)
    vsum = tl.zeros([R], dtype=tl.float32)
    for j in tl.static_range(PER):
        v = _inputs(src_ptr, perm_ptr, row_off, up_off, e, k0 + tl.arange(0, R) * PER + j, K, SRC, ORDERED)
        acc += v[:, None] * ((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        vsum += v
    col = tl.sum(acc, axis=0) - (1 << (BITS - 1)) * tl.sum(vsum, axis=0)
    s = tl.load(sc_ptr + e * (K // GROUP) * N + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)
    return col * s.to(tl.float32)
