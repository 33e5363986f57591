"""The MoE block's entry in one launch: RMSNorm of the residual stream, router logits and top-k
(triton_kernels._route_normed), in place of exllamav2's norm kernel and route_fused's two launches (issue
25: a decode step is latency-bound, ~5 µs a kernel). Chosen by the tuning `route = "normed"`, for layers
whose norm before the experts is an RMSNorm; not yet measured on a GPU, so not the default.

The row's last program picks its experts once every program of the row has stored its logits: a counter
per row (`RowCounters`), set back to 0 by that program, so a captured graph replays it as it is."""
from __future__ import annotations

import torch
import triton

from runtime.experts.kernels import topk_outputs
from runtime.experts.triton_kernels import _route_normed

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
