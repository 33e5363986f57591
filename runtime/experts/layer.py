"""One MoE layer's routed experts: router in fp32, top-k with renormalisation, experts on packed weights.

Letters: T tokens, H hidden, E experts, A experts per token, I expert size.

`ExpertLayer` is the seam where offload plugs in: it owns the experts' weights (offload: runtime/offload/) and
the routing statistics; the engines call it on the normed hidden state, or, for a layer all in VRAM, on the
residual stream with its RMSNorm and the residual to add (the measured one-launch set: the norm, router and
top-k in one launch, the experts in two, the sum added into the residual by the second; routing.py,
decode.py). Same code for any row count and any expert count; nothing here reads a device value on the host,
so a decode step can be graph-captured. The kernels' launch shapes (Tuning.grouped, Tuning.splitk) are given
at construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

from runtime.experts.decode import GEMV_MAX_PAIRS, experts_decode, experts_finish
from runtime.experts.grouped import InputOrder, experts_grouped, input_order
from runtime.experts.pack import PackedExperts, dequantize_packed
from runtime.experts.routing import RowCounters, route_fused, route_normed
from runtime.tuning import Grouped


@dataclass
class Routing:
    ids: torch.Tensor          # int64 [T, A] chosen experts, most likely first
    weights: torch.Tensor      # float32 [T, A], renormalised to sum 1 per token


def union_reads(rows: int, path: str) -> bool:
    """Whether an offloaded layer (expert path `path`) reads the experts of a forward of `rows` rows
    once each (grouped kernels) rather than once per row and expert (split-K GEMVs). The rows of a
    verify share experts, and a cold one read per row crossed PCIe once per row (8 rows: 6.5x the
    one-row step on the H200, 1.3x through the grouped kernels)."""
    return rows > 1 and path != "vram"


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: PackedExperts,
                    w3: PackedExperts, w2: PackedExperts, union_reads: bool = False,
                    skip: Optional[torch.Tensor] = None, cut: Optional[torch.Tensor] = None,
                    order: Optional[InputOrder] = None, grouped: Grouped = Grouped(),
                    splitk: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """x fp16 [T, H], ids int [T, A], weights fp32 [T, A] -> fp32 [T, H] (sum of weighted experts): up to
    GEMV_MAX_PAIRS pairs the split-K GEMVs (decode.experts_decode; skip and cut: the CPU's share), above them,
    or several rows with union_reads, the grouped kernels (grouped.experts_grouped: each chosen expert read once
    per block of rows, as an offloaded layer verifies). order: the layer's InputOrder; grouped, splitk: the
    launch shapes (Tuning)."""
    T, A = ids.shape
    if T * A <= GEMV_MAX_PAIRS and not (union_reads and T > 1):
        return experts_decode(x, ids, weights, w1, w3, w2, skip, cut, bool(order and order.ordered_down), splitk)
    if skip is not None:
        raise ValueError(f"a skip mask needs the split-K GEMVs: {T} rows x {A} experts is more than "
                         f"{GEMV_MAX_PAIRS} pairs, or union_reads is set")
    return experts_grouped(x, ids, weights, w1, w3, w2, order, grouped)


def route(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, renormalize: bool = True) -> Routing:
    """x [T, H] (any float), gate_w [E, H] -> the top-k experts and their weights, in fp32."""
    logits = x.float() @ gate_w.float().T                    # [T, E]
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)                # [T, A]
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return Routing(ids=ids, weights=w)


class ExpertHooks(Protocol):
    """What an offloaded layer calls around its kernels (runtime/offload/manager.LayerHooks)."""
    prefetch: Any        # the decode prefetch a decode step uses (offload/prefetch.DecodePrefetch), or None
    cpu_decode: bool     # whether a decode step may use the layer's CPU path

    def before(self, lo, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        """The projections (with the offset tables) the layer's kernels use for this call."""

    def after(self, lo) -> None:
        """After the kernels were queued (the staging buffer they read may be reused after them)."""


class ExpertLayer:
    """Routed experts of one layer: all in VRAM, or hot ones in VRAM and cold ones in pinned host
    memory (`offload` and `hooks`, set by runtime/offload/manager.py), read by the same kernels."""

    def __init__(self, gate_w: torch.Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts,
                 top_k: int, renormalize: bool = True, grouped: Grouped = Grouped(),
                 splitk: Optional[tuple[int, int]] = None):
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
        self.grouped, self.splitk = grouped, splitk            # the kernels' launch shapes (Tuning)
        # Routing statistics (how often each expert was chosen), counted on the device (int32: the
        # kernels add atomically; wraps after 2**31 choices of one expert).
        self.counts = torch.zeros(E, dtype=torch.int32, device=gate_w.device)
        # Expert offload (runtime/offload/manager.py sets both): the expert source, with the slots, tables
        # and CPU path (slots.LayerOffload), and the hooks called around the kernels (ExpertHooks).
        self.offload = None
        self.hooks: ExpertHooks | None = None
        # Benchmarks only (runtime/offload/experiment.py, Experiment.forced_routing): the router runs, then
        # each token takes the forced picks (routing.UniformPicks), equal weights; set by apply_experiment.
        self.forced = None
        # The RMSNorm weight applied before the router (set by the model wrapper): the decode prefetch
        # (runtime/offload/prefetch.py) predicts this layer's picks from the residual stream with it.
        self.norm_w: torch.Tensor | None = None
        # A LayerNorm before the router (DBRX) also subtracts the mean: the prefetch then predicts with
        # this router folded with the norm's weight and centred (`fold_layer_norm`), norm_w None.
        self.predict_gate: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None       # the last forward's picks (device), for the prefetch's score
        self._counters: Optional[RowCounters] = None   # route_normed's per-row counters, made at its first use
        # How the grouped kernels read the input (grouped.InputOrder), from the permutations, once; on the CPU
        # (the oracle) nothing reads it.
        self.order = input_order(w1, w3, w2) if gate_w.is_cuda else None

    def __call__(self, x: torch.Tensor, norm: Optional[tuple[torch.Tensor, float]] = None,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x fp16 [T, H] (normed) -> fp32 [T, H], the weighted sum of the chosen experts. norm (CUDA): x is
        the residual stream, normed here by RMSNorm (weight, eps) in the routing's launch (routing.route_normed).
        residual fp16 [T, H] (a layer all in VRAM): residual + that sum, a new fp16 [T, H], added by the
        kernels where they can (decode.experts_finish)."""
        if residual is not None and self.offload is not None:
            raise ValueError("a residual is added by the experts' kernels of layers all in VRAM only")
        if not x.is_cuda:
            return self._reference(x, residual)
        self._ids = None
        if norm is not None:
            if self._counters is None:
                self._counters = RowCounters(x.device)
            x, ids, w = route_normed(x, *norm, self.gate_w, self.top_k, self.counts, self._counters,
                                     self.renormalize, forced=self.forced)
        else:
            ids, w = route_fused(x, self.gate_w, self.top_k, self.counts, self.renormalize, forced=self.forced)
        self._ids = ids
        if self.offload is None:
            return self._all_resident(x, ids, w, residual)
        return self._offloaded(x, ids, w)

    def _all_resident(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                      residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Every expert in VRAM: the split-K GEMVs or the grouped kernels; with a residual, the sum added into
        it by down's kernel (two launches, few pairs), else by one add."""
        if residual is not None and ids.numel() <= GEMV_MAX_PAIRS:
            out = experts_finish(x, ids, w, self.w1, self.w3, self.w2, residual,
                                 bool(self.order and self.order.ordered_down), self.splitk)
            if out is not None:
                return out
        y = experts_forward(x, ids, w, self.w1, self.w3, self.w2, order=self.order, grouped=self.grouped,
                            splitk=self.splitk)
        return y if residual is None else torch.add(residual, y, out=torch.empty_like(residual))

    def _offloaded(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Hot experts from VRAM, cold ones over PCIe, staged (prefill) or prefetched; a decode step's CPU path
        computes its share of the cold picks (runtime/cpu/path.py) while the kernels skip it and read the rest."""
        lo, hooks = self.offload, self.hooks
        pf = hooks.prefetch if x.shape[0] == 1 else None
        planned = pf is not None and pf.planned(lo)       # experts copied ahead for this layer
        cpu = lo.cpu
        skip = cut = None
        if cpu is not None and x.shape[0] == 1 and hooks.cpu_decode:
            stream = torch.cuda.current_stream(x.device)
            skip, cut = cpu.launch(stream, x, ids, w, lo.mask, owned=pf.skip(lo) if planned else None)
        packs = hooks.before(lo, x.shape[0], ids)
        if planned:
            packs = pf.packs(lo, packs)
        y = experts_forward(x, ids, w, *packs, union_reads=union_reads(x.shape[0], lo.path), skip=skip, cut=cut,
                            order=self.order, grouped=self.grouped, splitk=self.splitk)
        hooks.after(lo)
        return y if skip is None else cpu.join(stream, y)

    def _reference(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """On the CPU: plain torch, fp32 (the oracle the kernels are checked against)."""
        r = route(x, self.gate_w, self.top_k, self.renormalize)
        self.counts.index_add_(0, r.ids.reshape(-1), torch.ones_like(r.ids.reshape(-1), dtype=torch.int32))
        y = experts_reference(x, r, self.w1, self.w3, self.w2)
        return y if residual is None else torch.add(residual, y, out=torch.empty_like(residual))

    def fold_layer_norm(self, weight: torch.Tensor) -> None:
        """For a bias-free LayerNorm of `weight` [H] before the router: `predict_gate` [E, H] with
        (h . predict_gate[e]) = sigma(h) * logit_e(h), sigma > 0 (LayerNorm's scale does not change
        the ranking): c_e = w * g_e - mean(w * g_e), since (h - mean(h)) . v = h . (v - mean(v))."""
        g = self.gate_w.float() * weight.float().reshape(1, -1).to(self.gate_w.device)
        self.predict_gate = (g - g.mean(dim=1, keepdim=True)).half().contiguous()

    def after_residual(self, h: torch.Tensor) -> None:
        """The model wrapper's call after this layer's output joined the residual stream h [T, H]: a
        decode step's prefetch scores this layer's prediction and predicts the next layer's picks."""
        lo, hooks = self.offload, self.hooks
        if lo is None or hooks is None or h.shape[0] != 1 or self._ids is None:
            return
        if hooks.prefetch is not None:
            hooks.prefetch.after_layer(lo, h, self._ids)

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
