"""Expert-offload statistics: the traffic counters the rooms add to, and the telemetry snapshot.

`Counters` is shared by the rooms of runtime/offload/manager.py (staging and lending add the bytes they
copy, re-placement the bytes it promotes); `OffloadTelemetry` is what `OffloadManager.telemetry()`
returns, a frozen snapshot whose `as_dict()` gives the keys the worker's telemetry event carries
(runtime/backends/exl2.py merges them into the engine's).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

MOVED = ("staged", "promoted", "naive", "lent")


@dataclass
class Counters:
    """Tokens and forwards seen, and code bytes moved per kind (MOVED); `tokens_at_reset`: the tokens
    seen when the bytes (and the layers' hit counts) last started from zero, so that per-token figures
    divide by the tokens those bytes moved for, not by the load's warm-up too."""
    tokens: int = 0
    forwards: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in MOVED})
    tokens_at_reset: int = 0

    def reset_bytes(self) -> None:
        for k in self.bytes:
            self.bytes[k] = 0
        self.tokens_at_reset = self.tokens

    @property
    def tokens_counted(self) -> int:
        """Tokens since the bytes started from zero."""
        return self.tokens - self.tokens_at_reset


@dataclass(frozen=True)
class CpuCutFigures:
    """The CPU path's cut ("cut" split): rows the CPU computes of each cold pick, and its balance."""
    rows: int
    of: int
    copied: int
    cpu_first_share: float
    cpu_idle_ms_per_token: Optional[float]
    moves: list

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class OffloadTelemetry:
    # the CPU path
    cpu_expert_ms_per_token: Optional[float]
    cpu_expert_pairs: int
    cpu_expert_owned: list
    cpu_expert_bytes_per_token: Optional[float]
    cpu_expert_path: str                          # "on", or "off: <why>"
    # placement, staging, lending, prefetch, re-placement
    expert_hit_rate: Optional[float]
    pcie_bytes_per_token: Optional[float]
    expert_pairs: int
    expert_hits: int
    expert_zero_copy_bytes: float
    expert_moved_bytes: dict
    expert_residents: list
    expert_lent: int
    expert_lent_pending: int
    expert_prefetch: Optional[dict]
    expert_prefetch_wasted_bytes: float
    expert_paths: list
    expert_path_counts: dict
    expert_promotions: int
    expert_promotions_pending: int
    expert_staging_capacity: int
    vram_budget_bytes: int
    vram_budget_used_bytes: int
    vram_budget_items: dict
    tokens_seen: int
    # present only where they apply
    cpu_expert_cut: Optional[CpuCutFigures] = None          # "cut" with the path on
    cpu_expert_signal: Optional[str] = None                 # path on: how steps wake the CPU's worker
    cpu_expert_predicted_gain: Optional[float] = None       # path on: the planner's
    cpu_expert_errors: tuple = ()                           # "layer i: <error>" from the CPU's worker

    @property
    def cpu_on(self) -> bool:
        return self.cpu_expert_path == "on"

    def as_dict(self) -> dict[str, Any]:
        """The telemetry event's keys: optional ones only where they apply (as the protocol expects)."""
        out: dict[str, Any] = {
            "cpu_expert_ms_per_token": self.cpu_expert_ms_per_token,
            "cpu_expert_pairs": self.cpu_expert_pairs,
            "cpu_expert_owned": self.cpu_expert_owned,
            "cpu_expert_bytes_per_token": self.cpu_expert_bytes_per_token,
        }
        if self.cpu_expert_cut is not None:
            out["cpu_expert_cut"] = self.cpu_expert_cut.as_dict()
        out["cpu_expert_path"] = self.cpu_expert_path
        if self.cpu_on:
            out["cpu_expert_signal"] = self.cpu_expert_signal
            out["cpu_expert_predicted_gain"] = self.cpu_expert_predicted_gain
        if self.cpu_expert_errors:
            out["cpu_expert_errors"] = list(self.cpu_expert_errors)
        skip = {"cpu_expert_ms_per_token", "cpu_expert_pairs", "cpu_expert_owned", "cpu_expert_bytes_per_token",
                "cpu_expert_path", "cpu_expert_cut", "cpu_expert_signal", "cpu_expert_predicted_gain",
                "cpu_expert_errors"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                out[f.name] = getattr(self, f.name)
        return out


def collect(layers: list, hp: list[tuple[int, int]], share, staging, prefetch, counters: Counters,
            vram) -> OffloadTelemetry:
    """The snapshot of an offload manager's rooms (runtime/offload/manager.py): its layers (slots.LayerOffload)
    and their (hits, pairs) so far, the CPU share, staging, the decode prefetch the steps run (or None), the
    traffic counters and the VRAM ledger. Read-only, any thread."""
    hits, pairs = sum(h for h, _ in hp), sum(n for _, n in hp)
    cpu = [lo.cpu.counters() if lo.cpu is not None else (0, 0, 0, 0) for lo in layers]
    # over PCIe: the cold picks the CPU left alone, and the GPU's part of those it was cut into
    cold_bytes = sum((n - h - c[2] * (lo.cpu.cpu_part() if lo.cpu is not None else 1.0)) * lo.code_bytes
                     for (h, n), c, lo in zip(hp, cpu, layers))
    # the decode prefetch: a copy picked is one of the misses above (its expert came over PCIe once);
    # a copy not picked moved its bytes for nothing
    pf = prefetch.score.tolist() if prefetch is not None else [[0] * 4] * len(layers)
    wasted = sum((s[2] - s[3]) * lo.code_bytes for s, lo in zip(pf, layers))
    moved = cold_bytes + wasted + sum(counters.bytes.values())
    calls = max((c[1] for c in cpu), default=0)
    cut = None
    if share.cut is not None and share.active:
        first = share.balance_totals()
        cut = CpuCutFigures(rows=share.cut, of=layers[0].packs[2].in_features, copied=share.cut_width,
                            cpu_first_share=first[0] / max(1, first[0] + first[1]),
                            cpu_idle_ms_per_token=first[2] / 1e6 / calls if calls else None,
                            moves=list(share.cut_log[-8:]))
    on = not share.reason
    signal = gain = None
    if on:
        from runtime.cpu.doorbell import signal_status
        signal = signal_status()
        gain = share.split.gain if share.split else None
    return OffloadTelemetry(
        cpu_expert_ms_per_token=sum(c[0] for c in cpu) / 1e6 / calls if calls else None,
        cpu_expert_pairs=sum(c[2] for c in cpu),
        cpu_expert_owned=[len(lo.cpu.owned_set) if lo.cpu is not None else 0 for lo in layers],
        cpu_expert_bytes_per_token=(sum(c[2] * lo.cpu.pick_bytes() for c, lo in zip(cpu, layers)
                                        if lo.cpu is not None) / calls if calls else None),
        cpu_expert_path="on" if on else f"off: {share.reason}",
        cpu_expert_cut=cut, cpu_expert_signal=signal, cpu_expert_predicted_gain=gain,
        cpu_expert_errors=tuple(f"layer {lo.index}: {c[3]}" for c, lo in zip(cpu, layers) if c[3]),
        expert_hit_rate=hits / pairs if pairs else None,
        pcie_bytes_per_token=moved / counters.tokens_counted if counters.tokens_counted > 0 else None,
        expert_pairs=pairs, expert_hits=hits,
        expert_zero_copy_bytes=cold_bytes, expert_moved_bytes=dict(counters.bytes),
        expert_residents=[len(lo.expert_slot) for lo in layers],
        expert_lent=sum(len(lo.lent) for lo in layers),
        expert_lent_pending=len(staging.lending),
        expert_prefetch=prefetch.telemetry() if prefetch is not None else None,
        expert_prefetch_wasted_bytes=wasted,
        expert_paths=[lo.path for lo in layers],
        expert_path_counts=path_counts(layers),
        expert_promotions=sum(lo.promotions for lo in layers),
        expert_promotions_pending=sum(len(lo.pending) for lo in layers),
        expert_staging_capacity=staging.capacity,
        vram_budget_bytes=vram.total_bytes, vram_budget_used_bytes=vram.used_bytes,
        vram_budget_items=dict(vram.items),
        tokens_seen=counters.tokens,
    )


def path_counts(layers: list) -> dict[str, int]:
    """How many layers take each expert path ("vram", "stream", "cpu+stream"), in the layers' order."""
    out: dict[str, int] = {}
    for lo in layers:
        out[lo.path] = out.get(lo.path, 0) + 1
    return out
