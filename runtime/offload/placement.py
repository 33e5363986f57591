"""Placement planner: which experts stay resident in VRAM, and how each layer serves the cold ones.

Inputs: per-layer routing frequencies [L, E] (RoutingStats), the bytes of one expert per layer, the
VRAM left for experts after attention, norms, router, head and KV cache, the policy the user chose,
and the measured cost of the two cold paths on this machine:
  stream — copy the expert over PCIe into one of the layer's fixed VRAM slots, compute on the GPU;
  cpu    — compute it on the CPU from host RAM (CPU-friendly copy, maybe more bytes than the GPU form).
At batch 1 both are bound by bytes, so the expected cost of a layer's cold experts per token is
  top_k · miss_share_l · bytes_l / bandwidth_of_path          (miss_share_l = routing share not resident)
and "auto" picks the cheaper path per layer. Streaming layers need `stream_slots` VRAM slots, which
come out of the resident set, so the plan is made twice: once to choose paths, once with their slots.

Residency is a global greedy by routing share per byte: the (layer, expert) pairs that serve the most
routing per byte of VRAM go first. Uniform routing makes that an even spread across layers.
Pure numpy; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.budget import GB, BudgetError, gb


@dataclass(frozen=True)
class PathCosts:
    """Measured bandwidths of the cold paths (bytes per second) on this machine."""
    pcie_bytes_per_s: float
    cpu_bytes_per_s: float
    cpu_bytes_ratio: float = 1.0   # bytes of the CPU copy of an expert / bytes of its GPU form


@dataclass(frozen=True)
class LayerPlan:
    resident: tuple[int, ...]      # experts kept in VRAM
    cold_path: str                 # "vram" (nothing cold), "stream" or "cpu"
    stream_slots: int              # VRAM slots for streamed experts (0 unless cold_path == "stream")
    hit_share: float               # routing share served by resident experts


@dataclass(frozen=True)
class Placement:
    layers: tuple[LayerPlan, ...]
    expert_bytes: tuple[int, ...]  # bytes of one expert (GPU form) per layer
    top_k: int
    cpu_bytes_ratio: float

    @property
    def hit_rate(self) -> float:
        return float(np.mean([p.hit_share for p in self.layers]))

    @property
    def vram_bytes(self) -> int:
        return sum((len(p.resident) + p.stream_slots) * b for p, b in zip(self.layers, self.expert_bytes))

    def per_token_bytes(self) -> dict[str, float]:
        """Expected expert bytes per decoded token: read from VRAM, copied over PCIe, read by the CPU."""
        vram = pcie = cpu = 0.0
        for p, b in zip(self.layers, self.expert_bytes):
            cold = self.top_k * (1.0 - p.hit_share) * b
            vram += self.top_k * p.hit_share * b
            if p.cold_path == "stream":
                pcie += cold
                vram += cold
            elif p.cold_path == "cpu":
                cpu += cold * self.cpu_bytes_ratio
        return {"vram": vram, "pcie": pcie, "cpu": cpu}

    def paths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.layers:
            out[p.cold_path] = out.get(p.cold_path, 0) + 1
        return out


def _greedy_residency(freq: np.ndarray, expert_bytes: np.ndarray, budget: int) -> list[list[int]]:
    """Pick (layer, expert) pairs by routing share per byte until the budget is spent."""
    L, E = freq.shape
    value = freq / expert_bytes[:, None]                      # [L, E] share per byte
    order = np.argsort(-value, axis=None, kind="stable")
    cost = np.repeat(expert_bytes, E)[order]                  # bytes of each pick, in pick order
    take = order[np.cumsum(cost) <= budget]
    resident: list[list[int]] = [[] for _ in range(L)]
    for flat in take:
        resident[flat // E].append(int(flat % E))
    return [sorted(r) for r in resident]


def plan_placement(freq: np.ndarray, expert_bytes, budget_bytes: int, top_k: int, policy: str,
                   costs: PathCosts, stream_slots: int | None = None) -> Placement:
    """Plan expert placement for a VRAM budget (bytes left for experts). See the module docstring."""
    freq = np.asarray(freq, dtype=np.float64)
    L, E = freq.shape
    eb = np.asarray(expert_bytes, dtype=np.int64).reshape(L)
    slots = top_k if stream_slots is None else stream_slots
    if policy not in ("auto", "vram", "cpu", "stream"):
        raise ValueError(f"unknown placement policy {policy!r}")
    all_bytes = int(eb.sum() * E)

    def build(resident, paths):
        plans = []
        for layer in range(L):
            ids = tuple(resident[layer])
            share = float(freq[layer, list(ids)].sum()) if ids else 0.0
            path = "vram" if len(ids) == E else paths[layer]
            plans.append(LayerPlan(ids, path, slots if path == "stream" else 0, min(1.0, share)))
        return Placement(tuple(plans), tuple(int(b) for b in eb), top_k, costs.cpu_bytes_ratio)

    if all_bytes <= budget_bytes:
        return build([list(range(E))] * L, ["vram"] * L)
    if policy == "vram":
        raise BudgetError("VRAM", "all experts", all_bytes, budget_bytes, budget_bytes,
                          "choose the 'auto', 'cpu' or 'stream' placement to keep some experts in RAM")

    if policy in ("cpu", "stream"):
        paths = [policy] * L
    else:
        # Round 1: residency without slots, then the cheaper cold path per layer at that residency.
        resident = _greedy_residency(freq, eb, budget_bytes)
        paths = []
        for layer in range(L):
            miss = 1.0 - (freq[layer, resident[layer]].sum() if resident[layer] else 0.0)
            stream_s = top_k * miss * eb[layer] / costs.pcie_bytes_per_s
            cpu_s = top_k * miss * eb[layer] * costs.cpu_bytes_ratio / costs.cpu_bytes_per_s
            paths.append("stream" if stream_s < cpu_s else "cpu")
    reserve = int(sum(slots * eb[layer] for layer in range(L) if paths[layer] == "stream"))
    if reserve > budget_bytes:
        if policy == "stream":
            raise BudgetError("VRAM", f"{slots} streaming slots per layer", reserve, budget_bytes, budget_bytes,
                              "raise the VRAM budget or choose the 'cpu' placement")
        paths = ["cpu"] * L
        reserve = 0
    # Round 2: residency in what the slots leave.
    resident = _greedy_residency(freq, eb, budget_bytes - reserve)
    return build(resident, paths)


def plan_resident(freq: np.ndarray, expert_bytes, budget_bytes: int, min_per_layer: int = 0) -> list[list[int]] | None:
    """Resident experts per layer for `budget_bytes`: every layer keeps at least `min_per_layer` (its
    most chosen), the rest of the budget goes by routing share per byte (as `plan_placement`).
    None when the minimum alone does not fit."""
    freq = np.asarray(freq, dtype=np.float64)
    L, E = freq.shape
    eb = np.asarray(expert_bytes, dtype=np.int64).reshape(L)
    k = min(max(0, min_per_layer), E)
    forced_cost = int(k * eb.sum())
    if forced_cost > budget_bytes:
        return None
    order = np.argsort(-freq, axis=1, kind="stable")                 # [L, E] most chosen first
    resident = [list(order[layer, :k]) for layer in range(L)]
    value = freq / eb[:, None]
    value[np.arange(L)[:, None], order[:, :k]] = -np.inf              # already taken
    flat = np.argsort(-value, axis=None, kind="stable")[: L * (E - k)]
    cost = np.cumsum(np.repeat(eb, E)[flat])
    for f in flat[cost <= budget_bytes - forced_cost]:
        resident[f // E].append(int(f % E))
    return [sorted(int(e) for e in r) for r in resident]


@dataclass(frozen=True)
class CpuSplitCosts:
    """What the split of a layer's cold experts between the CPU and PCIe costs, measured at load."""
    pcie_bytes_per_s: float        # the GPU reading pinned host memory
    cpu_bytes_per_s: float         # the CPU kernel at one row (0: no CPU path: no threads, no kernel)
    cpu_overhead_s: float = 30e-6  # per layer and token once the CPU owns anything: copies, host node
    cpu_bytes_ratio: float = 1.0   # bytes of an expert's CPU copy / its code bytes


@dataclass(frozen=True)
class CpuSplit:
    owned: tuple[tuple[int, ...], ...]   # per layer: cold experts the CPU computes (may compute: balanced)
    stream_s: float                      # expected cold-expert seconds per token, all over PCIe
    split_s: float                       # the same with the split (per layer the slower side)
    shares: tuple[float, ...] = ()       # per layer: the CPU's planned share of the cold picks

    @property
    def gain(self) -> float:
        """Predicted speed-up of the cold-expert time (0.1 = 10% faster)."""
        return self.stream_s / self.split_s - 1.0 if self.split_s > 0 else 0.0


def plan_cpu_split(freq: np.ndarray, resident: list[list[int]], code_bytes, top_k: int,
                   costs: CpuSplitCosts, oversubscribe: float = 1.0, cut: bool = False) -> CpuSplit:
    """Per layer, the cold experts the CPU computes so that its expected time per token (fixed
    overhead + top_k * owned share * bytes / CPU rate) about equals PCIe's for the rest (top_k * share
    * bytes / PCIe rate): experts taken greedily by routing share, keeping the count that makes the
    slower side fastest. Never a resident expert; nothing without a CPU rate.

    oversubscribe > 1 (the balanced split): the CPU gets copies of that many times the experts, and
    `shares` says what part of a token's cold picks it should compute, so that a step can give it
    that part of each token's own picks (cpu/device.cpu_share_mask) rather than whatever the static set
    happens to catch.

    cut (experts cut between the two): the CPU owns every cold expert and computes the same part
    `shares[l]` of each cold pick, the GPU the rest, the part that makes both sides' expected time
    equal (overhead included); per layer, and whatever the token picks, the two sides then finish
    together up to the noise of the rates."""
    if oversubscribe < 1.0:
        raise ValueError(f"oversubscribe {oversubscribe}: at least 1")
    freq = np.asarray(freq, dtype=np.float64)
    L, E = freq.shape
    cb = np.asarray(code_bytes, dtype=np.float64).reshape(L)
    if len(resident) != L:
        raise ValueError(f"{len(resident)} resident lists for {L} layers")
    owned, shares, stream_s, split_s = [], [], 0.0, 0.0
    for layer in range(L):
        res = set(int(e) for e in resident[layer])
        cold = sorted((e for e in range(E) if e not in res), key=lambda e: (-freq[layer, e], e))
        share = np.array([freq[layer, e] for e in cold])
        if costs.pcie_bytes_per_s <= 0:
            raise ValueError("PCIe bandwidth must be positive")
        total = top_k * share.sum() * cb[layer]
        pcie_all = total / costs.pcie_bytes_per_s
        best_k, best_t, f = 0, pcie_all, 0.0
        if cut and costs.cpu_bytes_per_s > 0 and len(cold) and total > 0:
            a = costs.cpu_bytes_ratio / costs.cpu_bytes_per_s
            b = 1.0 / costs.pcie_bytes_per_s
            f = min(1.0, max(0.0, (total * b - costs.cpu_overhead_s) / (total * (a + b))))
            t = max(costs.cpu_overhead_s + total * f * a, total * (1 - f) * b)
            if f > 0 and t < pcie_all * (1 - 1e-9):
                owned.append(tuple(sorted(cold)))
                shares.append(f)
                stream_s += pcie_all
                split_s += t
                continue
            f = 0.0
        elif costs.cpu_bytes_per_s > 0 and len(cold):
            cum = top_k * np.cumsum(share) * cb[layer]                 # bytes the CPU reads owning k
            cpu_t = costs.cpu_overhead_s + cum * costs.cpu_bytes_ratio / costs.cpu_bytes_per_s
            pcie_t = (total - cum) / costs.pcie_bytes_per_s
            t = np.maximum(cpu_t, np.maximum(pcie_t, 0.0))
            k = int(np.argmin(t))
            if t[k] < best_t * (1 - 1e-9):
                best_k, best_t = k + 1, float(t[k])
                f = float(cum[k] / total) if total > 0 else 0.0
        stored = min(len(cold), int(np.ceil(best_k * oversubscribe))) if best_k else 0
        owned.append(tuple(sorted(cold[:stored])))
        shares.append(f)
        stream_s += pcie_all
        split_s += best_t
    return CpuSplit(tuple(owned), stream_s, split_s, tuple(shares))


def decode_roofline(placement: Placement, dense_gpu_bytes: float, hbm_bytes_per_s: float,
                    pcie_bytes_per_s: float, cpu_bytes_per_s: float) -> dict[str, float]:
    """Tokens/s bound of one decode step: every byte read once from where it lives.

    serial: GPU, PCIe and CPU parts one after the other; overlapped: the slowest part alone."""
    b = placement.per_token_bytes()
    return bytes_roofline(dense_gpu_bytes + b["vram"], b["pcie"], b["cpu"], hbm_bytes_per_s, pcie_bytes_per_s,
                          cpu_bytes_per_s)


def bytes_roofline(gpu_bytes: float, pcie_bytes: float, cpu_bytes: float, hbm_bytes_per_s: float,
                   pcie_bytes_per_s: float, cpu_bytes_per_s: float) -> dict[str, float]:
    """Tokens/s bound of a decode step that reads `gpu_bytes` from VRAM, copies `pcie_bytes` over PCIe
    and has the CPU read `cpu_bytes` from RAM, each at its rate (a part with no bytes takes no time)."""
    t_gpu = gpu_bytes / hbm_bytes_per_s
    t_pcie = pcie_bytes / pcie_bytes_per_s if pcie_bytes else 0.0
    t_cpu = cpu_bytes / cpu_bytes_per_s if cpu_bytes else 0.0
    return {"serial_tps": 1.0 / (t_gpu + t_pcie + t_cpu), "overlapped_tps": 1.0 / max(t_gpu, t_pcie, t_cpu),
            "gpu_s": t_gpu, "pcie_s": t_pcie, "cpu_s": t_cpu}


def describe(placement: Placement) -> str:
    paths = ", ".join(f"{n} layers {k}" for k, n in sorted(placement.paths().items()))
    return (f"{gb(placement.vram_bytes)} of experts in VRAM, expected hit rate {placement.hit_rate:.0%}; {paths}")


__all__ = ["PathCosts", "LayerPlan", "Placement", "plan_placement", "plan_resident", "decode_roofline",
           "bytes_roofline", "CpuSplitCosts", "CpuSplit", "plan_cpu_split",
           "describe", "GB"]
