"""The prefill's pairs sorted by expert in one launch (tuning switch MOEDESK_ALIGN=kernel; not yet measured).

`kernels.align` builds the grouped kernels' row blocks with about twenty torch launches (a scatter-add for
the counts, a stable argsort, cumulative sums, a searchsorted for the blocks' experts), once per MoE layer
and prefill chunk; a prefill runs eagerly, so each is a launch from the host. `_align` does the same in one
program: the counts (pairs compared with every expert, a chunk at a time), the blocks per expert and their
starts, each pair's rank among the earlier pairs of its expert (the same order as the stable sort), the
padding, and each block's expert. Same outputs, bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128               # pairs compared with every expert at a time


def align_blocks(P: int, num_experts: int, bm: int) -> int:
    """Blocks of bm rows that P pairs take at most, each expert's run padded to whole blocks (both aligns)."""
    return (P + min(num_experts, P) * (bm - 1)) // bm


@triton.jit
def _align(ids_ptr, pairs_ptr, bexp_ptr, P, NB, E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
           CH: tl.constexpr, BB: tl.constexpr):
    """ids int32 [P] -> pairs int32 [NB * BM] (P: padding), bexp int32 [NB] (-1: unused). One program."""
    e = tl.arange(0, BE)
    em = e < E
    c = tl.arange(0, CH)
    counts = tl.zeros([BE], dtype=tl.int32)
    for s in range(0, P, CH):                                   # pairs per expert
        ids = tl.load(ids_ptr + s + c, mask=s + c < P, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    nb = (counts + BM - 1) // BM                                # blocks per expert
    cum_nb = tl.cumsum(nb, axis=0)
    start = (cum_nb - nb) * BM                                  # each expert's first row
    for s in range(0, NB * BM, CH):                             # padding everywhere first
        tl.store(pairs_ptr + s + c, tl.zeros([CH], dtype=tl.int32) + P, mask=s + c < NB * BM)
    tl.debug_barrier()                                          # the padding stored before the pairs
    seen = tl.zeros([BE], dtype=tl.int32)                       # pairs of each expert placed so far
    for s in range(0, P, CH):
        ids = tl.load(ids_ptr + s + c, mask=s + c < P, other=-1)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)         # [CH, BE]
        before = tl.cumsum(hit, axis=0) - hit                   # earlier pairs of the same expert in the chunk
        row = tl.sum(hit * (start[None, :] + seen[None, :] + before), axis=1)    # the pair's row: its expert's
        tl.store(pairs_ptr + row, s + c, mask=s + c < P)
        seen += tl.sum(hit, axis=0)
    b = tl.arange(0, BB)
    for s in range(0, NB, BB):                                  # each block's expert: cum_nb's first > block
        blk = s + b
        owner = tl.sum((cum_nb[None, :] <= blk[:, None]).to(tl.int32) * em[None, :].to(tl.int32), axis=1)
        tl.store(bexp_ptr + blk, tl.where(owner < E, owner, -1), mask=blk < NB)


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `kernels.align` (ids int [P] -> pairs int32 [B * bm], block_expert int32 [B]), in one launch."""
    P = ids.numel()
    nblocks = align_blocks(P, num_experts, bm)
    ids = ids.to(torch.int32).contiguous()
    pairs = torch.empty(nblocks * bm, dtype=torch.int32, device=ids.device)
    bexp = torch.empty(nblocks, dtype=torch.int32, device=ids.device)
    _align[(1,)](ids, pairs, bexp, P, nblocks, E=num_experts, BE=triton.next_power_of_2(num_experts), BM=bm,
                 CH=CHUNK, BB=64, num_warps=8)
    return pairs, bexp
