"""The Triton sources of the fused expert kernels; runtime/experts/kernels.py launches them.

Letters as there: T tokens (rows), A = top-k experts per token, P = T*A (token, expert) pairs, E experts,
H hidden size, I expert (intermediate) size, K/N a kernel's input/output features. Each kernel reads
the expert indices on the device, so a decode step can be captured in a CUDA graph:
- grouped (prefill): `_gate_up_grouped`, `_down_grouped` (pairs sorted by expert into blocks of BM rows),
  `_gather_pairs` (their input in each expert's order);
- split-K GEMVs (decode, verify): `_gate_up_splitk`, `_down_splitk`, with a skip mask and a CPU cut;
  `_linear_splitk`, one dense linear packed as a single expert (attention's q/k/v/o);
- routing: `_router_logits`, `_softmax_topk`;
- the CPU path's device side: `_cpu_share_mask`, `_cpu_inputs`, `_add_from_host`;
- decode prefetch: `_prefetch_plan`, `_prefetch_copy`.
"""
import triton
import triton.language as tl

from runtime.experts.gemv_rows import rows_dot, silu_h

# Every entry of an expert offset table (PackedExperts.woff) is a multiple of this many int32 words
# (runtime/experts/offload.py checks it), so the code loads stay 128-bit vectors.
WALIGN: tl.constexpr = tl.constexpr(16)
@triton.jit
def _codes_tile(qw_ptr, base, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of an expert's codes: int32 [BK, BN], 0 .. 2^BITS - 1.
    They start `base` int32 words after qw_ptr (the expert's entry in the offset table: a VRAM slot or host
    memory)."""
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
    return u


@triton.jit
def _scale_row(sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr):
    """Expert e's scales of the group holding row k0, columns offs_n: float16 [BN]."""
    return tl.load(sc_ptr + e * (K // GROUP) * N + (k0 // GROUP) * N + offs_n, mask=mask_n, other=0.0)


@triton.jit
def _dequant_tile(qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (packed order) x columns offs_n of expert e, centred and scaled: float32 [BK, BN]
    (`_codes_tile`). A tile lies within one scale group (GROUP a multiple of BK) or spans whole groups (BK
    a multiple of GROUP, both powers of two)."""
    u = _codes_tile(qw_ptr, base, k0, offs_n, mask_n, K, N, BITS, BK, BN)
    if BK > GROUP:                              # several scale groups in the tile (grouped kernels)
        NG: tl.constexpr = BK // GROUP
        g_rows = k0 // GROUP + tl.arange(0, NG)
        s = tl.load(sc_ptr + e * (K // GROUP) * N + g_rows[:, None] * N + offs_n[None, :],
                    mask=mask_n[None, :], other=0.0)
        w = tl.reshape((u - (1 << (BITS - 1))).to(tl.float32), (NG, GROUP, BN)) * s.to(tl.float32)[:, None, :]
        return tl.reshape(w, (BK, BN))
    s = _scale_row(sc_ptr, e, k0, offs_n, mask_n, K, N, GROUP)
    return (u - (1 << (BITS - 1))).to(tl.float32) * s.to(tl.float32)[None, :]


@triton.jit
def _tile_dot(v, qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, COLUMNS: tl.constexpr):
    """v float32 [BK] times the tile of rows k0..k0+BK: float32 [BN]. COLUMNS: the tile lies within one scale
    group (BK <= GROUP, as the split-K GEMVs' tiles do), so its scale and the codes' offset 2^(BITS-1) are
    applied once to each column's sum, sum(v * u) - 2^(BITS-1) * sum(v), instead of to every weight; the sums
    differ from the other order's in their last bits only."""
    if COLUMNS:
        tl.static_assert(BK <= GROUP, "one scale group per tile")
        u = _codes_tile(qw_ptr, base, k0, offs_n, mask_n, K, N, BITS, BK, BN).to(tl.float32)
        col = tl.sum(v[:, None] * u, axis=0) - (1 << (BITS - 1)) * tl.sum(v, axis=0)
        return col * _scale_row(sc_ptr, e, k0, offs_n, mask_n, K, N, GROUP).to(tl.float32)
    w = _dequant_tile(qw_ptr, base, sc_ptr, e, k0, offs_n, mask_n, K, N, BITS, GROUP, BK, BN)
    return tl.sum(v[:, None] * w, axis=0)


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
def _select_topk(logits_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr, step_ptr, N, t, E: tl.constexpr,
                 BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr, RENORM: tl.constexpr, FORCED: tl.constexpr,
                 VOLATILE: tl.constexpr):
    """Row t: softmax over E, the A largest (ties: lowest index first), renormalised; counts chosen experts.
    FORCED (benchmarks; kernels.topk_outputs): the same work, then the picks replaced by a row of the N rows
    of `table` (A distinct experts each), weights 1 / A. FORCED 1, a launch of one row: the row at the
    counter *step_ptr, moved on by an atomic (a decode step's graph has no launch for it); 2, several rows:
    row t takes the row at counter + t, whatever order the programs run in, and the launcher moves the
    counter past the launch's rows after it.
    VOLATILE: the logits were written by other programs of this launch (read past the L1 cache)."""
    offs_e = tl.arange(0, BE)
    mask_e = offs_e < E
    z = tl.load(logits_ptr + t * E + offs_e, mask=mask_e, other=float("-inf"), volatile=VOLATILE)
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
        if FORCED == 1:
            row = tl.atomic_add(step_ptr, 1) % N
        else:
            row = (tl.load(step_ptr) + t) % N
        sel_i = tl.load(table_ptr + row * A + offs_a, mask=mask_a, other=0)
        sel_w = tl.where(mask_a, 1.0 / A, 0.0)
    tl.store(ids_ptr + t * A + offs_a, sel_i, mask=mask_a)
    tl.store(rw_ptr + t * A + offs_a, sel_w, mask=mask_a)
    tl.atomic_add(cnt_ptr + sel_i, tl.full([BA], 1, tl.int32), mask=mask_a)


@triton.jit
def _softmax_topk(logits_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr, step_ptr, N, E: tl.constexpr,
                  BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr, RENORM: tl.constexpr,
                  FORCED: tl.constexpr):
    """_select_topk for row program_id(0); grid (T,)."""
    _select_topk(logits_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr, step_ptr, N, tl.program_id(0), E, BE, A, BA,
                 RENORM, FORCED, False)


@triton.jit
def _route_normed(x_ptr, nw_ptr, eps, xn_ptr, w_ptr, logits_ptr, done_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr,
                  step_ptr, N, H: tl.constexpr, E: tl.constexpr, EB: tl.constexpr, BH: tl.constexpr,
                  BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr, RENORM: tl.constexpr, FORCED: tl.constexpr):
    """RMSNorm, router and top-k of a row in one launch; grid (T, E / EB). Every program normalises its row
    as exllamav2's rms_norm does (x clamped to fp16's range, x * w * rsqrt(mean(x^2) + eps), rounded to fp16);
    program 0 writes it to xn for the experts; each program stores its EB logits of the normed row; the
    row's last program to finish (a counter per row in done, set back to 0 for the next launch) picks."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = x_ptr + t.to(tl.int64) * H
    ss = tl.zeros([BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        xv = tl.load(row + h0 + tl.arange(0, BH)).to(tl.float32)
        xv = tl.minimum(tl.maximum(xv, -65504.0), 65504.0)
        ss += xv * xv
    inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
    offs_e = j * EB + tl.arange(0, EB)
    mask_e = offs_e < E
    acc = tl.zeros([EB], dtype=tl.float32)
    for h0 in range(0, H, BH):
        offs_h = h0 + tl.arange(0, BH)
        xv = tl.load(row + offs_h).to(tl.float32)
        xv = tl.minimum(tl.maximum(xv, -65504.0), 65504.0)
        xn = (xv * tl.load(nw_ptr + offs_h).to(tl.float32) * inv).to(tl.float16)
        tl.store(xn_ptr + t.to(tl.int64) * H + offs_h, xn, mask=(offs_h * 0 + j) == 0)   # program 0 only
        wv = tl.load(w_ptr + offs_e[:, None] * H + offs_h[None, :], mask=mask_e[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xn.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + t * E + offs_e, acc, mask=mask_e)
    tl.debug_barrier()                              # every thread's logits stored before the counter moves
    done = tl.atomic_add(done_ptr + t, 1)          # acq_rel: the last program sees the others' logits
    if done == tl.num_programs(1) - 1:
        tl.store(done_ptr + t, 0)
        _select_topk(logits_ptr, ids_ptr, rw_ptr, cnt_ptr, table_ptr, step_ptr, N, t, E, BE, A, BA, RENORM, FORCED,
                     True)


@triton.jit
def _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, lo, K: tl.constexpr,
                         N: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr, BITS3: tl.constexpr,
                         G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr,
                         COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    wb1 = tl.multiple_of(tl.load(o1 + e), WALIGN)                                       # codes: offset table
    wb3 = tl.multiple_of(tl.load(o3 + e), WALIGN)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = (offs_n < N) & (offs_n >= lo)          # columns below lo: the CPU's (masked lanes read nothing)
    ks = tl.program_id(2) * (K // KSPLIT)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    acc3 = tl.zeros([BN], dtype=tl.float32)
    for kk in range(0, K // KSPLIT, BK):
        k0 = ks + kk
        if ROWS:                                                  # gemv_rows.py
            acc1 += rows_dot(x_ptr, p1, t * K, 0, q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN,
                             0, False)
            acc3 += rows_dot(x_ptr, p3, t * K, 0, q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN,
                             0, False)
        else:
            rows = k0 + tl.arange(0, BK)
            x1 = tl.load(x_ptr + t * K + tl.load(p1 + e * K + rows)).to(tl.float32)
            acc1 += _tile_dot(x1, q1, wb1, s1, e, k0, offs_n, mask_n, K, N, BITS1, G1, BK, BN, COLUMNS)
            x3 = tl.load(x_ptr + t * K + tl.load(p3 + e * K + rows)).to(tl.float32)
            acc3 += _tile_dot(x3, q3, wb3, s3, e, k0, offs_n, mask_n, K, N, BITS3, G3, BK, BN, COLUMNS)
    tl.atomic_add(gu_ptr + p * N + offs_n, acc1, mask=mask_n)
    tl.atomic_add(gu_ptr + P * N + p * N + offs_n, acc3, mask=mask_n)


@triton.jit
def _gate_up_splitk(x_ptr, ids_ptr, skip_ptr, cut_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P,
                    K: tl.constexpr, N: tl.constexpr, A: tl.constexpr, BITS1: tl.constexpr, G1: tl.constexpr,
                    BITS3: tl.constexpr, G3: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                    KSPLIT: tl.constexpr, SKIP: tl.constexpr, COLUMNS: tl.constexpr = False,
                    ROWS: tl.constexpr = False):
    """Partial gate and up sums over one K slice, added into gu fp32 [2, P, N] (zeroed by the caller).
    SKIP: a pair whose expert has skip_ptr[e] != 0 (uint8 [E]) leaves its first cut_ptr[0] columns
    (int32 [1]) to the CPU path, which computes them elsewhere: a cut of N or more leaves the whole
    expert. Without SKIP, skip_ptr and cut_ptr are not read. COLUMNS: see _tile_dot; ROWS: gemv_rows.py."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    if SKIP:
        lo = tl.where(tl.load(skip_ptr + e) != 0, tl.load(cut_ptr), 0)
        if lo < (tl.program_id(1) + 1) * BN:
            _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, lo, K, N,
                                 BITS1, G1, BITS3, G3, BK, BN, KSPLIT, COLUMNS, ROWS)
    else:
        _gate_up_splitk_body(x_ptr, q1, o1, s1, p1, q3, o3, s3, p3, gu_ptr, P, p, t, e, 0, K, N,
                             BITS1, G1, BITS3, G3, BK, BN, KSPLIT, COLUMNS, ROWS)


@triton.jit
def _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, k0, offs_n, mask_n, K: tl.constexpr, N: tl.constexpr,
               HS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
               ORDERED: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    if ROWS:                            # gemv_rows.py: h of rows j, j + per, ... as each code row needs it
        return acc + rows_dot(gu_ptr, p2, p * HS, P * HS + p * HS, q2, wb2, s2, e, k0, offs_n, mask_n, K, N,
                              BITS, G, BK, BN, 1, ORDERED)
    if ORDERED:                         # down's permutation is the identity: gate/up's columns in runs
        idx = k0 + tl.arange(0, BK)
    else:
        idx = tl.load(p2 + e * K + k0 + tl.arange(0, BK))
    h = silu_h(gu_ptr + p * HS, gu_ptr + P * HS + p * HS, idx)
    return acc + _tile_dot(h, q2, wb2, s2, e, k0, offs_n, mask_n, K, N, BITS, G, BK, BN, COLUMNS)


@triton.jit
def _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K: tl.constexpr,
                      N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                      BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr, CUT: tl.constexpr,
                      ORDERED: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    wb2 = tl.multiple_of(tl.load(o2 + e), WALIGN)                                       # codes: offset table
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    ks = tl.program_id(2) * (K // KSPLIT)
    for kk in range(0, K // KSPLIT, BK):
        if CUT:          # tiles below k_start (known at run time) are the CPU's
            if ks + kk >= k_start:
                acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                                 BITS, G, BK, BN, ORDERED, COLUMNS, ROWS)
        else:
            acc = _down_tile(acc, gu_ptr, q2, wb2, s2, p2, P, p, e, ks + kk, offs_n, mask_n, K, N, HS,
                             BITS, G, BK, BN, ORDERED, COLUMNS, ROWS)
    rw = tl.load(rw_ptr + p)
    tl.atomic_add(out_ptr + t * NOUT + offs_n, acc * rw, mask=offs_n < NOUT)


@triton.jit
def _down_splitk(gu_ptr, ids_ptr, skip_ptr, cut_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, K: tl.constexpr,
                 N: tl.constexpr, HS: tl.constexpr, NOUT: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, KSPLIT: tl.constexpr,
                 SKIP: tl.constexpr, ORDERED: tl.constexpr = False, COLUMNS: tl.constexpr = False,
                 ROWS: tl.constexpr = False):
    """h = SiLU(gate) * up (rounded to fp16, as the tensor-core path), then down over one K slice,
    weighted by the routing weight and added into out fp32 [T, NOUT] (zeroed by the caller).
    SKIP: as _gate_up_splitk: a marked pair's first cut_ptr[0] rows of K (a multiple of BK) are the
    CPU's; a cut of K or more leaves the whole expert. ORDERED: down's permutation is the identity
    (pack.align_intermediate): gu is read in runs, the permutation not at all. COLUMNS: see _tile_dot; ROWS:
    gemv_rows.py."""
    p = tl.program_id(0)
    t = p // A
    e = tl.load(ids_ptr + p).to(tl.int64)
    ks = tl.program_id(2) * (K // KSPLIT)
    if SKIP:
        k_start = tl.maximum(ks, tl.where(tl.load(skip_ptr + e) != 0, tl.load(cut_ptr), 0))
        if k_start < ks + K // KSPLIT:
            _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, k_start, K, N, HS, NOUT,
                              BITS, G, BK, BN, KSPLIT, True, ORDERED, COLUMNS, ROWS)
    else:
        _down_splitk_body(gu_ptr, rw_ptr, q2, o2, s2, p2, out_ptr, P, p, t, e, ks, K, N, HS, NOUT,
                          BITS, G, BK, BN, KSPLIT, False, ORDERED, COLUMNS, ROWS)


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


# A split-K launch finishing in itself (`_linear_splitk`'s FINISH, qkv_prologue.py, moe_finish.py): each program
# adds its sums into a float32 workspace (acq_rel atomics: visible before it counts), then `last_slice`; the last
# takes them whole (`take_sums`) and, after its stores, sets the counter back to zero (there, not sooner: on sm_90
# a reset inside `last_slice` gave qkv_prologue's 16-row shapes a stack frame). Both are zero between launches.
@triton.jit
def last_slice(c_ptr, SLICES):
    """Count this program's slice at c_ptr once its adds are issued: True for the last of SLICES (every other
    one has added)."""
    tl.debug_barrier()                                    # every thread's adds issued before the count
    return tl.atomic_add(c_ptr, 1) == SLICES - 1


@triton.jit
def take_sums(wptrs, like, mask):
    """The sums at wptrs (shaped as `like`), read where they were added, and the workspace set back to zero."""
    total = tl.atomic_add(wptrs, tl.zeros_like(like), mask=mask)
    tl.store(wptrs, tl.zeros_like(like), mask=mask)
    return total


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


@triton.jit
def _add_from_host(y_ptr, dy, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    part = tl.load(y_ptr + dy + i, mask=i < N, cache_modifier=".cv")      # fetched again, never a cached line
    tl.store(y_ptr + i, tl.load(y_ptr + i, mask=i < N) + part, mask=i < N)


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


