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

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from runtime import tuning
from runtime.experts.align_kernel import align as align_one, align_blocks
from runtime.experts.pack import PackedExperts, intermediate_aligned
from runtime.experts.triton_kernels import (_add_from_host, _cpu_inputs, _cpu_share_mask, _down_grouped, _down_splitk,
                                            _gate_up_grouped, _gate_up_splitk, _gather_pairs, _prefetch_copy,
                                            _prefetch_plan, _router_logits, _softmax_topk)

# Up to Tuning.gemv_max_pairs (token, expert) pairs (64), the split-K GEMVs (one weight read per pair);
# above, the grouped kernels (one read per expert and block of rows). Their launch shape: Tuning.grouped.


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


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to whole blocks of bm rows; all on the device.

    ids: int [P] expert of each pair. Returns (pairs int32 [B*bm], P = padding; block_expert int32 [B],
    -1 = unused block), B an upper bound that depends only on P (`align_blocks`), so no host synchronisation."""
    P = ids.numel()
    nblocks = align_blocks(P, num_experts, bm)
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


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                    w3: PackedExperts, w2: PackedExperts, union_reads: bool = False,
                    skip: torch.Tensor | None = None, cut: torch.Tensor | None = None,
                    order: InputOrder | None = None) -> torch.Tensor:
    """x fp16 [T, H], ids int [T, A], weights fp32 [T, A] -> fp32 [T, H] (sum of weighted experts).

    skip: uint8 [E] on the device, with cut: int32 [1] on the device. A pair whose expert is marked
    leaves the first `cut` rows of its intermediate (gate/up columns, down rows; a multiple of
    cut_align()) to the CPU (runtime/experts/cpu_path.py), which adds its part elsewhere; a cut of the
    expert's width or more leaves the whole expert. The intermediate must then be in down's packed
    order (pack.align_intermediate). Split-K GEMVs only (few pairs, no union_reads).

    union_reads: use the grouped kernels even for few pairs, so each chosen expert's weights are read
    once per block of rows instead of once per (row, expert) pair. For offloaded layers, whose cold
    experts are read over PCIe: on the H200 (qwen3-30b-a3b, 8 GB budget) verifying 8 rows per pair
    cost 6.5x the one-row step, 9 rows through the grouped kernels 1.3x.

    order: the layer's InputOrder (`input_order`); None: each grouped tile gathered through its permutation.

    Stored column counts may be padded to 32 (padding dequantizes to 0): gate/up write I' >= I
    columns of h, down reads its first I; down's H' >= H columns are cut to H."""
    T, H = x.shape
    A = ids.shape[1]
    P = T * A
    t = tuning.current()
    if P <= t.gemv_max_pairs and not (union_reads and T > 1):
        return experts_decode(x, ids, weights, w1, w3, w2, skip, cut, ordered=bool(order and order.ordered_down))
    if skip is not None:
        raise ValueError(f"a skip mask needs the split-K GEMVs: {T} rows x {A} experts is more than "
                         f"{t.gemv_max_pairs} pairs, or union_reads is set")
    I1, I2, H2 = w1.out_features, w2.in_features, w2.out_features
    x = x.contiguous()
    ids_f = ids.reshape(P).to(torch.int32)
    rw = weights.reshape(P).to(torch.float32).contiguous()
    h = torch.empty((P, I1), dtype=torch.float16, device=x.device)
    y = torch.empty((P, H2), dtype=torch.float32, device=x.device)
    g = t.grouped
    bk1, bk2 = _bk_span(w1, w3, want=g.bk), _bk_span(w2, want=g.bk)
    bm, bn = (g.bm_large if P >= 4096 else g.bm_small), g.bn
    launch = dict(num_warps=g.warps, **({"num_stages": g.stages} if g.stages else {}))
    if t.align == "kernel":                   # one launch (runtime/experts/align_kernel.py)
        pairs, bexp = align_one(ids_f, w1.num_experts, bm)
    else:
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


def interpreting() -> bool:
    return tuning.triton_interpret()


SM_TARGET = 528          # programs to aim for in decode (about 4 per multiprocessor of an H200)


def _ksplit(K: int, bk: int, programs: int) -> int:
    """Largest power-of-two split of K (in whole tiles) that brings the grid near SM_TARGET programs."""
    ks = 1
    while programs * ks * 2 <= SM_TARGET and K % (ks * 2 * bk) == 0:
        ks *= 2
    return ks


# A CPU cut (experts_forward) is a multiple of Tuning.cut_align rows of the intermediate (64): down's
# K tile where a cut is given, and whole 32-row words and 16-column tiles on the CPU's side. 64 was
# measured (runtime/experts/NOTES.md); MOEDESK_CUT_ALIGN=32 gives finer steps (a 32-row tile reads a
# 3-bit expert's high-bit plane row by row: not measured yet).
def cut_align() -> int:
    return tuning.current().cut_align


def __getattr__(name: str):
    """`CUT_ALIGN`: the installed tuning's cut step, read when asked (runtime/experts/manager.py)."""
    if name == "CUT_ALIGN":
        return tuning.current().cut_align
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SHARE_DEN = 1024       # cpu_share_mask: the CPU's share of a token's cold picks in 1/1024ths


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


def topk_outputs(T: int, top_k: int, device, forced: Optional["UniformPicks"], who: str):
    """A routing launch's outputs (ids int32 [T, A], weights fp32 [T, A]), `forced`'s table and step (the
    ids twice where it is None: the kernel reads neither) and the kernel's FORCED: 0 none, 1 one row (the
    kernel moves the counter), 2 several rows (`UniformPicks.after_launch` moves it)."""
    if forced is not None and forced.table.shape[1] != top_k:
        raise ValueError(f"{who}: pick sets of {forced.table.shape[1]} experts for top-k {top_k}")
    ids = torch.empty((T, top_k), dtype=torch.int32, device=device)
    rw = torch.empty((T, top_k), dtype=torch.float32, device=device)
    if forced is None:
        return ids, rw, ids, ids, 0
    return ids, rw, forced.table, forced.step, 1 if T == 1 else 2


def route_fused(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, counts: torch.Tensor,
                renormalize: bool = True, forced: Optional["UniformPicks"] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp16 [T, H], gate_w fp16 or fp32 [E, H] -> (ids int32 [T, A], weights fp32 [T, A]); two
    launches, counts[e] += times chosen. forced (benchmarks): the router runs as always, then each
    row takes the next pick set of `forced` instead (equal weights)."""
    T, H = x.shape
    E = gate_w.shape[0]
    ids, rw, table, step, mode = topk_outputs(T, top_k, x.device, forced, "route_fused")
    logits = router_logits(x, gate_w, torch.empty((T, E), dtype=torch.float32, device=x.device))
    _softmax_topk[(T,)](logits, ids, rw, counts, table, step, table.shape[0], E=E, BE=triton.next_power_of_2(E),
                        A=top_k, BA=triton.next_power_of_2(top_k), RENORM=renormalize,
                        FORCED=mode, num_warps=4)
    if forced is not None:
        forced.after_launch(T)
    return ids, rw


@dataclass
class UniformPicks:
    """Benchmarks only: `rows` sets of A distinct experts drawn uniformly at random (int32 [rows, A],
    on the device), and a counter (int64 [1]): a routing launch of T rows hands row t the set at counter
    + t and the counter moves on by T, so which row takes which set does not depend on the order the
    launch's programs run in. A layer's counter starts at its own offset, so layers draw independently.
    Graph-capturable: the counter lives on the device."""
    table: torch.Tensor
    step: torch.Tensor

    @staticmethod
    def draw(E: int, top_k: int, device, rows: int = 1 << 16, seed: int = 0) -> "UniformPicks":
        g = torch.Generator().manual_seed(seed)
        table = torch.rand((rows, E), generator=g).topk(top_k, dim=-1).indices.to(torch.int32)
        return UniformPicks(table.to(device), torch.zeros(1, dtype=torch.int64, device=device))

    def after_launch(self, rows: int) -> None:
        """After a routing launch of `rows` rows, on its stream: the counter moved on past them (a launch
        of one row moved it itself)."""
        if rows > 1:
            self.step.add_(rows)

    def for_layer(self, index: int) -> "UniformPicks":
        """The same sets, read from an offset of its own (a counter per layer)."""
        start = (index * 7919 * 97) % self.table.shape[0]
        return UniformPicks(self.table, torch.full((1,), start, dtype=torch.int64, device=self.table.device))


@dataclass(frozen=True)
class SplitK:
    """Launch shape of a split-K GEMV: BN output columns per program, the K range cut in KSPLIT; for the
    dense GEMV at 2+ rows, `dot` (rows padded to 16 for a tensor-core dot) or not (the rows' products
    summed on the CUDA cores, rows padded to a power of two)."""
    bn: int
    ksplit: int
    warps: int = 4
    dot: bool = True


# Launch shapes chosen by timing on this GPU, per (kernel, shapes, pairs); filled on first use.
_CHOSEN: dict[tuple, SplitK] = {}


def _candidates(K: int, N: int, P: int, bk: int, rows: bool = False) -> list[SplitK]:
    """The default first (what the interpreter and a capture use), then the shapes worth timing. rows (the
    tile summed by rows of code words, gemv_rows.py): column blocks of 128 per warp, so that each thread holds
    every row of its columns."""
    first = 128 if rows else 64
    default = SplitK(first, _ksplit(K, bk, P * triton.cdiv(N, first)), 1 if rows else 4)
    forced = tuning.current().splitk                      # one shape, for tests and experiments
    if forced:
        bn, ks = forced
        return [SplitK(bn, ks) if K % (ks * bk) == 0 else default]
    out = [default]
    for bn in ((128, 256, 512) if rows else (32, 64, 128)):
        for ks in (1, 2, 3, 4, 6, 8, 12, 16):
            programs = P * triton.cdiv(N, bn) * ks
            c = SplitK(bn, ks, bn // 128 if rows else 4)
            if K % (ks * bk) == 0 and 128 <= programs <= 4096 and c not in out:
                out.append(c)          # each new shape is one more compilation on first use: keep few
    return out


def _choose(key: tuple, candidates: list[SplitK], launch, graph: bool = False) -> SplitK:
    """Time each candidate launch (CUDA events, after one untimed call that compiles it; a shape that
    does not compile here is passed over, except the default) and keep the fastest for `key`. Not while
    a graph is being captured, and not under the interpreter: there the default runs. The caller's
    launches write to scratch buffers. graph: time ten launches captured in a CUDA graph (best of three
    replays), as a decode graph runs them; a kernel of a few microseconds launched from the host would
    be timed by its launch cost."""
    if key in _CHOSEN:
        return _CHOSEN[key]
    if len(candidates) == 1:
        return candidates[0]
    if interpreting() or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    best, best_t = candidates[0], float("inf")
    for c in candidates:
        try:
            launch(c)
        except (CompilationError, OutOfResources):   # a shape this GPU cannot build (registers, shared memory)
            if c is candidates[0]:
                raise
            continue
        t = _time_graph(lambda: launch(c)) if graph else _time_eager(lambda: launch(c))
        if t < best_t:
            best, best_t = c, t
    _CHOSEN[key] = best
    return best


def _time_eager(run) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_graph(run) -> float:
    # captured by hand on a side stream: torch.cuda.graph would collect garbage and empty the cache
    # for each of the many small graphs timed at load
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin(capture_error_mode=tuning.current().capture_mode)
        try:
            for _ in range(10):
                run()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def experts_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                   w3: PackedExperts, w2: PackedExperts, skip: torch.Tensor | None = None,
                   cut: torch.Tensor | None = None, ordered: bool = False) -> torch.Tensor:
    """Few rows: split-K GEMVs with atomic accumulation; x fp16 [T, H] -> fp32 [T, H]. Three launches
    (one memset, gate+up, down); no intermediate leaves fp32. Launch shapes are timed once per shape
    on the GPU (`_choose`). skip, cut: see experts_forward (the launch shapes chosen without them
    serve them too: a pair's programs for the CPU's part only return). ordered: down's permutation is
    the identity (InputOrder.ordered_down): down reads gate/up's output in runs."""
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
    x, sums = x.contiguous(), tuning.current().gemv_sums
    rows1 = sums == "rows" and w1.bits in (4, 8) and w3.bits in (4, 8)      # gemv_rows.py; 3 bits by columns
    rows2 = sums == "rows" and w2.bits in (4, 8)
    cols1, cols2 = sums != "weights" and not rows1, sums != "weights" and not rows2
    # with a cut, down's K tile divides cut_align(), so the GPU's part of a split expert starts on a tile; summed
    # by rows, a tile is at most 16 rows of words (each thread holds them all, for each of its columns)
    bk1 = _bk(w1, w3, cap=min(128, 512 // max(w1.bits, w3.bits)) if rows1 else 128)
    bk2 = _bk(w2, cap=min(cut_align() if has_skip else 128, 512 // w2.bits if rows2 else 128))

    def gate_up(c: SplitK, dst: torch.Tensor):
        grid = (P, triton.cdiv(I1, c.bn), c.ksplit)
        _gate_up_splitk[grid](
            x, ids_f, skip_t, cut_t, w1.qweight, w1.woff, w1.scales, w1.perm, w3.qweight, w3.woff, w3.scales, w3.perm, dst, P,
            K=H, N=I1, A=A, BITS1=w1.bits, G1=w1.group, BITS3=w3.bits, G3=w3.group, BK=bk1, BN=c.bn,
            KSPLIT=c.ksplit, SKIP=has_skip, COLUMNS=cols1, ROWS=rows1, num_warps=c.warps)

    def down(c: SplitK, dst: torch.Tensor):
        grid = (P, triton.cdiv(H2, c.bn), c.ksplit)
        _down_splitk[grid](
            gu, ids_f, skip_t, cut_t, rw, w2.qweight, w2.woff, w2.scales, w2.perm, dst, P, K=I2, N=H2, HS=I1, NOUT=H, A=A,
            BITS=w2.bits, G=w2.group, BK=bk2, BN=c.bn, KSPLIT=c.ksplit, SKIP=has_skip, ORDERED=ordered,
            COLUMNS=cols2, ROWS=rows2, num_warps=c.warps)

    key1 = ("gate_up", H, I1, P, w1.bits, w1.group, w3.bits, w3.group, cols1, rows1, x.device)
    key2 = ("down", I2, H2, P, w2.bits, w2.group, bk2, cols2, rows2, x.device)
    if key1 not in _CHOSEN or key2 not in _CHOSEN:
        scratch = torch.empty_like(buf)
        c1 = _choose(key1, _candidates(H, I1, P, bk1, rows1), lambda c: gate_up(c, scratch[: 2 * P * I1]))
        c2 = _choose(key2, _candidates(I2, H2, P, bk2, rows2),
                     lambda c: down(c, scratch[2 * P * I1:].view(T, H)))
    else:
        c1, c2 = _CHOSEN[key1], _CHOSEN[key2]
    gate_up(c1, gu)
    down(c2, out)
    return out


# -- decode prefetch of the next layer's likely cold experts (runtime/experts/prefetch.py) ------------

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
