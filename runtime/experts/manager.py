"""Expert offload for a whole model: placement in a VRAM budget, prefill staging, re-placement, telemetry.

- **Placement** (`place`): after every other allocation, the VRAM left (minus prefill scratch) is
  split into two double-buffered staging areas and hot slots per layer, chosen by
  runtime/experts/placement.py from the routing statistics (uniform when none are known).
- **Decode / verify** (few rows): the kernels read hot experts from VRAM and cold ones from pinned
  host memory in place (offload.py): nothing to schedule, graph-capturable.
- **Prefill** (many rows, `STAGE_PAIRS_PER_EXPERT` pairs per expert or more): the grouped kernels
  would read a cold expert over PCIe once per block of rows, so a layer's cold experts are first
  copied into a VRAM staging buffer on a side stream (one copy per run of consecutive cold
  experts), double-buffered: layer l+1's copy overlaps layer l's compute. The layer then runs with
  an offset table that points cold experts into the buffer.
- **Staging lent between prefills** (`MOEDESK_LEND_STAGING`, on by default): the staging buffers
  are idle while decoding, so after a prefill their pages are filled with the cold experts routed most
  (side stream) and the tables point at them: more picks read from VRAM, fewer over PCIe or by the
  CPU. They stay cold for the placement and the CPU keeps their copies; before the next forward
  that stages (or the naive baseline) every one goes back to host memory first (`_reclaim_staging`).
- **Re-placement** (`step_boundary`, before each forward): routing counts are copied to the host
  without waiting (read at a later boundary); an expert whose decayed count beats the weakest
  resident's by a margin swaps in (offload.py's evict/promote/poll, never a host sync).
- **CPU path** (placements "auto" and "cpu"; runtime/experts/cpu_path.py): after each placement,
  the CPU gets copies of the first rows of every cold expert ("cut", the default: the part that
  balances its expected time against PCIe's for the rest, placement.plan_cpu_split, from measured
  rates; moved while decoding by `_rebalance`), or of whole experts ("experts"); "auto" takes it where
  the predicted gain is worth it and host RAM holds the copies. Decode steps compute the CPU's part
  inside the step's graph while the GPU kernels compute the rest. A promoted expert goes back to the
  GPU, an evicted one with a CPU copy to the CPU (offload.py); the owned sets are planned anew only
  at the next placement. Verify rows and prefill keep the GPU paths.
- **Decode prefetch** (runtime/experts/prefetch.py, `MOEDESK_PREFETCH` pages, 1 by default on a GPU):
  after each MoE layer of a decode step, the next layer's router applied to the residual stream
  predicts its picks, and the likeliest cold one is copied into a VRAM page on a side stream while
  host RAM is idle (that layer's attention); copying runs only while 90% of the predictions come true.
- **Naive baseline** (`naive = True`, benchmark only, no graphs): every cold expert a step needs is
  copied into VRAM on demand after a host synchronisation per layer, nothing overlapped.

Letters: L MoE layers, E experts per layer, A experts per token, C staging capacity (experts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from runtime import tuning
from runtime.experts.budget import BudgetError, MemoryBudget
from runtime.experts.cpu_experts import CpuExpertsError
from runtime.experts.layer import ExpertLayer
from runtime.experts.offload import LayerOffload, cold_base, inference_mode_methods, word_distance
from runtime.experts.pack import PackedExperts
from runtime.experts.placement import CpuSplit, CpuSplitCosts, plan_cpu_split, plan_resident
from runtime.experts import prefetch as decode_prefetch
from runtime.experts.routing_stats import RoutingStats

log = logging.getLogger(__name__)
STAGE_PAIRS_PER_EXPERT = 2     # stage a layer's cold experts when rows x top-k >= this x E
CPU_OVERHEAD_S = 30e-6         # CPU path, per layer and token: copies to and from pinned memory, signals
AUTO_CPU_MIN_GAIN = 0.10       # "auto" takes the CPU path from this predicted gain (placement "cpu": any gain)
# "auto" takes the CPU path where the planner predicts this gain and host RAM holds the copies; on the
# H200 (q125-a11, uniform routing, doorbell signalling, experts cut) it decoded 40.0-40.6 tok/s at 24 GB
# against 27.4-30.1 without it in the same runs, 30.1 against 20.3 at 12 GB, for CPU copies in host RAM, a
# longer load and all but two cores busy while generating (runtime/experts/NOTES.md).
# MOEDESK_AUTO_CPU_PATH=0 leaves it to "cpu".
AUTO_CPU = tuning.current().auto_cpu_path


def _cpu_balance(text: str) -> float:
    """MOEDESK_CPU_BALANCE: 0 (off) or the factor of CPU copies for the balanced split (>= 1)."""
    try:
        v = float(text or 0)
    except ValueError:
        v = -1.0
    if not (v == 0 or v >= 1):
        raise ValueError(f"MOEDESK_CPU_BALANCE={text!r}: want 0 (off) or the copies' factor, at least 1 (e.g. 1.5)")
    return v


def _cpu_split_mode(text: str) -> str:
    if text not in ("cut", "experts"):
        raise ValueError(f"MOEDESK_CPU_SPLIT={text!r}: want 'cut' (each cold expert cut between CPU and GPU) "
                         "or 'experts' (whole experts to either side)")
    return text


# How a layer's cold picks are shared: "cut" (the default where the layout allows it) gives the CPU the
# first part of every cold pick's intermediate features and the GPU the rest, in the ratio of their
# rates, re-balanced while decoding (`_rebalance`); "experts" gives each pick whole to one side (the
# balanced or static split below).
CPU_SPLIT = tuning.current().cpu_split
CUT_HEADROOM = 128        # "cut": CPU copies this many rows wider than the planned cut
REBALANCE_EVERY = 16      # forwards between looks at the balance ("cut")
REBALANCE_KEEP = 512      # ... forwards a cut's measured step time is trusted
REBALANCE_GAIN = 0.01     # ... how much faster a measured neighbour must be to move there

# The balanced split (MOEDESK_CPU_SPLIT=experts; MOEDESK_CPU_BALANCE=0 gives the static split): CPU copies
# of this many times the experts the static split would own, and each decode step gives the CPU its
# planned share of the token's own cold picks (cpu_path.CpuPath.set_share) instead of every owned pick.
CPU_BALANCE = tuning.current().cpu_balance

# Staging pages lent to cold experts between prefills (0: off, to compare).
LEND_STAGING = tuning.current().lend_staging


@inference_mode_methods
class OffloadManager:
    def __init__(self, layers: list[ExpertLayer], vram: MemoryBudget, policy: str = "auto",
                 stats: Optional[RoutingStats] = None, stats_file: Optional[Path] = None,
                 replace_every: int = 16, max_promotions: int = 2, margin: float = 0.25,
                 cpu_threads: int = 0, ram: Optional[MemoryBudget] = None,
                 prefetch_pages: Optional[int] = None):
        if not layers:
            raise ValueError("offload needs at least one MoE layer")
        self.layers = [LayerOffload(layer, i) for i, layer in enumerate(layers)]
        for lo in self.layers:
            lo.layer.offload = lo
            lo.manager = self
        self.E = layers[0].num_experts
        self.top_k = layers[0].top_k
        self.device = self.layers[0].device
        self.cuda = self.device.type == "cuda"
        self.vram = vram
        self.policy = "stream" if policy in ("auto", "cpu") else policy
        self.cpu_policy = policy                           # "cpu", or "auto" (with AUTO_CPU): the CPU path
        self.cpu_threads, self.ram = cpu_threads, ram
        self.cpu_reason = "not placed yet"                 # why no layer uses the CPU path ("" when some do)
        self.cpu_split: Optional[CpuSplit] = None
        self.cpu_predicted_gain: Optional[float] = None    # the planner's, also where "auto" left the path off
        self.cpu_unavailable = ""                          # why no CPU path can run at all ("" when one can)
        self._parked = None          # CPU paths set aside while the GPU-only path is timed: (paths, split, cut)
        self.on_stage = lambda message: None   # says which part of a placement runs (the load's progress)
        self.cut: Optional[int] = None                    # "cut": rows of each cold pick the CPU computes
        self.cut_log: list[tuple[int, int, float]] = []    # (forward, new cut, CPU-first share that moved it)
        self._balance_prev = (0, 0, 0)
        self.rebalance_cut = True                          # False: the cut stays (benchmarks of fixed cuts)
        self._cut_ms: dict[int, tuple[float, int]] = {}    # cut -> (ms per decode step there, at forward)
        self._window: list[float] = []                     # decode step times (s) since the last look
        self._t_prev: Optional[float] = None               # when the previous forward started, if one row
        self.stats = stats or RoutingStats.empty(len(layers), self.E)
        self.stats_file = stats_file
        self.replace_every, self.max_promotions, self.margin = replace_every, max_promotions, margin
        self.naive = False
        self._exclude = False
        self.stage_min_pairs = STAGE_PAIRS_PER_EXPERT * self.E
        self.lock = threading.Lock()
        self.side = torch.cuda.Stream(self.device) if self.cuda else None        # promotions
        self.stage_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stage: list[list[torch.Tensor]] = []          # [buffer][projection] int32 [C, K/per, N]
        self.stage_capacity = 0
        self.ready = [self._event(), self._event()]        # staging copy done (stage stream)
        self.free = [self._event(), self._event()]         # buffer's last reader done (compute stream)
        self.free_recorded = [False, False]
        self._staged: dict[int, int] = {}                  # layer -> buffer, copies queued
        self._next_buf = 0
        self._using: dict[int, int] = {}                   # layer -> buffer, being computed
        self.lend_staging = LEND_STAGING and self.cuda      # the pages are VRAM only on a GPU (tests set it)
        self._lending: list[tuple[int, int, int]] = []     # (layer, expert, page): copies queued, not yet pointed
        self._lend_event = None                            # those copies done (side stream)
        # Decode prefetch (runtime/experts/prefetch.py): pages per layer, on a GPU by default.
        self.prefetch_pages = (decode_prefetch.PAGES if self.cuda else 0) if prefetch_pages is None else prefetch_pages
        self.prefetch: Optional[decode_prefetch.DecodePrefetch] = None
        self.tokens = 0
        self.forwards = 0
        self.bytes = {"staged": 0, "promoted": 0, "naive": 0, "lent": 0}
        self._snap_host = torch.zeros((len(layers), self.E), dtype=torch.int32,
                                      pin_memory=self.cuda)
        self._snap_event = None
        self._snap_tokens = 0
        self._counts_prev = np.zeros((len(layers), self.E), dtype=np.int64)
        self._tokens_prev = 0

    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    # -- placement ---------------------------------------------------------------------------------

    def code_bytes(self) -> list[int]:
        return [lo.code_bytes for lo in self.layers]

    def place(self, free_bytes: Optional[int] = None, freq: Optional[np.ndarray] = None) -> None:
        """Fill hot slots and staging from `free_bytes` of VRAM (default: what the ledger has left
        once the current slots and staging are given back). Nothing may be queued that reads the
        current slots: load time, or a new budget after a synchronisation.

        Staging for C < E experts (twice: double-buffered) needs every layer to keep at least
        E + 1 - C resident (+ 1: a promotion in flight keeps two experts cold at once); each C is
        planned and the one serving the most routing share from VRAM wins."""
        cb = self.code_bytes()
        freq = self.stats.frequencies() if freq is None else np.asarray(freq, dtype=np.float64)
        for key in ("hot experts", "prefill staging", "decode prefetch"):
            self.vram.release(key)
        if free_bytes is None:
            free_bytes = self.vram.free_bytes
        if sum(cb) * self.E <= free_bytes:
            self.apply([list(range(self.E))] * len(self.layers), 0)
            return
        free_bytes -= self.prefetch_pages * max(cb)              # the decode prefetch's pages
        if self.policy == "vram":
            raise BudgetError("VRAM", "all experts", sum(cb) * self.E, free_bytes, self.vram.total_bytes,
                              "choose the 'auto' or 'stream' placement to keep some experts in RAM")
        best, best_share = None, -1.0
        for capacity in range(1, self.E + 1):
            least = 0 if capacity == self.E else self.E + 1 - capacity      # no resident: no promotion
            resident = plan_resident(freq, cb, free_bytes - 2 * capacity * max(cb), least)
            if resident is None:
                continue
            share = sum(float(freq[i, r].sum()) for i, r in enumerate(resident))
            if share > best_share + 1e-12:
                best, best_share = (resident, capacity), share
        if best is None:                      # not even staging for one layer's experts
            raise BudgetError("VRAM", "prefill staging", 2 * max(cb), free_bytes, self.vram.total_bytes,
                              "two experts' codes must fit beside the model; raise the VRAM budget")
        self.apply(*best)

    def apply(self, resident: list[list[int]], capacity: Optional[int] = None) -> None:
        """Give each layer slots for its `resident` experts and fill them; staging for `capacity`
        cold experts (default: the most any layer leaves cold, + 1). Reserved in the VRAM ledger."""
        if len(resident) != len(self.layers):
            raise ValueError(f"{len(resident)} resident lists for {len(self.layers)} MoE layers")
        cb = self.code_bytes()
        most_cold = max(self.E - len(r) for r in resident)
        if capacity is None:
            capacity = min(self.E, most_cold + 1) if most_cold else 0
        if most_cold and capacity < min(self.E, most_cold + 1):
            raise ValueError(f"staging for {capacity} experts, a layer leaves {most_cold} cold (+ 1 in flight)")
        for key in ("hot experts", "prefill staging", "decode prefetch"):
            self.vram.release(key)
        if self.cuda:                                   # lending copies may still write the old pages
            torch.cuda.synchronize(self.device)
        self._lending, self._lend_event = [], None
        self.prefetch = None
        self.stage, self.stage_capacity = [], 0
        self._drop_cpu_paths()
        for lo in self.layers:
            lo.set_slots(0)
        if self.cuda:
            torch.cuda.empty_cache()
        self.vram.reserve("prefill staging", 2 * capacity * max(cb),
                          "lower the context length or raise the VRAM budget")
        self.vram.reserve("hot experts", sum(len(r) * b for r, b in zip(resident, cb)))
        if most_cold and self.prefetch_pages:
            self.vram.reserve("decode prefetch", self.prefetch_pages * max(cb),
                              "set MOEDESK_PREFETCH=0, or raise the VRAM budget")
        if capacity:
            for lo in self.layers:
                for p, q in zip(lo.packs, self.layers[0].packs):
                    if p.cold.shape[1:] != q.cold.shape[1:]:
                        raise ValueError(f"layer {lo.index}: expert shapes differ from layer 0's; "
                                         "staging assumes one shape")
            self.stage = [[torch.empty((capacity,) + tuple(p.cold.shape[1:]), dtype=torch.int32, device=self.device)
                           for p in self.layers[0].packs] for _ in range(2)]
            self.stage_capacity = capacity
        self.on_stage("Placing experts: filling the hot experts' slots")
        for lo, r in zip(self.layers, resident):
            lo.set_slots(len(r))
            lo.fill(r, self.side)
        self._staged.clear()
        if most_cold and self.prefetch_pages:
            self.prefetch = decode_prefetch.DecodePrefetch(self, self.prefetch_pages)
            self.prefetch.place()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._build_cpu_paths(resident)
        log.info("expert placement: %s", ", ".join(f"{n} layers {k}" for k, n in self.path_counts().items()))

    # -- the CPU path ----------------------------------------------------------------------------------

    @property
    def cpu_active(self) -> bool:
        return any(lo.cpu is not None for lo in self.layers)

    def _drop_cpu_paths(self) -> None:
        self._close_parked()
        for lo in self.layers:
            if lo.cpu is not None:
                lo.cpu.close()                        # its RAM back to the ledger
                lo.cpu = None

    def set_cpu_path(self, on: bool, reason: str = "measured slower", keep: bool = False) -> bool:
        """Between forwards (graphs dropped by the caller): the CPU path on for the current resident
        sets, whatever the predicted gain, or off; True if it runs afterwards. keep: off, with the
        CPU copies set aside (not freed), so that turning it on again is immediate (measuring both)."""
        # Lent experts back to host memory first: measuring PCIe for the split writes a staging page.
        self._reclaim_staging()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if on and self._parked is not None:
            paths, self.cpu_split, self.cut = self._parked
            self._parked = None
            for lo, cpu in zip(self.layers, paths):
                lo.cpu = cpu
                if cpu is not None:            # ownership after promotions and lending while set aside
                    lo._write_entries(list(range(self.E)))
            self.cpu_reason = ""
        elif not on and keep and self.cpu_active:
            self._close_parked()
            self._parked = ([lo.cpu for lo in self.layers], self.cpu_split, self.cut)
            for lo in self.layers:
                lo.cpu = None
            self.cpu_split, self.cut, self.cpu_reason = None, None, reason
        else:
            self._drop_cpu_paths()
            self.cpu_split, self.cut = None, None
            if on:
                self._build_cpu_paths([sorted(lo.expert_slot) for lo in self.layers], force=True)
            else:
                self.cpu_reason = reason
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self.cpu_active

    def _close_parked(self) -> None:
        if self._parked is not None:
            for cpu in self._parked[0]:
                if cpu is not None:
                    cpu.close()
            self._parked = None

    def _build_cpu_paths(self, resident: list[list[int]], force: bool = False) -> None:
        """After a placement: CPU copies of the cold experts the CPU computes best (or none, and why).
        force: whatever gain the rates predict ("auto" measuring both paths)."""
        from runtime.experts import cpu_path
        self.cpu_split = None
        self.cpu_predicted_gain, self.cpu_unavailable = None, ""
        if self.cpu_policy != "cpu" and not (self.cpu_policy == "auto" and AUTO_CPU):
            self.cpu_reason = self.cpu_unavailable = (
                "MOEDESK_AUTO_CPU_PATH=0 leaves the CPU expert path to placement 'cpu'"
                if self.cpu_policy == "auto" else f"placement '{self.cpu_policy}'")
            return
        if all(len(r) == self.E for r in resident):
            self.cpu_reason = self.cpu_unavailable = "every expert is in VRAM"
            return
        try:
            from runtime import cpu_load
            threads = cpu_path.resolve_threads(self.cpu_threads,
                                               None if self.cpu_threads else cpu_load.measure_others())
            self.on_stage("Placing experts: measuring the CPU's and PCIe's rates")
            costs = self._split_costs(resident, threads)
        except CpuExpertsError as e:
            self.cpu_reason = self.cpu_unavailable = f"the CPU expert kernel is unavailable: {e}"
            return
        from runtime.experts.kernels import CUT_ALIGN
        from runtime.experts.pack import intermediate_aligned
        I = self.layers[0].packs[2].in_features
        cut_mode = (CPU_SPLIT == "cut" and I % CUT_ALIGN == 0 and I >= 2 * CUT_ALIGN
                    and all(intermediate_aligned(lo.packs[2]) for lo in self.layers))
        split = plan_cpu_split(self.stats.frequencies(), resident, self.code_bytes(), self.top_k, costs,
                               oversubscribe=1.0 if cut_mode else max(1.0, CPU_BALANCE), cut=cut_mode)
        self.cpu_predicted_gain = split.gain
        if self.cpu_policy == "auto" and split.gain < AUTO_CPU_MIN_GAIN and not force:
            self.cpu_reason = f"the measured rates predict a gain of {split.gain:.0%} (< {AUTO_CPU_MIN_GAIN:.0%})"
            return
        if not any(split.owned):
            self.cpu_reason = self.cpu_unavailable = (f"at the measured rates (CPU {costs.cpu_bytes_per_s / 1e9:.1f} GB/s, PCIe "
                               f"{costs.pcie_bytes_per_s / 1e9:.1f} GB/s) no cold expert is worth the CPU")
            return
        cut = width = None
        if cut_mode:                          # one cut for all layers: their ratio of rates is the same
            f = float(np.mean([s for s, o in zip(split.shares, split.owned) if o]))
            cut = int(min(I, max(CUT_ALIGN, round(f * I / CUT_ALIGN) * CUT_ALIGN)))
            width = min(I, cut + max(CUT_HEADROOM, CUT_ALIGN))
        self.on_stage("Placing experts: copying cold experts for the CPU")
        try:
            for lo, owned, share in zip(self.layers, split.owned, split.shares):
                if owned:
                    lo.cpu = cpu_path.CpuPath(lo.packs, owned, self.top_k, threads, f"MoE layer {lo.index}",
                                              self.ram, self.device, width=width)
                    for e in owned:
                        lo.cpu.own(e, True)
                    if cut is not None:
                        lo.cpu.set_cut(cut)
                    elif CPU_BALANCE:
                        lo.cpu.set_share(share)
        except BudgetError as e:
            self._drop_cpu_paths()
            if self.cpu_policy == "cpu":
                raise
            self.cpu_reason = self.cpu_unavailable = f"host RAM is short for the CPU copies ({e})"   # "auto": stream
            log.warning("CPU expert path left out: %s", self.cpu_reason)
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.cpu_split, self.cpu_reason = split, ""
        self.cut, self.cut_log, self._cut_ms, self._window = cut, [], {}, []
        self._balance_prev = self.balance_totals()
        log.info("CPU expert path: %d threads, %s experts%s; predicted cold-expert time %.0f -> %.0f us/token",
                 threads, sum(len(o) for o in split.owned),
                 f", the first {cut} of {I} intermediate rows of each" if cut is not None else "",
                 split.stream_s * 1e6, split.split_s * 1e6)

    def balance_totals(self) -> tuple[int, int, int]:
        """(CPU first, GPU first, ns of CPU idle) summed over the layers' CPU paths so far."""
        t = [lo.cpu.balance() for lo in self.layers if lo.cpu is not None]
        return tuple(int(sum(v)) for v in zip(*t)) if t else (0, 0, 0)

    @property
    def cut_width(self) -> int:
        """"cut": the intermediate rows every layer's CPU copies hold, the most the cut can be."""
        return min(lo.cpu.width for lo in self.layers if lo.cpu is not None)

    def set_cut(self, rows: int) -> None:
        """Every layer's cut to `rows` (a multiple of CUT_ALIGN within the copies), the stream
        synchronised first; "cut" only."""
        if self.cut is None:
            raise ValueError("the CPU path does not cut experts here (MOEDESK_CPU_SPLIT, placement, layout)")
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        for lo in self.layers:
            if lo.cpu is not None:
                lo.cpu.set_cut(rows)
        if self.cuda:                                   # the device values written before any stream reads them
            torch.cuda.current_stream(self.device).synchronize()
        self.cut = int(rows)

    def _rebalance(self) -> None:
        """"cut": climb to the cut whose decode steps are fastest, one CUT_ALIGN step at a time.

        Every REBALANCE_EVERY forwards the current cut's step time is measured (the median of the
        window's decode steps, so a graph capture or a lending copy in the window does not move it;
        averaged with its last fresh value). Then: a neighbouring cut measured REBALANCE_GAIN faster
        is taken; else a neighbour not measured within REBALANCE_KEEP forwards is tried (first the
        side the worker's counts point at: more rows to the CPU when it finished first more often);
        else the cut stays. Times, not the counts, decide: across runs the fastest cut had the CPU
        finishing first in 12% to 78% of layer calls (runtime/experts/NOTES.md). Between forwards,
        with the stream synchronised (the worker's copy of the cut changes at once)."""
        from runtime.experts.kernels import CUT_ALIGN
        steps, self._window = sorted(self._window), []
        if len(steps) < REBALANCE_EVERY // 2 or not self.cpu_active:   # a prefill or pause in the window
            return
        fresh = {c: ms for c, (ms, at) in self._cut_ms.items() if self.forwards - at <= REBALANCE_KEEP}
        ms = steps[len(steps) // 2] * 1e3
        if self.cut in fresh:
            ms = (ms + fresh[self.cut]) / 2
        self._cut_ms[self.cut] = (ms, self.forwards)
        fresh[self.cut] = ms
        now = self.balance_totals()
        cpu_first, gpu_first = now[0] - self._balance_prev[0], now[1] - self._balance_prev[1]
        self._balance_prev = now
        share = cpu_first / (cpu_first + gpu_first) if cpu_first + gpu_first else 0.5
        up, down = self.cut + CUT_ALIGN, self.cut - CUT_ALIGN
        near = [c for c in ((up, down) if share >= 0.5 else (down, up)) if CUT_ALIGN <= c <= self.cut_width]
        faster = [c for c in near if c in fresh and fresh[c] < ms * (1 - REBALANCE_GAIN)]
        untried = [c for c in near if c not in fresh]
        new = min(faster, key=fresh.get) if faster else untried[0] if untried else None
        if new is None:
            return
        self.set_cut(new)
        self.cut_log.append((self.forwards, new, round(share, 3)))
        self._balance_prev = self.balance_totals()

    def _time_step(self, rows: int) -> None:
        """Decode step times for _rebalance: the time from one one-row forward's start to the next's."""
        t = time.perf_counter()
        if self._t_prev is not None and t - self._t_prev < 1.0:     # not a pause between two requests
            self._window.append(t - self._t_prev)
        self._t_prev = t if rows == 1 else None

    def _split_costs(self, resident: list[list[int]], threads: int) -> CpuSplitCosts:
        """Measured once per process: the CPU kernel's rate (on the layer with the most cold experts)
        and, on a GPU, pinned host-to-device bandwidth."""
        from runtime.experts import cpu_path
        lo = max(self.layers, key=lambda l: self.E - len(resident[l.index]))
        cold = [e for e in range(self.E) if e not in set(resident[lo.index])]
        cpu = cpu_path.cpu_bytes_per_s(lo.packs, cold, self.top_k, threads)
        if self.cuda and self.stage:                  # into a staging buffer: scratch between steps
            pcie = cpu_path.pcie_bytes_per_s(lo.packs[0].cold, self.stage[0][0])
        else:
            pcie = cpu_path.PCIE_GUESS
        ratio = cpu_path.cpu_expert_bytes(lo.packs) / lo.code_bytes
        return CpuSplitCosts(pcie, cpu, CPU_OVERHEAD_S, ratio)

    def path_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lo in self.layers:
            out[lo.path] = out.get(lo.path, 0) + 1
        return out

    # -- the layer's hook ----------------------------------------------------------------------------

    def stage_worth(self, rows: int) -> bool:
        return rows * self.top_k >= self.stage_min_pairs and self.stage_capacity > 0

    def begin_forward(self, rows: int) -> None:
        """Called by the engine before a forward of `rows` tokens (after `step_boundary`): start
        staging the first layer. Prefill-sized forwards stay out of the hit rate (their pairs are
        accounted up to here now, and dropped at the next boundary)."""
        self._staged.clear()
        if self.prefetch is not None:
            self.prefetch.begin()
        if self.stage_worth(rows) or self.naive:
            self._reclaim_staging()
        if rows * self.top_k >= self.stage_min_pairs:
            for lo in self.layers:
                lo.account()
            self._exclude = True
        if self.stage_worth(rows) and not self.naive:
            nxt = self._next_stream_layer(-1)
            if nxt is not None:
                self._start_stage(nxt)

    def before(self, lo: LayerOffload, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        """The projections (with the offset tables) this layer's kernels use for this call."""
        if lo.path == "vram":
            return tuple(lo.packs)
        if self.naive:
            return self._naive(lo, rows, ids)
        if not self.stage_worth(rows):
            return tuple(lo.packs)
        b = self._staged.pop(lo.index, None)
        if b is None:
            b = self._start_stage(lo.index)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[b])
        nxt = self._next_stream_layer(lo.index)
        if nxt is not None and nxt not in self._staged:
            self._start_stage(nxt)
        self._using[lo.index] = b
        return tuple(self._staged_pack(lo, j, b) for j in range(3))

    def after(self, lo: LayerOffload) -> None:
        b = self._using.pop(lo.index, None)
        if b is not None:
            if self.cuda:
                self.free[b].record(torch.cuda.current_stream(self.device))
                self.free_recorded[b] = True

    def _next_stream_layer(self, index: int) -> Optional[int]:
        for lo in self.layers[index + 1:]:
            if lo.path != "vram":
                return lo.index
        return None

    def _runs(self, lo: LayerOffload) -> list[tuple[int, int]]:
        """Runs (first expert, length) of consecutive cold experts, in expert order."""
        runs: list[tuple[int, int]] = []
        for e in lo.cold():
            if runs and runs[-1][0] + runs[-1][1] == e:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((e, 1))
        return runs

    def _start_stage(self, index: int) -> int:
        """Queue the copies of layer `index`'s cold experts into the next staging buffer."""
        lo = self.layers[index]
        b = self._next_buf
        self._next_buf ^= 1
        n = len(lo.cold())
        if n > self.stage_capacity:
            raise RuntimeError(f"layer {index}: {n} cold experts for {self.stage_capacity} staging places")
        if self.cuda:
            s = self.stage_stream
            if self.free_recorded[b]:
                s.wait_event(self.free[b])             # the buffer's previous layer has been computed
            with torch.cuda.stream(s):
                self._copy_runs(lo, b)
            self.ready[b].record(s)
        else:
            self._copy_runs(lo, b)
        self._staged[index] = b
        self.bytes["staged"] += n * lo.code_bytes
        return b

    def _copy_runs(self, lo: LayerOffload, b: int) -> None:
        r = 0
        for e0, n in self._runs(lo):
            for j, p in enumerate(lo.packs):
                self.stage[b][j][r:r + n].copy_(p.cold[e0:e0 + n], non_blocking=True)
            r += n

    def _staged_pack(self, lo: LayerOffload, j: int, b: int) -> PackedExperts:
        """Projection j with a table pointing cold experts at their place in staging buffer b
        (place = rank among the layer's cold experts, computed from the mask on the device)."""
        p = lo.packs[j]
        cold = 1 - lo.mask.long()
        rank = torch.cumsum(cold, 0) - cold
        base = word_distance(self.stage[b][j], p.qweight)
        tab = torch.where(lo.mask.bool(), p.woff, base + rank * p.words_per_expert)
        return dataclasses.replace(p, woff=tab)

    def _naive(self, lo: LayerOffload, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        """Baseline: host sync, then copy every cold expert the rows chose into staging buffer 0."""
        chosen = set(ids.reshape(-1).tolist())                      # the host synchronisation
        need = [e for e in sorted(chosen) if e not in lo.expert_slot]
        out = []
        for j, p in enumerate(lo.packs):
            tab = lo.table(j)
            base = word_distance(self.stage[0][j], p.qweight)
            for i, e in enumerate(need):
                self.stage[0][j][i].copy_(p.cold[e], non_blocking=True)
                tab[e] = base + i * p.words_per_expert
            out.append(dataclasses.replace(p, woff=torch.tensor(tab, dtype=torch.int64).to(self.device)))
        self.bytes["naive"] += len(need) * lo.code_bytes
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return tuple(out)

    # -- between steps: re-placement -------------------------------------------------------------------

    def step_boundary(self, rows: int) -> None:
        """Before each forward (the engine calls it): finish promotions, maybe start new ones."""
        with self.lock:
            if self._exclude:                          # the previous forward was prefill-sized
                for lo in self.layers:
                    lo.skip_counted()
                self._exclude = False
            self.tokens += rows
            self.forwards += 1
            if self.cpu_split is not None:
                from runtime.experts import cpu_path
                if self.cut is not None and self.rebalance_cut and not self.naive:
                    if self.forwards % REBALANCE_EVERY == 0:
                        self._rebalance()
                        self._t_prev = None             # a move synchronises: not part of a step's time
                    self._time_step(rows)
                cpu_path.kick()                         # the worker polls its doorbell without pause again
            for lo in self.layers:
                if lo.pending:
                    lo.poll()
            if self._lending:
                self._finish_lending()
            elif (self.lend_staging and self.stage_capacity and not self.naive and not self.stage_worth(rows)
                  and not any(lo.lent for lo in self.layers)):
                self._start_lending()
            if self.replace_every and self.forwards % self.replace_every == 0 and not self.naive:
                self._replace_round()
            if self.prefetch is not None and not self.naive:
                self.prefetch.boundary(self.forwards)

    # -- staging pages lent to cold experts between prefills -------------------------------------------

    def _page(self, k: int) -> list[torch.Tensor]:
        """Page k of the staging buffers (2 x C of them): one expert's place, one tensor per projection."""
        b, r = divmod(k, self.stage_capacity)
        return [self.stage[b][j][r] for j in range(3)]

    def lend_plan(self) -> list[tuple[int, int]]:
        """(layer, expert) for each page: the cold experts routed most per byte, in rank order within
        each layer so that equal shares (uniform statistics) spread over the layers evenly. Planned
        when nothing is lent or on its way; experts on their way to a slot are left out."""
        freq = self.stats.frequencies()
        items = []
        for lo in self.layers:
            cold = [e for e in lo.cold() if e not in lo.pending]
            cold.sort(key=lambda e: -freq[lo.index, e])
            items += [(-float(freq[lo.index, e]) / lo.code_bytes, rank, lo.index, e) for rank, e in enumerate(cold)]
        items.sort()
        return [(l, e) for _, _, l, e in items[: 2 * self.stage_capacity]]

    def _start_lending(self) -> None:
        """Copy the planned experts into the pages on the side stream, after the work queued so far
        (the last forward that staged read them); their entries move at a later boundary."""
        plan = self.lend_plan()
        if not plan:
            return
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            self.side.wait_stream(self.stage_stream)
        with torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext():
            for k, (l, e) in enumerate(plan):
                for t, p in zip(self._page(k), self.layers[l].packs):
                    t.copy_(p.cold[e], non_blocking=True)
        if self.cuda:
            self._lend_event = torch.cuda.Event()
            self._lend_event.record(self.side)
        self._lending = [(l, e, k) for k, (l, e) in enumerate(plan)]
        self.bytes["lent"] += sum(self.layers[l].code_bytes for l, _ in plan)

    def _finish_lending(self) -> None:
        """Point the lent experts at their pages once the copies are done (never waited for)."""
        if self._lend_event is not None and not self._lend_event.query():
            return
        by_layer: dict[int, dict[int, list[torch.Tensor]]] = {}
        for l, e, k in self._lending:
            by_layer.setdefault(l, {})[e] = self._page(k)
        for l, pages in by_layer.items():
            self.layers[l].lend(pages)
        self._lending, self._lend_event = [], None

    def _reclaim_staging(self) -> None:
        """Before a forward that stages (or the naive baseline, which copies into staging too): every
        lent expert back to host memory, and the staging copies ordered after the steps that read the
        pages and after the copies that filled them."""
        back = sum(len(lo.unlend()) for lo in self.layers)
        if not back and not self._lending:
            return
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            if self._lend_event is not None:
                cur.wait_event(self._lend_event)
            self.stage_stream.wait_stream(cur)
        self._lending, self._lend_event = [], None

    def settle_lending(self) -> None:
        """Wait for lending copies in flight and point their experts (tests, benchmarks)."""
        if self._lending:
            if self._lend_event is not None:
                self._lend_event.synchronize()
            self._finish_lending()

    # -- re-placement ----------------------------------------------------------------------------------

    def _replace_round(self) -> None:
        if self._snap_event is not None:
            if self.cuda and not self._snap_event.query():
                return
            self._absorb(self._snap_host.numpy().astype(np.int64), self._snap_tokens)
            self.decide()
        counts = torch.stack([lo.layer.counts for lo in self.layers])        # [L, E] on the device
        self._snap_host.copy_(counts, non_blocking=True)
        self._snap_tokens = self.tokens
        self._snap_event = self._event() or True
        if self.cuda:
            self._snap_event.record(torch.cuda.current_stream(self.device))

    def _absorb(self, counts: np.ndarray, tokens: int) -> None:
        window = (counts - self._counts_prev) % (1 << 32)                 # the device counters are int32
        self._counts_prev = counts
        self.stats.absorb(window, max(0, tokens - self._tokens_prev))
        self._tokens_prev = tokens

    def decide(self) -> list[tuple[int, int, int]]:
        """Swap in cold experts whose decayed routing count beats the weakest resident's by the
        margin (and by more than counting noise), strongest gains first, at most `max_promotions`;
        one copy in flight per layer.
        Returns (layer, evicted, promoted)."""
        score = self.stats.counts
        moves = []
        for lo in self.layers:
            if lo.pending or not lo.expert_slot or lo.path == "vram":
                continue
            s = score[lo.index]
            lending = {e for l, e, _ in self._lending if l == lo.index}
            cold = [e for e in lo.cold() if e not in lo.lent and e not in lending]      # lent: in VRAM already
            if not cold:
                continue
            best = max(cold, key=lambda e: s[e])
            victim = min(lo.expert_slot, key=lambda e: s[e])
            gain = s[best] - s[victim]
            # a real shift, not the noise of counting: beyond the margin and 4 sigma of the counts' difference
            if gain > max(1.0, self.margin * s[victim], 4.0 * np.sqrt(s[best] + s[victim])):
                moves.append((gain, lo.index, victim, best))
        moves.sort(reverse=True)
        done = []
        for _, index, victim, best in moves[: self.max_promotions]:
            self.swap(index, victim, best)
            done.append((index, victim, best))
        return done

    def swap(self, index: int, victim: int, new: int) -> None:
        """Evict `victim` (table first), then copy `new` into its slot on the side stream."""
        lo = self.layers[index]
        if new in lo.expert_slot or new in lo.pending:
            raise ValueError(f"layer {index}: expert {new} is already resident or on its way")
        if victim not in lo.expert_slot:
            raise ValueError(f"layer {index}: expert {victim} is not resident")
        if lo.pending:                        # staging holds the cold experts + one in flight, no more
            raise ValueError(f"layer {index}: a promotion is still in flight")
        slot = lo.evict(victim)
        lo.promote(new, slot, self.side)
        self.bytes["promoted"] += lo.code_bytes

    # -- telemetry and persistence ---------------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        with self.lock:
            hp = [lo.hit_counts() for lo in self.layers]
        hits, pairs = sum(h for h, _ in hp), sum(n for _, n in hp)
        cpu = [lo.cpu.counters() if lo.cpu is not None else (0, 0, 0, 0) for lo in self.layers]
        # over PCIe: the cold picks the CPU left alone, and the GPU's part of those it was cut into
        cold_bytes = sum((n - h - c[2] * (lo.cpu.cpu_part() if lo.cpu is not None else 1.0)) * lo.code_bytes
                         for (h, n), c, lo in zip(hp, cpu, self.layers))
        # the decode prefetch: a copy picked is one of the misses above (its expert came over PCIe once);
        # a copy not picked moved its bytes for nothing
        pf = self.prefetch.score.tolist() if self.prefetch is not None else [[0] * 4] * len(self.layers)
        wasted = sum((s[2] - s[3]) * lo.code_bytes for s, lo in zip(pf, self.layers))
        moved = cold_bytes + wasted + sum(self.bytes.values())
        calls = max((c[1] for c in cpu), default=0)
        cpu_tel = {
            "cpu_expert_ms_per_token": sum(c[0] for c in cpu) / 1e6 / calls if calls else None,
            "cpu_expert_pairs": sum(c[2] for c in cpu),
            "cpu_expert_owned": [len(lo.cpu.owned_set) if lo.cpu is not None else 0 for lo in self.layers],
            "cpu_expert_bytes_per_token": (sum(c[2] * lo.cpu.pick_bytes() for c, lo in zip(cpu, self.layers)
                                               if lo.cpu is not None) / calls if calls else None),
        }
        if self.cut is not None and self.cpu_active:
            first = self.balance_totals()
            cpu_tel["cpu_expert_cut"] = {
                "rows": self.cut, "of": self.layers[0].packs[2].in_features,
                "copied": self.cut_width,
                "cpu_first_share": first[0] / max(1, first[0] + first[1]),
                "cpu_idle_ms_per_token": first[2] / 1e6 / calls if calls else None,
                "moves": list(self.cut_log[-8:])}
        if self.cpu_reason:
            cpu_tel["cpu_expert_path"] = f"off: {self.cpu_reason}"
        else:
            cpu_tel["cpu_expert_path"] = "on"
            from runtime.experts import cpu_path
            cpu_tel["cpu_expert_signal"] = cpu_path.signal_status()
            cpu_tel["cpu_expert_predicted_gain"] = self.cpu_split.gain if self.cpu_split else None
        bad = [f"layer {lo.index}: {c[3]}" for c, lo in zip(cpu, self.layers) if c[3]]
        if bad:
            cpu_tel["cpu_expert_errors"] = bad
        return cpu_tel | {
            "expert_hit_rate": hits / pairs if pairs else None,
            "pcie_bytes_per_token": moved / self.tokens if self.tokens else None,
            "expert_pairs": pairs, "expert_hits": hits,
            "expert_zero_copy_bytes": cold_bytes, "expert_moved_bytes": dict(self.bytes),
            "expert_residents": [len(lo.expert_slot) for lo in self.layers],
            "expert_lent": sum(len(lo.lent) for lo in self.layers),
            "expert_lent_pending": len(self._lending),
            "expert_prefetch": self.prefetch.telemetry() if self.prefetch is not None else None,
            "expert_prefetch_wasted_bytes": wasted,
            "expert_paths": [lo.path for lo in self.layers],
            "expert_path_counts": self.path_counts(),
            "expert_promotions": sum(lo.promotions for lo in self.layers),
            "expert_promotions_pending": sum(len(lo.pending) for lo in self.layers),
            "expert_staging_capacity": self.stage_capacity,
            "vram_budget_bytes": self.vram.total_bytes, "vram_budget_used_bytes": self.vram.used_bytes,
            "vram_budget_items": dict(self.vram.items),
            "tokens_seen": self.tokens,
        }

    def forget_warmup(self) -> None:
        """After the load's warm-up (random tokens): the hit counts, moved bytes and prefetch scores
        start from zero, so the figures say what answers did (routing statistics keep what was seen)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for lo in self.layers:
            lo.skip_counted()
            lo.hits.zero_()
            lo.pairs.zero_()
        self.bytes = {k: 0 for k in self.bytes}
        if self.prefetch is not None:
            self.prefetch.reset_score()

    def save_stats(self) -> None:
        """Absorb the counts since the last snapshot and write the statistics file (a sync: at close)."""
        if self.stats_file is None:
            return
        counts = torch.stack([lo.layer.counts for lo in self.layers]).cpu().numpy().astype(np.int64)
        self._absorb(counts, self.tokens)
        try:
            self.stats.save(self.stats_file)
        except OSError as e:
            log.warning("could not save routing statistics to %s: %s", self.stats_file, e)

    def close(self) -> None:
        if self.cuda:          # promotions and lending copies may still write slots and pages freed below
            torch.cuda.synchronize(self.device)
        self._lending, self._lend_event = [], None
        self.prefetch = None
        self.save_stats()
        self._drop_cpu_paths()
        for lo in self.layers:
            lo.layer.offload = None
        self.layers = []
        self.stage = []


def cold_offsets_ok(lo: LayerOffload) -> bool:
    """Every table entry points at the expert's slot, its lent page, or its place in host memory (for tests)."""
    for j, p in enumerate(lo.packs):
        for e in range(lo.num_experts):
            want = (lo.expert_slot[e] * p.words_per_expert if e in lo.expert_slot
                    else lo.lent[e][j] if e in lo.lent else cold_base(p) + e * p.words_per_expert)
            if lo.tables_host[j][e] != want or int(p.woff[e]) != want:
                return False
    return True
