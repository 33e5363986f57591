"""Calibration of one decoder layer for the converter: the Hessians of its linears, GPTQ, bounded memory.

While the layer runs on the calibration hidden states, hooks on its linears sum each linear's input
Hessian 2 X^T X (linears fed the same tensor, such as q/k/v, share one). The MoE experts module is not
summed while it runs: its hook keeps the tokens it receives (float16, float32 where float16 would
overflow) and the router's top-k choice, once per layer. After the run the dense linears are quantized
and their Hessians dropped; then the experts are calibrated in groups: for a group, one pass over the
kept tokens sums each expert's gate/up Hessian from the tokens routed to it and its down Hessian from
its own intermediate activations of them (the experts fed all tokens in one matrix product per chunk of
tokens, a slice of experts at a time); then the group's gates and ups go through one batched GPTQ loop
and its downs through another, every candidate width of a measured allocation in the same loop
(gptq.quantize_stacked: on a GPU the loop's small operations are latency-bound, so one loop for a group's
experts at all their widths costs what one weight did), their errors measured where they are
(allocate.relative_errors); the group's Hessians are dropped before the next group starts. A group holds
as many experts as `hessian_budget` bytes allow (expert_bytes: Hessians, inverses, the loop's weights, codes
and measurement; at least one), so a 128- or 256-expert layer never holds all its experts' Hessians at once;
an expert's result depends only on its own weights and tokens (up to the rounding order of batched
products), so the model is the same for every budget. On a GPU the budget defaults to what it has free
(`expert_budget`), on the CPU to DEFAULT_HESSIAN_BUDGET.

An expert routed fewer than MIN_EXPERT_TOKENS_PER_INPUT x in_features tokens would be calibrated on a
nearly singular Hessian; it falls back to the Hessian of all the layer's tokens for gate/up (one inverse
for all of them) and of all tokens through its own gate/up for down_proj (counted as
experts_all_token_fallback).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from . import allocate
from . import format as fmt
from .gptq import HessianAccumulator, Prepared, prepare, prepare_many, quantize_stacked

MIN_EXPERT_TOKENS_PER_INPUT = 2      # expert tokens below this x in_features -> all-token Hessian
DEFAULT_HESSIAN_BUDGET = 2 << 30     # bytes a group of experts holds at once on the CPU
GPU_BUDGET_SHARE = 0.8               # of the GPU memory left free once the layer is in, when no budget is given
GPU_BUDGET_MARGIN = 1 << 30          # bytes kept out of it (the allocator's fragments, the next layer's run)
H_BYTES = 8                          # HessianAccumulator sums in float64
HESSIAN_SLICE = 16                   # experts fed all tokens whose activations one product computes
GATE_UP, DOWN = ("gate_proj", "up_proj"), ("down_proj",)


class CalibrationError(RuntimeError):
    """A layer that cannot be calibrated; the message names the linear."""


def hessian_bytes(width: int) -> int:
    return width * width * H_BYTES


def expert_bytes(hidden: int, inter: int, widths: int = 1, routed: bool = True) -> int:
    """What one expert of a group holds while the group is quantized: its down Hessian (and, routed, its gate/up
    one) in float64 with their inverses in float32, and its share of the batched GPTQ loop for gate and up at
    `widths` candidate widths (weights float32, codes int8, the original weights and the measurement's)."""
    n = (inter + 31) // 32 * 32
    own = hessian_bytes(inter) + inter * inter * 4 + (hessian_bytes(hidden) + hidden * hidden * 4) * routed
    return own + 2 * n * hidden * (5 * widths + 8)


def experts_per_group(hidden: int, inter: int, budget: int, widths: int = 1, routed: bool = True) -> int:
    """How many experts fit in `budget` bytes (expert_bytes; at least one)."""
    return max(1, int(budget) // expert_bytes(hidden, inter, widths, routed))


def expert_budget(device: torch.device, budget: int | None) -> int:
    """Bytes a group of experts may hold: `budget` as given; else on a GPU GPU_BUDGET_SHARE of what is free for
    this process (its memory-fraction cap counted, and what torch's allocator keeps cached), less
    GPU_BUDGET_MARGIN; on the CPU DEFAULT_HESSIAN_BUDGET."""
    if budget is not None:
        return int(budget)
    if device.type != "cuda":
        return DEFAULT_HESSIAN_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    cap = fraction * total - torch.cuda.memory_allocated(device)
    room = min(free + cached, cap)
    return max(1, int(room * GPU_BUDGET_SHARE) - GPU_BUDGET_MARGIN)


class LayerReport:
    """What one layer's quantization reports: bytes of Hessians held (now, at most), experts per group, seconds
    in the experts and per phase (`phase`: the device is synchronised at each phase's end, so a GPU's queued
    work is counted where it was queued)."""

    def __init__(self, seconds: dict[str, float] | None = None):
        self.live = self.peak = 0
        self.experts_per_group = 0
        self.expert_seconds = 0.0
        self.seconds: dict[str, float] = dict(seconds or {})

    def held(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    @contextmanager
    def phase(self, name: str, device: torch.device | None = None):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


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
        """One pass over the kept tokens for a group of experts -> ({routed expert: its gate/up accumulator},
        the down Hessians [len(experts), I, I] float64, the tokens each was summed over). A routed expert sums
        its own tokens; the others all of them, a slice of HESSIAN_SLICE experts per matrix product."""
        gu_all, inter = self.mod.gate_up_proj, self.mod.down_proj.shape[-1]
        dev = gu_all.device
        down = torch.zeros((len(experts), inter, inter), dtype=torch.float64, device=dev)
        tokens = [0] * len(experts)
        gate_up = {e: HessianAccumulator(gu_all.shape[-1], device=dev) for e in experts if routed[e]}
        fed_all = [i for i, e in enumerate(experts) if not routed[e]]
        with torch.no_grad():
            for s0 in range(0, len(fed_all), HESSIAN_SLICE):
                idx = fed_all[s0:s0 + HESSIAN_SLICE]
                gu = torch.stack([gu_all[experts[i]] for i in idx]).to(torch.float32)        # [S, 2I, H]
                acc = torch.zeros((len(idx), inter, inter), dtype=torch.float64, device=dev)
                for x in self.x:
                    y = torch.nn.functional.linear(x.to(torch.float32), gu.view(-1, gu.shape[-1]))
                    y = y.view(x.shape[0], len(idx), 2, inter)                                 # [T, S, 2, I]
                    act = (self.mod.act_fn(y[:, :, 0]) * y[:, :, 1]).transpose(0, 1)        # [S, T, I]
                    acc += torch.bmm(act.transpose(1, 2), act).to(torch.float64).mul_(2.0)
                down[idx] = acc
                for i in idx:
                    tokens[i] = sum(x.shape[0] for x in self.x)
            for i, e in enumerate(experts):
                if not routed[e]:
                    continue
                gu = gu_all[e].to(torch.float32)                  # an expert's weight read once
                for x, top in zip(self.x, self.top_k):
                    rows = x[(top == e).any(dim=-1)]
                    if rows.shape[0] == 0:
                        continue
                    rows = rows.to(torch.float32)
                    gate_up[e].add(rows)
                    gate, up = torch.nn.functional.linear(rows, gu).chunk(2, dim=-1)
                    act = self.mod.act_fn(gate) * up
                    down[i] += (act.t() @ act).to(torch.float64).mul_(2.0)
                    tokens[i] += rows.shape[0]
        return gate_up, down, tokens


class Collector(LayerReport):
    """Hooks on one layer: Hessians of its linears, the tokens of its experts modules."""

    def __init__(self, layer: torch.nn.Module, seconds: dict[str, float] | None = None):
        super().__init__(seconds)
        self.acc: dict[str, HessianAccumulator] = {}
        self.alias: dict[str, str] = {}              # linear -> the linear whose input (and Hessian) it shares
        self.experts: dict[str, RoutedInputs] = {}
        self.handles = []
        self._last: tuple[torch.Tensor, str] | None = None
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._linear_hook(name)))
            elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and hasattr(mod, "num_experts"):
                self.experts[name] = RoutedInputs(mod)
                self.handles.append(mod.register_forward_pre_hook(self._expert_hook(name)))

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
    """Quantized linears of a layer: written at once, or (measure) kept as candidates until allocated. `source`:
    a requantize.Exl2Source, whose linears not chosen to be quantized again are copied as it stores them."""

    def __init__(self, bits, group_size: int, damp: float, stats: dict, measure: bool, report: LayerReport,
                 source=None):
        self.bits, self.group_size, self.damp, self.stats, self.measure = bits, group_size, damp, stats, measure
        self.report, self.source = report, source if hasattr(source, "keeps") else None
        self.widths = allocate.candidates(bits) if measure else [bits]       # stored bits per weight
        self.tensors: dict[str, torch.Tensor] = {}
        self.pending: list[tuple] = []                  # (key, numel, out_features, set_weight, device) when measuring
        self.cands: dict[tuple[str, float], dict] = {}
        self.errors: dict[str, dict] = {}
        self._prepared: dict[int, tuple] = {}           # id(Hessian) -> (Hessian, gptq.prepare of it)

    def prepare(self, h, key: str) -> Prepared:
        """The damped inverse of a HessianAccumulator (or a bare Hessian): linears given the same Hessian one after
        another (q/k/v, the experts fed all tokens) share one; the one before is freed when another is asked for."""
        if id(h) not in self._prepared:
            hh, tokens = (h.h, h.tokens) if isinstance(h, HessianAccumulator) else (h, None)
            with self.report.phase("prepare", hh.device):
                self._prepared = {id(h): (h, prepare(hh, damp=self.damp, tokens=tokens, name=key))}
            self._count_inverses(1)
        return self._prepared[id(h)][1]

    def prepare_many(self, hs: torch.Tensor, tokens: list, keys: list[str]) -> Prepared:
        with self.report.phase("prepare", hs.device):
            prep = prepare_many(hs, damp=self.damp, tokens=tokens, names=keys)
        self._count_inverses(hs.shape[0])
        return prep

    def _count_inverses(self, n: int) -> None:
        self.stats["hessian_inverses"] = self.stats.get("hessian_inverses", 0) + n

    def quantize(self, key: str, w: torch.Tensor, h, set_weight) -> None:
        """h: a HessianAccumulator (its token count sets GPTQ's damping floor) or a bare Hessian."""
        kept = self.source.keeps(key) if self.source is not None else None
        if kept is not None:
            self.copy(key, kept, w.numel())
            return
        hh = h.h if isinstance(h, HessianAccumulator) else h
        self.run([[key]], [[w]], self.prepare(h, key), hh.unsqueeze(0), [[set_weight]])

    def _plans(self, out: int, in_features: int, key: str) -> list:
        """Each candidate width's groups: the widest mix of two adjacent widths within it (format.stored_target)."""
        plans = []
        for b in self.widths:
            mix, props = fmt.resolve_bits(*fmt.stored_target(b, in_features, out, self.group_size), name=key)
            plans.append(fmt.plan_groups(in_features, mix, props, {w: self.group_size for w in mix}))
        return plans

    def run(self, keys: list[list[str]], weights: list[list[torch.Tensor]], prep: Prepared, hessians: torch.Tensor,
            setters: list[list]) -> None:
        """GPTQ of weights[e][p] (one shape; part p of expert e shares its Hessian, prep batched over e or one for
        all) at every candidate width in one loop (gptq.quantize_stacked); hessians [E or 1, in, in] the raw ones,
        for the measured errors."""
        out, in_features = weights[0][0].shape
        fmt.quantize(weights[0][0][:1].float().cpu(), 4, self.group_size, name=keys[0][0])   # sizes and range
        plans = self._plans(out, in_features, keys[0][0])
        dev = prep.u.device
        with self.report.phase("gptq", dev):
            sets, errors = quantize_stacked(weights, prep, plans, keys, hessians if self.measure else None)
        errors = errors.tolist() if errors is not None else None
        for e, parts in enumerate(keys):
            for p, key in enumerate(parts):
                numel = out * in_features
                if not self.measure:
                    self._keep(key, numel, out, sets[e][p][0], setters[e][p], dev)
                    continue
                for c, b in enumerate(self.widths):
                    q = sets[e][p][c]
                    self.errors.setdefault(key, {})[b] = (allocate.stored_bpw(q, numel), errors[e][p][c])
                    self.cands[key, b] = q
                self.pending.append((key, numel, out, setters[e][p], dev))

    def copy(self, key: str, tensors: dict, numel: int) -> None:
        """A linear written as the source stores it (its weight in the layer already is what those hold)."""
        if tensors is None:
            raise CalibrationError(f"{key}: not in the model being requantized")
        self.tensors.update({f"{key}.{k}": v for k, v in tensors.items()})
        code = allocate.code_bits(tensors) if "q_weight" in tensors else 16
        self.stats["code_bits"] = self.stats.get("code_bits", 0) + code * numel
        self.stats["stored_bits"] = self.stats.get("stored_bits", 0) + fmt.stored_bits(tensors)
        self.stats["weights"] = self.stats.get("weights", 0) + numel
        self.stats["linears_copied"] = self.stats.get("linears_copied", 0) + 1

    def _keep(self, key, numel, out_features, q, set_weight, device) -> None:
        self.tensors.update({f"{key}.{k}": v for k, v in q.items()})
        self.stats["code_bits"] = self.stats.get("code_bits", 0) + allocate.code_bits(q) * numel
        self.stats["stored_bits"] = self.stats.get("stored_bits", 0) + fmt.stored_bits(q)
        self.stats["weights"] = self.stats.get("weights", 0) + numel
        set_weight(fmt.dequantize(q, out_features=out_features, device=device))

    def finish(self) -> dict[str, torch.Tensor]:
        self._prepared = {}
        if self.measure:
            t0 = time.perf_counter()
            chosen = allocate.allocate(self.errors, {k: n for k, n, _, _, _ in self.pending}, self.bits)
            self.report.seconds["allocate"] = self.report.seconds.get("allocate", 0.0) + time.perf_counter() - t0
            for key, numel, out_features, set_weight, dev in self.pending:
                with self.report.phase("dequantize", dev):
                    self._keep(key, numel, out_features, self.cands[key, chosen[key]], set_weight, dev)
            self.cands.clear()
        return self.tensors


def quantize_jobs(jobs, bits, group_size: int, damp: float, stats: dict, measure: bool,
                  experts: tuple | None = None, report: LayerReport | None = None, source=None) -> dict[str, torch.Tensor]:
    """GPTQ each (name, weight, hessian, set dequantized weight) job (layers calibrated outside this module,
    e.g. convert_qwen35.py); -> the quantized tensors. With `measure`, widths allocated as for a layer.
    `experts`: (RoutedInputs, key, hessian budget or None) of the layer's experts, quantized in groups as
    quantize_layer does (their module gives each expert's weights and setters by `parts(e)`); `source` as _Results'."""
    report = report or LayerReport()
    res = _Results(bits, group_size, damp, stats, measure, report, source)
    for key, w, h, set_weight in jobs:
        res.quantize(key, w, h, set_weight)
    if experts is not None:
        inputs, key, budget = experts
        res._prepared = {}
        t0 = time.perf_counter()
        _quantize_experts(inputs, key, res, stats, report, budget)
        report.expert_seconds += time.perf_counter() - t0
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
                   hessian_budget: int | None = DEFAULT_HESSIAN_BUDGET, source=None) -> dict[str, torch.Tensor]:
    """GPTQ every linear of the layer (in place: weights become the dequantized ones); -> tensors to write.
    With `measure`, each linear's width is chosen among candidates by measured error (allocate.py); `source`
    as _Results'."""
    res = _Results(bits, group_size, damp, stats, measure, collector, source)
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


def _quantize_experts(inputs: RoutedInputs, key: str, res: _Results, stats: dict, report: LayerReport,
                      budget: int | None) -> None:
    mod = inputs.mod
    hidden_in, inter = mod.gate_up_proj.shape[-1], mod.down_proj.shape[-1]
    dev = mod.gate_up_proj.device
    counts = inputs.routed_counts()
    chosen = list(range(mod.num_experts)) if res.source is None else res.source.requantized(key, counts)
    for e in sorted(set(range(mod.num_experts)) - set(chosen)):          # requantizing: the others as stored
        for part in GATE_UP + DOWN:
            res.copy(f"{key}.{e}.{part}", res.source.stored(f"{key}.{e}.{part}"), hidden_in * inter)
    routed = {e: int(counts[e]) >= MIN_EXPERT_TOKENS_PER_INPUT * hidden_in for e in chosen}
    group = min(max(1, len(chosen)), experts_per_group(hidden_in, inter, expert_budget(torch.device(dev), budget),
                                                       len(res.widths), any(routed.values())))
    report.experts_per_group = group
    fed_all = None
    if chosen and not all(routed.values()):
        with report.phase("hessians", dev):
            all_in = inputs.all_tokens_hessian()
        report.held(hessian_bytes(hidden_in))
        fed_all = (res.prepare(all_in, f"{key} (all tokens)"), all_in.h.unsqueeze(0))
    for g0 in range(0, len(chosen), group):
        experts = chosen[g0:g0 + group]
        with report.phase("hessians", dev):
            gate_up, down, tokens = inputs.expert_hessians(experts, routed)
        held = sum(hessian_bytes(hidden_in) * routed[e] + hessian_bytes(inter) for e in experts)
        report.held(held)
        for e in experts:
            stats["experts_routed" if routed[e] else "experts_all_token_fallback"] += 1
        parts = {e: mod.parts(e) if hasattr(mod, "parts") else _fused_parts(mod, e, inter) for e in experts}

        def run(es, names, prep, hessians):
            res.run([[f"{key}.{e}.{p}" for p in names] for e in es], [[parts[e][p][0] for p in names] for e in es],
                    prep, hessians, [[parts[e][p][1] for p in names] for e in es])
        # gate and up of the experts fed all tokens: one shared inverse; of the routed ones: each its own
        if fed_all is not None and not all(routed[e] for e in experts):
            run([e for e in experts if not routed[e]], GATE_UP, *fed_all)
        mine = [e for e in experts if routed[e]]
        if mine:
            hs = torch.stack([gate_up[e].h for e in mine])
            run(mine, GATE_UP, res.prepare_many(hs, [gate_up[e].tokens for e in mine],
                                                [f"{key}.{e}.gate_proj" for e in mine]), hs)
        del gate_up
        run(experts, DOWN, res.prepare_many(down, tokens, [f"{key}.{e}.down_proj" for e in experts]), down)
        report.held(-held)
        del down, parts
    if fed_all is not None:
        report.held(-hessian_bytes(hidden_in))
    res._prepared = {}
    inputs.x.clear()
    inputs.top_k.clear()
