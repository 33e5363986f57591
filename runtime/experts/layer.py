"""One MoE layer's routed experts: router in fp32, top-k with renormalisation, experts on packed weights.

Letters: T tokens, H hidden, E experts, A experts per token, I expert size.

`ExpertLayer` is the seam where offload plugs in: it owns the experts' weights (offload: runtime/experts/offload.py)
and the routing statistics; the exllamav2 module wrapper (runtime/experts/exl2_module.py) only
calls `__call__` on the normed hidden state. Same code for any row count and any expert count;
nothing here reads a device value on the host, so a decode step can be graph-captured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime import tuning
from runtime.experts.pack import PackedExperts, dequantize_packed


@dataclass
class Routing:
    ids: torch.Tensor          # int64 [T, A] chosen experts, most likely first
    weights: torch.Tensor      # float32 [T, A], renormalised to sum 1 per token


def route(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, renormalize: bool = True) -> Routing:
    """x [T, H] (any float), gate_w [E, H] -> the top-k experts and their weights, in fp32."""
    logits = x.float() @ gate_w.float().T                    # [T, E]
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)                # [T, A]
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return Routing(ids=ids, weights=w)


class ExpertLayer:
    """Routed experts of one layer: all in VRAM, or hot ones in VRAM and cold ones in pinned host
    memory (`offload`, set by runtime/experts/manager.py), read by the same kernels."""

    def __init__(self, gate_w: torch.Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts,
                 top_k: int, renormalize: bool = True):
        E = gate_w.shape[0]
        if not (w1.num_experts == w3.num_experts == w2.num_experts == E):
            raise ValueError(f"router has {E} experts, weights have {w1.num_experts}/{w3.num_experts}/{w2.num_experts}")
        if not 1 <= top_k <= E:
            raise ValueError(f"top-k {top_k} outside 1..{E}")
        if w1.out_features != w3.out_features or not w2.in_features <= w1.out_features < w2.in_features + 32:
            raise ValueError(f"gate/up/down shapes do not chain: gate {w1.out_features}, up {w3.out_features}, "
                             f"down takes {w2.in_features}")
        # [E, H] fp16: the checkpoint stores the router in fp16 (or EXL2, dequantized to fp16), so this
        # is exact; the logits are accumulated in fp32. Half the bytes of an fp32 copy, read every token.
        self.gate_w = gate_w.half().contiguous()
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts = E
        # Routing statistics (how often each expert was chosen), counted on the device (int32: the
        # kernels add atomically; wraps after 2**31 choices of one expert).
        self.counts = torch.zeros(E, dtype=torch.int32, device=gate_w.device)
        self.offload = None          # runtime/experts/offload.LayerOffload when experts are offloaded
        # Benchmarks only (bench.offload --routing uniform): the router runs, then each token takes
        # top_k distinct experts drawn uniformly at random (kernels.UniformPicks), equal weights. It
        # measures a placement under the routing the roofline assumes; what the model outputs means nothing.
        self.uniform = None
        # The RMSNorm weight applied before the router (set by the model wrapper): the decode prefetch
        # (runtime/experts/prefetch.py) predicts this layer's picks from the residual stream with it.
        self.norm_w: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None       # the last forward's picks (device), for the prefetch's score

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x fp16 [T, H] (normed) -> fp32 [T, H], the weighted sum of the chosen experts."""
        if x.is_cuda:
            from runtime.experts.kernels import experts_forward, route_fused
            self._ids = None
            if tuning.current().route == "torch":        # the unfused routing, for comparisons
                r = route(x, self.gate_w, self.top_k, self.renormalize)
                self.counts.index_add_(0, r.ids.reshape(-1), torch.ones_like(r.ids.reshape(-1), dtype=torch.int32))
                return experts_forward(x, r.ids, r.weights, self.w1, self.w3, self.w2)
            lo = self.offload
            m = lo.manager if lo is not None else None                     # runtime/experts/manager.py
            pf = m.prefetch if m is not None and x.shape[0] == 1 and not m.naive else None
            planned = pf is not None and pf.planned(lo)       # experts copied ahead for this layer
            ids, w = route_fused(x, self.gate_w, self.top_k, self.counts, self.renormalize, forced=self.uniform)
            self._ids = ids
            if lo is None:
                return experts_forward(x, ids, w, self.w1, self.w3, self.w2)
            cpu = lo.cpu                                      # runtime/experts/cpu_path.py
            if cpu is not None and x.shape[0] == 1 and not m.naive:
                # Decode: the CPU computes the experts it owns, or the first part of each (its cut),
                # handed to its worker by a doorbell or host node, while the GPU kernels skip that
                # and read the rest of the cold experts over PCIe (and the prefetched ones from VRAM).
                stream = torch.cuda.current_stream(x.device)
                skip, cut = cpu.launch(stream, x, ids, w, lo.mask, owned=pf.skip(lo) if planned else None)
                packs = m.before(lo, 1, ids)
                y = experts_forward(x, ids, w, *(pf.packs(lo, packs) if planned else packs), skip=skip, cut=cut)
                m.after(lo)
                return cpu.join(stream, y)
            # Rows of a verify forward share experts: read each cold one once over PCIe, not per row.
            union = x.shape[0] > 1 and lo.path != "vram"
            packs = m.before(lo, x.shape[0], ids)
            y = experts_forward(x, ids, w, *(pf.packs(lo, packs) if planned else packs), union_reads=union)
            m.after(lo)
            return y
        r = route(x, self.gate_w, self.top_k, self.renormalize)
        self.counts.index_add_(0, r.ids.reshape(-1), torch.ones_like(r.ids.reshape(-1), dtype=torch.int32))
        return experts_reference(x, r, self.w1, self.w3, self.w2)

    def after_residual(self, h: torch.Tensor) -> None:
        """The model wrapper's call after this layer's output joined the residual stream h [T, H]: a
        decode step's prefetch scores this layer's prediction and predicts the next layer's picks."""
        lo = self.offload
        if lo is None or h.shape[0] != 1 or self._ids is None:
            return
        m = lo.manager
        if m.prefetch is not None and not m.naive:
            m.prefetch.after_layer(lo, h, self._ids)

    def weight_bytes(self) -> int:
        return self.w1.nbytes() + self.w3.nbytes() + self.w2.nbytes() + self.router_bytes()

    def bytes_per_token(self, rows: int = 1) -> int:
        """Weight bytes one forward of `rows` tokens reads at most (router + each chosen expert once)."""
        experts = min(self.num_experts, rows * self.top_k)
        per_expert = self.w1.expert_bytes() + self.w3.expert_bytes() + self.w2.expert_bytes()
        return self.router_bytes() + experts * per_expert

    def router_bytes(self) -> int:
        return self.gate_w.numel() * self.gate_w.element_size()


def experts_reference(x: torch.Tensor, r: Routing, w1: PackedExperts, w3: PackedExperts,
                      w2: PackedExperts) -> torch.Tensor:
    """Plain PyTorch, fp32, one expert at a time: the oracle for the kernels (and a CPU fallback)."""
    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(r.ids).tolist():
        rows, slot = torch.nonzero(r.ids == e, as_tuple=True)
        g = xf[rows] @ dequantize_packed(w1, e).T
        u = xf[rows] @ dequantize_packed(w3, e).T
        h = (F.silu(g) * u).half().float()[:, : w2.in_features]   # the kernels keep h in fp16
        y = (h @ dequantize_packed(w2, e).T)[:, :H]
        out.index_add_(0, rows, y * r.weights[rows, slot, None])
    return out
