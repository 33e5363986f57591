"""Calibration of one decoder layer for the converter: the Hessians of its linears, GPTQ, bounded memory.

While the layer runs on the calibration hidden states, hooks on its linears sum each linear's input
Hessian 2 X^T X (linears fed the same tensor, such as q/k/v, share one). The MoE experts module is not
summed while it runs: its hook keeps the tokens it receives (float16, float32 where float16 would
overflow) and the router's top-k choice, once per layer. After the run the dense linears are quantized
and their Hessians dropped; then the experts are calibrated in groups: for a group, one pass over the
kept tokens sums each expert's gate/up Hessian from the tokens routed to it and its down Hessian from
its own intermediate activations of them; the group's gates are GPTQ'd in one column loop, then their ups,
then their downs (gptq.quantize_gptq_many: on a GPU the loop's small operations are latency-bound, so one
loop for the group is several times faster than one per expert), and the group's Hessians are dropped
before the next group starts. A group holds as many experts as `hessian_budget` bytes allow (expert_bytes:
Hessians, inverses, the loop's weights; at least one), so a 128- or 256-expert layer never holds all its
experts' Hessians at once; an expert's result depends only on its own weights and tokens, bit for bit, so
the model is the same for every budget.

An expert routed fewer than MIN_EXPERT_TOKENS_PER_INPUT x in_features tokens would be calibrated on a
nearly singular Hessian; it falls back to the Hessian of all the layer's tokens for gate/up and of all
tokens through its own gate/up for down_proj (counted as experts_all_token_fallback).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from . import allocate
from . import format as fmt
from .gptq import HessianAccumulator, prepare, quantize_gptq_many

MIN_EXPERT_TOKENS_PER_INPUT = 2      # expert tokens below this x in_features -> all-token Hessian
DEFAULT_HESSIAN_BUDGET = 2 << 30     # bytes of expert Hessians held at once (float64)
H_BYTES = 8                          # HessianAccumulator sums in float64


class CalibrationError(RuntimeError):
    """A layer that cannot be calibrated; the message names the linear."""


def hessian_bytes(width: int) -> int:
    return width * width * H_BYTES


def expert_bytes(hidden: int, inter: int) -> int:
    """What one expert of a group holds while the group is quantized: its gate/up and down Hessians (float64),
    its gate/up Hessian's damped inverse (float32, kept for gate and up) and its share of the group's GPTQ
    loop (the weights being quantized and their codes, float32)."""
    return hessian_bytes(hidden) + hessian_bytes(inter) + hidden * hidden * 4 + 2 * (inter + 31) // 32 * 32 * hidden * 4


def experts_per_group(hidden: int, inter: int, budget: int) -> int:
    """How many experts fit in `budget` bytes (expert_bytes; at least one)."""
    return max(1, int(budget) // expert_bytes(hidden, inter))


class RoutedInputs:
    """The tokens an experts module received during the layer's run, with the router's top-k choice."""

    def __init__(self, mod: torch.nn.Module):
        self.mod = mod
        self.x: list[torch.Tensor] = []
        self.top_k: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, top_k_index: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        half = x.to(torch.float16)
        self.x.append(half if torch.isfinite(half).all() else x.clone())
        self.top_k.append(top_k_index.detach().reshape(x.shape[0], -1).clone())

    def routed_counts(self) -> torch.Tensor:
        n = self.mod.num_experts
        counts = torch.zeros(n, dtype=torch.int64)
        for idx in self.top_k:
            mine = torch.zeros((idx.shape[0], n + 1), dtype=torch.bool, device=idx.device)
            mine.scatter_(1, idx.clamp(0, n), True)
            counts += mine[:, :n].sum(0).cpu()
        return counts

    def all_tokens_hessian(self) -> HessianAccumulator:
        acc = HessianAccumulator(self.mod.gate_up_proj.shape[-1], device=self.mod.gate_up_proj.device)
        for x in self.x:
            acc.add(x)
        return acc

    def expert_hessians(self, experts: list[int], routed: dict[int, bool]):
        """{expert: (gate/up accumulator or None where not routed, down accumulator)}, one pass over the
        kept tokens; a routed expert sums its own tokens, another all of them (the fallback)."""
        gu_all, dn_all = self.mod.gate_up_proj, self.mod.down_proj
        dev = gu_all.device
        out = {e: (HessianAccumulator(gu_all.shape[-1], device=dev) if routed[e] else None,
                   HessianAccumulator(dn_all.shape[-1], device=dev)) for e in experts}
        with torch.no_grad():
            for e in experts:                   # an expert's weight read once (a copy where it is not stacked)
                gu = gu_all[e]
                for x, idx in zip(self.x, self.top_k):
                    rows = x[(idx == e).any(dim=-1)] if routed[e] else x
                    if rows.shape[0] == 0:
                        continue
                    rows = rows.to(torch.float32)
                    h_in, h_down = out[e]
                    if h_in is not None:
                        h_in.add(rows)
                    gate, up = torch.nn.functional.linear(rows, gu).chunk(2, dim=-1)
                    h_down.add(self.mod.act_fn(gate) * up)
        return out


class Collector:
    """Hooks on one layer: Hessians of its linears, the tokens of its experts modules."""

    def __init__(self, layer: torch.nn.Module):
        self.acc: dict[str, HessianAccumulator] = {}
        self.alias: dict[str, str] = {}              # linear -> the linear whose input (and Hessian) it shares
        self.experts: dict[str, RoutedInputs] = {}
        self.handles = []
        self.live = self.peak = 0                    # bytes of Hessians held now / at most
        self.experts_per_group = 0
        self.expert_seconds = 0.0                    # time spent calibrating and quantizing experts
        self._last: tuple[torch.Tensor, str] | None = None
        self._first_pass: set[str] = set()
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._linear_hook(name)))
            elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and hasattr(mod, "num_experts"):
                self.experts[name] = RoutedInputs(mod)
                self.handles.append(mod.register_forward_pre_hook(self._expert_hook(name)))

    def held(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _linear_hook(self, name):
        def hook(_mod, args):
            x = args[0]
            if name not in self.acc and name not in self.alias:       # first batch: share or start one
                if self._last is not None and self._last[0] is x:
                    self.alias[name] = self._last[1]
                else:
                    self.acc[name] = HessianAccumulator(x.shape[-1], device=x.device)
                    self.held(hessian_bytes(x.shape[-1]))
            if name in self.acc:
                self.acc[name].add(x)
                self._last = (x, name)
        return hook

    def _expert_hook(self, name):
        def hook(_mod, args):
            self.experts[name].add(args[0], args[1])
            self._last = None
        return hook

    def hessian(self, name: str) -> HessianAccumulator:
        key = self.alias.get(name, name)
        if key not in self.acc:
            raise CalibrationError(f"{name}: received no calibration input")
        return self.acc[key]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self._last = None


class _Results:
    """Quantized linears of a layer: written at once, or (measure) kept as candidates until allocated."""

    def __init__(self, bits, group_size: int, damp: float, stats: dict, measure: bool):
        self.bits, self.group_size, self.damp, self.stats, self.measure = bits, group_size, damp, stats, measure
        self.widths = allocate.candidates(bits) if measure else [bits]       # stored bits per weight
        self.tensors: dict[str, torch.Tensor] = {}
        self.pending: list[tuple[str, int, object]] = []         # (key, numel, set_weight) when measuring
        self.cands: dict[tuple[str, float], dict] = {}
        self.errors: dict[str, dict] = {}
        self._prepared: dict[int, tuple] = {}                   # id(Hessian) -> (Hessian, gptq.prepare of it)

    def _prepare(self, items) -> list:
        """The damped inverse of each item's Hessian: linears given the same Hessian one after another (q/k/v,
        an expert's gate and up) share one; inverses no item needs any more are freed first."""
        need = {id(h) for _, _, h, _ in items}
        self._prepared = {k: v for k, v in self._prepared.items() if k in need}
        for key, _, h, _ in items:
            if id(h) not in self._prepared:
                hh, tokens = (h.h, h.tokens) if isinstance(h, HessianAccumulator) else (h, None)
                self._prepared[id(h)] = (h, prepare(hh, damp=self.damp, tokens=tokens, name=key))
                self.stats["hessian_inverses"] = self.stats.get("hessian_inverses", 0) + 1
        return [self._prepared[id(h)][1] for _, _, h, _ in items]

    def quantize(self, key: str, w: torch.Tensor, h, set_weight) -> None:
        """h: a HessianAccumulator (its token count sets GPTQ's damping floor) or a bare Hessian."""
        self.quantize_many([(key, w, h, set_weight)])

    def quantize_many(self, items) -> None:
        """(key, weight, Hessian, set_weight) of linears of one shape (a group of experts' gate, up or down):
        GPTQ'd together, each candidate width in one column loop (gptq.quantize_gptq_many: bit for bit what
        each gets alone)."""
        preps = self._prepare(items)
        keys, ws = [k for k, _, _, _ in items], [w for _, w, _, _ in items]
        for b in self.widths:
            mix, props = fmt.stored_target(b, ws[0].shape[1], ws[0].shape[0], self.group_size)
            qs = quantize_gptq_many(ws, preps, list(mix), self.group_size, bits_prop=props, names=keys)
            for (key, w, h, set_weight), q in zip(items, qs):
                if not self.measure:
                    self._keep(key, w.numel(), w.shape[0], q, set_weight)
                    continue
                deq = fmt.dequantize(q, out_features=w.shape[0]).to(w.device)
                hh = h.h if isinstance(h, HessianAccumulator) else h
                self.errors.setdefault(key, {})[b] = (allocate.stored_bpw(q, w.numel()),
                                                      allocate.relative_error(w, deq, hh))
                self.cands[key, b] = q
        if self.measure:
            self.pending += [(key, w.numel(), w.shape[0], set_weight) for key, w, _, set_weight in items]

    def _keep(self, key, numel, out_features, q, set_weight) -> None:
        self.tensors.update({f"{key}.{k}": v for k, v in q.items()})
        self.stats["code_bits"] = self.stats.get("code_bits", 0) + allocate.code_bits(q) * numel
        self.stats["stored_bits"] = self.stats.get("stored_bits", 0) + fmt.stored_bits(q)
        self.stats["weights"] = self.stats.get("weights", 0) + numel
        set_weight(fmt.dequantize(q, out_features=out_features))

    def finish(self) -> dict[str, torch.Tensor]:
        self._prepared = {}
        if self.measure:
            chosen = allocate.allocate(self.errors, {k: n for k, n, _, _ in self.pending}, self.bits)
            for key, numel, out_features, set_weight in self.pending:
                self._keep(key, numel, out_features, self.cands[key, chosen[key]], set_weight)
            self.cands.clear()
        return self.tensors


def quantize_jobs(jobs, bits, group_size: int, damp: float, stats: dict, measure: bool,
                  experts: tuple | None = None) -> dict[str, torch.Tensor]:
    """GPTQ each (name, weight, hessian, set dequantized weight) job (layers calibrated outside this module,
    e.g. convert_qwen35.py); -> the quantized tensors. With `measure`, widths allocated as for a layer.
    `experts`: (RoutedInputs, key, hessian budget) of the layer's experts, quantized in groups as
    quantize_layer does (their module gives each expert's weights and setters by `parts(e)`)."""
    res = _Results(bits, group_size, damp, stats, measure)
    for key, w, h, set_weight in jobs:
        res.quantize(key, w, h, set_weight)
    if experts is not None:
        inputs, key, budget = experts
        res._prepared = {}
        _quantize_experts(inputs, key, res, stats, SimpleNamespace(held=lambda n: None), budget)
    return res.finish()


def _set_linear(mod):
    def set_weight(d):
        mod.weight.data = d.to(mod.weight.device)
    return set_weight


def _set_view(view):
    def set_weight(d):
        view.copy_(d)
    return set_weight


def quantize_layer(layer: torch.nn.Module, prefix: str, bits, group_size: int, damp: float, stats: dict,
                   collector: Collector, measure: bool,
                   hessian_budget: int = DEFAULT_HESSIAN_BUDGET) -> dict[str, torch.Tensor]:
    """GPTQ every linear of the layer (in place: weights become the dequantized ones); -> tensors to write.
    With `measure`, each linear's width is chosen among candidates by measured error (allocate.py)."""
    res = _Results(bits, group_size, damp, stats, measure)
    for name, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            try:
                h = collector.hessian(name)
            except CalibrationError as e:
                raise CalibrationError(f"{prefix}{e}") from None
            res.quantize(f"{prefix}{name}", mod.weight.data, h, _set_linear(mod))
    res._prepared = {}
    for key in list(collector.acc):                              # dense Hessians done with
        collector.held(-hessian_bytes(collector.acc.pop(key).h.shape[0]))
    t0 = time.perf_counter()
    for name, routed_inputs in collector.experts.items():
        _quantize_experts(routed_inputs, f"{prefix}{name}", res, stats, collector, hessian_budget)
    collector.expert_seconds = time.perf_counter() - t0
    tensors = res.finish()
    for key, value in layer.state_dict().items():                # norms, router: fp16 as they are
        if value.dim() == 1 or key.endswith("gate.weight"):
            tensors[f"{prefix}{key}"] = value.to(torch.float16).cpu()
    return tensors


def _fused_parts(mod, e: int, inter: int) -> dict:
    """Expert e of a fused experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]): part -> (weight, set
    the dequantized weight), views into the module's parameters."""
    gu, down = mod.gate_up_proj.data, mod.down_proj.data
    return {"gate_proj": (gu[e, :inter], _set_view(gu[e, :inter])),
            "up_proj": (gu[e, inter:], _set_view(gu[e, inter:])), "down_proj": (down[e], _set_view(down[e]))}


def _quantize_experts(inputs: RoutedInputs, key: str, res: _Results, stats: dict, collector,
                      budget: int) -> None:
    mod = inputs.mod
    hidden_in, inter = mod.gate_up_proj.shape[-1], mod.down_proj.shape[-1]
    counts = inputs.routed_counts()
    routed = {e: int(counts[e]) >= MIN_EXPERT_TOKENS_PER_INPUT * hidden_in for e in range(mod.num_experts)}
    group = min(mod.num_experts, experts_per_group(hidden_in, inter, budget))
    collector.experts_per_group = group
    all_in = None
    if not all(routed.values()):
        all_in = inputs.all_tokens_hessian()
        collector.held(hessian_bytes(hidden_in))
    for g0 in range(0, mod.num_experts, group):
        experts = list(range(g0, min(mod.num_experts, g0 + group)))
        hs = inputs.expert_hessians(experts, routed)
        held = sum(hessian_bytes(hidden_in) * routed[e] + hessian_bytes(inter) for e in experts)
        collector.held(held)
        for e in experts:
            stats["experts_routed" if routed[e] else "experts_all_token_fallback"] += 1
        parts = {e: mod.parts(e) if hasattr(mod, "parts") else _fused_parts(mod, e, inter) for e in experts}
        hess = {e: {"gate_proj": hs[e][0] or all_in, "up_proj": hs[e][0] or all_in, "down_proj": hs[e][1]}
                for e in experts}
        # the group's gates in one GPTQ loop, then their ups (the same inverses), then their downs
        for part in ("gate_proj", "up_proj", "down_proj"):
            res.quantize_many([(f"{key}.{e}.{part}", parts[e][part][0], hess[e][part], parts[e][part][1])
                               for e in experts])
        res._prepared = {}
        collector.held(-held)
        del hs, hess, parts
    if all_in is not None:
        collector.held(-hessian_bytes(hidden_in))
    inputs.x.clear()
    inputs.top_k.clear()
