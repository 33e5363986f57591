"""The CPU path's device side (runtime/cpu/path.py): three small kernels a decode step's graph runs around the
CPU's share of a layer's cold experts.

- `cpu_share_mask`: which of a token's cold picks the CPU computes (the balanced split of whole experts);
- `cpu_inputs`: x, ids, weights and the mask written into the CPU's page-locked buffers in one launch;
- `add_from_host`: the CPU's part of y added from page-locked memory, read in place.
Letters: H hidden, A experts per token, E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


SHARE_DEN = 1024       # cpu_share_mask: the CPU's share of a token's cold picks in 1/1024ths


def cpu_share_mask(ids: torch.Tensor, owned: torch.Tensor, resident: torch.Tensor, share: int,
                   out: torch.Tensor) -> torch.Tensor:
    """The experts the CPU computes for one token (one decode row), on the device: of the token's
    cold picks (resident[e] == 0), those the CPU has copies of (owned[e] != 0), in pick order, up to
    round(share / SHARE_DEN * cold picks); the rest go over PCIe. So every layer's split follows the
    token's own picks instead of only the average (runtime/cpu/path.py, balanced split).

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
    that rings the worker after it fences them (path.py)."""
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
