"""The router of a MoE layer on the device: logits in fp32, softmax, top-k (ties: the lowest index first),
renormalised, each chosen expert counted (`counts`, the routing statistics); nothing read on the host.

- `route_normed`, one launch: the RMSNorm of the residual stream, the logits and the top-k, in place of
  exllamav2's norm kernel and two launches (a decode step is latency-bound, ~5 us a kernel). The row's last
  program picks once every program of the row has stored its logits (a counter per row, `RowCounters`, set
  back to 0 by that program, so a captured graph replays it as it is). Layers all in VRAM whose norm before
  the experts is an RMSNorm (the measured one-launch set: docs/engine-notes.md).
- `route_fused`, two launches, on a normed input: every other layer (offloaded ones, a LayerNorm before).
- `UniformPicks` (benchmarks): forced picks replacing the router's after it ran.
`router_logits` also serves the decode prefetch's prediction (runtime/offload/prefetch.py).
Letters: T tokens, H hidden, E experts, A experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


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
    FORCED (benchmarks; topk_outputs): the same work, then the picks replaced by a row of the N rows
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


EB = 2                                  # experts per program: E / 2 programs per row, as router_logits


class RowCounters:
    """The per-row counters of one layer's launches (int32, zero between launches). The buffer never
    changes, since captured graphs hold its address; a forward of more rows than it covers (a prefill,
    never captured) gets zeroed counters of its own."""

    def __init__(self, device, rows: int = 64):
        self.buf = torch.zeros(rows, dtype=torch.int32, device=device)

    def for_rows(self, rows: int) -> torch.Tensor:
        if rows <= self.buf.numel():
            return self.buf
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"route_normed: {rows} rows in a graph capture, counters for {self.buf.numel()}")
        return torch.zeros(rows, dtype=torch.int32, device=self.buf.device)


def route_normed(h: torch.Tensor, norm_w: torch.Tensor, eps: float, gate_w: torch.Tensor, top_k: int,
                 counts: torch.Tensor, counters: RowCounters, renormalize: bool = True,
                 forced=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, H] fp16 or fp32 (the residual stream), norm_w fp16 [H] -> (x fp16 [T, H] = RMSNorm(h) as
    exllamav2's kernel rounds it, ids int32 [T, A], weights fp32 [T, A]); counts[e] += times chosen; one
    launch. forced (benchmarks): as route_fused's."""
    T, H = h.shape
    E = gate_w.shape[0]
    if norm_w.shape != (H,) or gate_w.shape[1] != H:
        raise ValueError(f"route_normed: h {list(h.shape)}, norm weight {list(norm_w.shape)}, router "
                         f"{list(gate_w.shape)} do not agree")
    bh = next((b for b in (2048, 1024, 512, 256, 128, 64, 32) if H % b == 0), None)
    if bh is None:
        raise ValueError(f"route_normed: hidden size {H} is not a multiple of 32")
    h = h.contiguous()
    x = torch.empty((T, H), dtype=torch.float16, device=h.device)
    logits = torch.empty((T, E), dtype=torch.float32, device=h.device)
    ids, rw, table, step, mode = topk_outputs(T, top_k, h.device, forced, "route_normed")
    _route_normed[(T, triton.cdiv(E, EB))](
        h, norm_w, float(eps), x, gate_w, logits, counters.for_rows(T), ids, rw, counts, table, step, table.shape[0],
        H=H, E=E, EB=EB, BH=bh, BE=triton.next_power_of_2(E), A=top_k, BA=triton.next_power_of_2(top_k),
        RENORM=renormalize, FORCED=mode, num_warps=4)
    if forced is not None:
        forced.after_launch(T)
    return x, ids, rw
