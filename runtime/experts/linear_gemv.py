"""The split-K GEMV for dense EXL2 linears (attention's q/k/v/o), each packed as a single expert:
`_linear_splitk` (runtime/experts/triton_kernels.py) launched on 1..LINEAR_MAX_ROWS rows.

One launch per part of a fused projection, each program computing every row for its columns and K slice, so
the weights are read once per call. A part whose chosen shape cuts K in KSPLIT slices adds its slices into a
float32 workspace and counts them in a counter per column block; the slice that comes last stores the block
into the destination and leaves the workspace and the counter at zero again. So every part is one launch into
its destination (a decode graph's q, k and v; or, adding, the residual stream): no memset, no cast, no copy.
The workspace and the counters are one pair per device, shared by every call: a call's launches run one after
another on the engine's stream, and each leaves them as it found them. A larger pair is made outside graph
capture only; earlier ones are kept, as graphs captured before hold their addresses. Where none fits during a
capture, the parts that cut K go into a zeroed float32 buffer by atomics and are cast after (the way before).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton

from runtime import tuning
from runtime.experts import kernels
from runtime.experts.kernels import SplitK, _bk, _ksplit
from runtime.experts.pack import PackedExperts
from runtime.experts.triton_kernels import _linear_splitk

LINEAR_MAX_ROWS = 9       # a decode step or a verify of up to 8 drafts
FMA_MAX_ROWS = 8          # the GEMV sums rows on the CUDA cores up to this many (more: the dot only)
FMA_MAX_TILE = 16384      # ... with at most this many products in a program's [rows, BK, BN] block

# per device: (float32 workspace, int32 counters), the newest last; all zero between launches
_WORKSPACES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def linear_tile(p: PackedExperts) -> int:
    """K tile for one packed dense linear; ValueError when its layout fits none."""
    if p.num_experts != 1:
        raise ValueError(f"a dense linear is one packed expert, got {p.num_experts}")
    return _bk(p, cap=128)


def linear_rows_block(T: int, c: SplitK) -> int:
    """The row block (BT) `_linear_splitk` runs T rows in under shape c: 1, 16 for the dot, else the
    power of two >= T."""
    return 1 if T == 1 else 16 if c.dot else 1 << (T - 1).bit_length()


def linear_candidates(K: int, N: int, bk: int, rows: int = 1) -> list[SplitK]:
    """Launch shapes for one part (every row in each program, so the grid is cdiv(N, BN) x KSPLIT whatever
    the rows): the default first (what the interpreter and a capture use), then the shapes worth timing,
    KSPLIT 1 among them; at 2 to FMA_MAX_ROWS rows each also without the tensor-core dot (which pads a
    verify's few rows to 16); the timing keeps whichever is faster on this GPU."""
    default = SplitK(64, _ksplit(K, bk, triton.cdiv(N, 64)))
    forced = tuning.current().splitk
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


def workspace(device: torch.device, floats: int, counters: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """This device's zeroed workspace and counters, at least this large: made (zeroed) when none is, except
    during a graph capture (None then)."""
    have = _WORKSPACES.setdefault(device, [])
    if have and have[-1][0].numel() >= floats and have[-1][1].numel() >= counters:
        return have[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    floats = max(floats, have[-1][0].numel() if have else 0)
    counters = max(counters, have[-1][1].numel() if have else 0)
    have.append((torch.zeros(floats, dtype=torch.float32, device=device),
                 torch.zeros(counters, dtype=torch.int32, device=device)))
    return have[-1]


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
                add: bool = False) -> None:
    """Dense EXL2 linears (each packed as one expert, the same K) on few rows: part i of x fp16 [T, K] into
    dests[i] fp16 [T, n_i] (its first n_i columns; rows may lie further apart, as in a wider tensor), stored,
    or added to what dests hold (`add`: the residual). Shapes timed once per shape and row count on the
    GPU (`kernels._choose`, in a graph). Nothing read on the host: capturable once the shapes are chosen."""
    T, K = x.shape
    if not 0 < T <= LINEAR_MAX_ROWS:
        raise ValueError(f"linear_decode: {T} rows, the split-K GEMV takes 1..{LINEAR_MAX_ROWS}")
    if x.dtype != torch.float16:
        raise ValueError(f"linear_decode: fp16 input expected, got {x.dtype}")
    if len(packs) != len(dests):
        raise ValueError(f"linear_decode: {len(packs)} parts, {len(dests)} destinations")
    x = x.contiguous()
    for p, d in zip(packs, dests):
        if p.in_features != K or d.dim() != 2 or d.shape[0] != T or not 0 < d.shape[1] <= p.out_features \
                or d.dtype != torch.float16 or d.stride(1) != 1:
            raise ValueError(f"linear_decode: part [K {p.in_features}, N {p.out_features}] into {d.dtype} "
                             f"{list(d.shape)} from {T} rows of {K}")
    ws = workspace(x.device, T * max(d.shape[1] for d in dests),
                   max(triton.cdiv(d.shape[1], 16) for d in dests))
    plan = []
    for p, d in zip(packs, dests):
        n_out, bk = d.shape[1], linear_tile(p)
        key = ("linear", K, p.out_features, n_out, T, p.bits, p.group, x.device)
        c = kernels._CHOSEN.get(key)
        if c is None:         # each shape timed alone, into a scratch output, as its launch runs in the step
            scratch = torch.empty((T, n_out), dtype=torch.float16, device=x.device)
            c = kernels._choose(key, linear_candidates(K, n_out, bk, T),
                                lambda c, p=p, bk=bk, s=scratch: _launch(x, p, bk, c, s, ws, False), graph=True)
        plan.append((p, d, bk, c))
    for p, d, bk, c in plan:
        if ws is not None or c.ksplit == 1:
            _launch(x, p, bk, c, d, ws, add)
        else:                                 # K cut during a capture without a workspace that fits
            acc = torch.zeros(d.shape, dtype=torch.float32, device=x.device)
            _launch(x, p, bk, c, acc, None, False)
            d.add_(acc) if add else d.copy_(acc)


def linear_decode(x: torch.Tensor, packs: Sequence[PackedExperts], outs: Sequence[int]) -> torch.Tensor:
    """x fp16 [T, K] -> fp16 [T, sum(outs)], part i's first outs[i] columns side by side (a fused projection);
    see `linear_into`."""
    out = torch.empty((x.shape[0], sum(outs)), dtype=torch.float16, device=x.device)
    dests, col = [], 0
    for n in outs:
        dests.append(out[:, col: col + n])
        col += n
    linear_into(x, packs, dests)
    return out
