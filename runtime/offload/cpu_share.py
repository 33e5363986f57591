"""What the CPU computes of the cold experts: which ones, which rows of each (the cut), moved while decoding.

- **CPU path** (placements "auto" and "cpu"; runtime/cpu/path.py): after each placement,
  the CPU gets copies of the first rows of every cold expert ("cut", the default: the part that
  balances its expected time against PCIe's for the rest, placement.plan_cpu_split, from measured
  rates; moved while decoding by `rebalance`), or of whole experts ("experts"); "auto" takes it where
  the predicted gain is worth it and host RAM holds the copies. Decode steps compute the CPU's part
  inside the step's graph while the GPU kernels compute the rest. A promoted expert goes back to the
  GPU, an evicted one with a CPU copy to the CPU (offload.py); the owned sets are planned anew only
  at the next placement. Verify rows and prefill keep the GPU paths.

How a layer's cold picks are shared: "cut" (wherever the layout allows it) gives the CPU the first part of
every cold pick's intermediate features and the GPU the rest, in the ratio of their rates, re-balanced while
decoding (`rebalance`); it beat whole experts to either side at every budget measured (40.6 against 37.0
tok/s at 24 GB, docs/engine-notes.md). Elsewhere ("experts", or a test asking for it) each pick goes whole to
one side, balanced: CPU copies of CPU_BALANCE times the experts a static split would own, and each decode
step gives the CPU its planned share of the token's own cold picks (cpu_path.CpuPath.set_share).

"auto" takes the CPU path where the planner predicts AUTO_CPU_MIN_GAIN and host RAM holds the copies,
then keeps it only where timed decode steps say it is faster (path_judge.py); its cost is CPU copies in
host RAM, a longer load and all but two cores busy while generating. What it gained on the H200, run by
run: docs/engine-notes.md. Placement "stream" leaves it out.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Generator, Iterator, Optional, TypeVar

import numpy as np
import torch

from runtime.budget import BudgetError, MemoryBudget
from runtime.cpu.experts import CpuExpertsError
from runtime.inference_mode import inference_mode_methods
from runtime.offload.experiment import NO_EXPERIMENT, Experiment
from runtime.offload.placement import CpuSplit, CpuSplitCosts, plan_cpu_split
from runtime.offload.routing_stats import RoutingStats
from runtime.offload.slots import LayerOffload
from runtime.offload.staging import Staging

log = logging.getLogger(__name__)
CPU_OVERHEAD_S = 30e-6         # CPU path, per layer and token: copies to and from pinned memory, signals
AUTO_CPU_MIN_GAIN = 0.10       # "auto" takes the CPU path from this predicted gain (placement "cpu": any gain)
CPU_SPLIT = "cut"              # how cold picks are shared where the layout allows a cut (module docstring)
CPU_BALANCE = 1.5              # balanced split of whole experts: CPU copies of this many times the static split's
CUT_HEADROOM = 128        # "cut": CPU copies at least this many rows wider than the planned cut ...
CUT_ROOM = 0.25           # ... and this share of the expert's rows wider where the RAM budget holds it
REBALANCE_EVERY = 16      # forwards between looks at the balance ("cut")
REBALANCE_KEEP = 512      # ... forwards a cut's measured step time is trusted
REBALANCE_GAIN = 0.01     # ... how much faster a measured neighbour must be to move there
CUT_STEPS = 32            # a move of the cut shifts at least 1/CUT_STEPS of every cut pick's rows (`cut_stride`)


@inference_mode_methods
class CpuShare:
    """The layers' CPU paths (LayerOffload.cpu), why there are none, and the cut they share.

    policy: the placement ("cpu", "auto", or another, which leaves the CPU out). The split (CPU_SPLIT) and
    the balance of whole experts (CPU_BALANCE) are read at construction (tests set others)."""

    def __init__(self, layers: list[LayerOffload], staging: Staging, stats: RoutingStats, policy: str,
                 threads: int, ram: Optional[MemoryBudget]):
        self.layers, self.staging, self.stats = layers, staging, stats
        self.E = layers[0].num_experts
        self.top_k = layers[0].layer.top_k
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        self.policy, self.threads, self.ram = policy, threads, ram
        self.on_stage: Callable[[str], None] = lambda message: None   # a placement's parts, said (the load's progress)
        self.split_mode, self.balance = CPU_SPLIT, CPU_BALANCE
        self.experiment: Experiment = NO_EXPERIMENT
        self.reason = "not placed yet"                 # why no layer uses the CPU path ("" when some do)
        self.split: Optional[CpuSplit] = None
        self.predicted_gain: Optional[float] = None    # the planner's, also where "auto" left the path off
        self.unavailable = ""                          # why no CPU path can run at all ("" when one can)
        self._parked = None          # CPU paths set aside while the GPU-only path is timed: (paths, split, cut)
        self._building: Optional[list] = None    # a stepped build's copies so far, per layer (not active yet)
        self.cut: Optional[int] = None                    # "cut": rows of each cold pick the CPU computes
        self.cut_log: list[tuple[int, int, float]] = []    # (forward, new cut, CPU-first share that moved it)
        self._balance_prev = (0, 0, 0)
        self._cut_ms: dict[int, tuple[float, int]] = {}    # cut -> (ms per decode step there, at forward)
        self._window: list[float] = []                     # decode step times (s) since the last look
        self._t_prev: Optional[float] = None               # when the previous forward started, if one row
        # "auto": an earlier load of this model at this budget on this machine timed the CPU path
        # slower (gpu_offload.start reads the saved decision): the next placement builds no copies
        # (the judge would drop them; the H200's first load spent 29 s copying them), and says this
        # reason. Once; the judge's own measurement builds them (force).
        self.saved_off = ""
        self.planned_for = ""           # what routing the CPU's share was planned for (telemetry, logs)
        # whether the load will measure a routing prior and place again (the manager's prior_reason)
        self.prior_due = False
        self.skipped_for_prior = False  # the last placement made no copies, waiting for the prior's

    @property
    def active(self) -> bool:
        return any(lo.cpu is not None for lo in self.layers)

    @property
    def team(self) -> Optional[int]:
        """The CPU path's thread team (resolved from `threads`), where one runs."""
        return next((int(lo.cpu.ctx.threads) for lo in self.layers if lo.cpu is not None), None)

    def drop(self) -> None:
        self.release_parked()
        self._close_building()          # a build in progress stops at its next step
        for lo in self.layers:
            if lo.cpu is not None:
                lo.cpu.close()                        # its RAM back to the ledger
                lo.cpu = None

    def set_path(self, on: bool, reason: str = "measured slower", keep: bool = False) -> bool:
        """Between forwards (graphs dropped by the caller): the CPU path on for the current resident
        sets, whatever the predicted gain, or off; True if it runs afterwards. keep: off, with the
        CPU copies set aside (not freed), so that turning it on again is immediate (measuring both)."""
        return run_steps(self.set_path_steps(on, reason, keep))

    def set_path_steps(self, on: bool, reason: str = "measured slower",
                       keep: bool = False) -> Generator[str, None, bool]:
        """set_path one bounded step at a time, a message yielded after each; returns whether the
        path runs. Only turning it on with no copies set aside takes more than one step (build_steps:
        one a layer's copies); forwards may run between the steps, on the GPU-only path, and the
        caller drops the graphs they captured once the path is on."""
        # Lent experts back to host memory first: measuring PCIe for the split writes a staging page.
        self.staging.reclaim()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if on and self._parked is not None:
            paths, self.split, self.cut = self._parked
            self._parked = None
            for lo, cpu in zip(self.layers, paths):
                lo.cpu = cpu
                if cpu is not None:            # ownership after promotions and lending while set aside
                    lo.write_entries(list(range(self.E)))
            self.reason = ""
        elif not on and keep and self.active:
            self.release_parked()
            self._parked = ([lo.cpu for lo in self.layers], self.split, self.cut)
            for lo in self.layers:
                lo.cpu = None
            self.split, self.cut, self.reason = None, None, reason
        else:
            self.drop()
            self.split, self.cut = None, None
            if on:
                yield from self.build_steps([sorted(lo.expert_slot) for lo in self.layers], force=True)
            else:
                self.reason = reason
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self.active

    def release_parked(self) -> None:
        """The CPU copies set aside while the GPU-only path was timed (keep=True) freed, their RAM back
        to the ledger: once a trial has decided, they were planned for the statistics and placement of
        that trial, and a later one builds its own."""
        if self._parked is not None:
            for cpu in self._parked[0]:
                if cpu is not None:
                    cpu.close()
            self._parked = None

    def _close_building(self) -> None:
        if self._building is not None:
            for cpu in self._building:
                if cpu is not None:
                    cpu.close()                   # its RAM back to the ledger
            self._building = None

    def build(self, resident: list[list[int]], force: bool = False) -> None:
        """After a placement: CPU copies of the cold experts the CPU computes best (or none, and why).
        force: whatever gain the rates predict ("auto" measuring both paths)."""
        run_steps(self.build_steps(resident, force))

    def build_steps(self, resident: list[list[int]], force: bool = False) -> Iterator[str]:
        """build one bounded step at a time, a message yielded after each: the rates, then one MoE
        layer's copies a step (the worker's idle time: a command waits for one step at most; 9 s for
        all layers of q125-a11 at 24 GB on the H200). The copies take effect only in the last step
        (lo.cpu, ownership, cut), so forwards between the steps run the GPU-only path, never half of
        the CPU's. Stopped midway (the generator closed, or `drop`: a new placement, a switch, the
        manager closed), the copies made so far are freed."""
        self._close_building()                    # a build in progress is superseded
        paths = self._building = [None] * len(self.layers)
        try:
            yield from self._build(resident, force, paths)
        finally:
            if self._building is paths:           # stopped midway, or no copies were wanted
                self._close_building()

    def _build(self, resident: list[list[int]], force: bool, paths: list) -> Iterator[str]:
        from runtime.cpu import path as cpu_path
        self.split = None
        self.predicted_gain, self.unavailable = None, ""
        self.skipped_for_prior = False
        if self.policy not in ("cpu", "auto"):
            self.reason = self.unavailable = f"placement '{self.policy}'"
            return
        if all(len(r) == self.E for r in resident):
            self.reason = self.unavailable = "every expert is in VRAM"
            return
        try:
            from runtime import cpu_load
            from runtime.cpu import experts as cpu_experts
            if not cpu_experts.kernel_loaded():       # its first build on a machine: ~30 s, said as such
                self.on_stage("Placing experts: building the CPU expert kernel")
                cpu_experts.load_kernel()
            threads = cpu_path.resolve_threads(self.threads, None if self.threads else cpu_load.measure_others())
            self.on_stage("Placing experts: measuring the CPU's and PCIe's rates")
            threads = threads if self.threads else self._team(resident, threads)
            costs = self._split_costs(resident, threads)
        except CpuExpertsError as e:
            self.reason = self.unavailable = f"the CPU expert kernel is unavailable: {e}"
            return
        yield "measured the CPU's and PCIe's rates"
        if self._building is not paths:           # dropped meanwhile: a new placement or switch
            return
        planned = self._planned(resident, costs, force)
        if planned is not None:
            yield from self._copies(paths, threads, *planned)

    def _planned(self, resident: list[list[int]], costs: CpuSplitCosts, force: bool):
        """The CPU's share of the cold experts at the measured rates, and the cut where experts are cut:
        (split, cut, width), or None with the reason set (no gain, nothing worth it, a routing prior or a
        saved decision coming)."""
        from runtime.experts.decode import CUT_ALIGN
        from runtime.experts.pack import intermediate_aligned
        I = self.layers[0].packs[2].in_features
        cut_mode = (self.split_mode == "cut" and I % CUT_ALIGN == 0 and I >= 2 * CUT_ALIGN
                    and all(intermediate_aligned(lo.packs[2]) for lo in self.layers))
        freq = self.stats.frequencies()
        split = self._plan(freq, resident, costs, cut_mode)
        self.predicted_gain = split.gain
        self.planned_for = "the routing statistics"
        if force and not any(split.owned):
            # Measuring both paths: the statistics (after a routing prior: one calibration prompt) may
            # route next to nothing to the cold experts, and then the plan gives the CPU nothing to
            # compute, so there would be no CPU path to time. The routing the answers get may differ
            # (another prompt, forced routing in a benchmark): the CPU's share is planned as if every
            # expert were picked equally often, and the timed steps decide.
            split = self._plan(np.full_like(freq, 1.0 / self.E), resident, costs, cut_mode)
            self.planned_for = (f"uniform routing (the statistics route {cold_share(freq, resident):.1%} of "
                                "the picks to cold experts)")
        if self.policy == "auto" and self.prior_due and not force:
            # the load places the experts again by the routing prior it measures next: copies made
            # now would be dropped then (9 s of copying on the H200 for q125-a11 at 24 GB)
            self.reason = "no CPU copies before the routing prior's placement"
            self.skipped_for_prior = True
            return None
        if self.policy == "auto" and split.gain < AUTO_CPU_MIN_GAIN and not force:
            self.reason = f"the measured rates predict a gain of {split.gain:.0%} (< {AUTO_CPU_MIN_GAIN:.0%})"
            return None
        if not any(split.owned):
            self.reason = self.unavailable = (
                f"at the measured rates (CPU {costs.cpu_bytes_per_s / 1e9:.1f} GB/s, PCIe "
                f"{costs.pcie_bytes_per_s / 1e9:.1f} GB/s) and {self.planned_for} no cold expert is worth the CPU")
            return None
        saved, self.saved_off = self.saved_off, ""
        if saved and self.policy == "auto" and not force:
            self.reason = saved               # timed slower on an earlier load: no copies to drop again
            return None
        cut = width = None
        if cut_mode:                          # one cut for all layers: their ratio of rates is the same
            f = float(np.mean([s for s, o in zip(split.shares, split.owned) if o]))
            cut = int(min(I, max(CUT_ALIGN, round(f * I / CUT_ALIGN) * CUT_ALIGN)))
            width = self._copy_width(I, cut, CUT_ALIGN, split.owned)
        return split, cut, width

    def _copies(self, paths: list, threads: int, split: CpuSplit, cut: Optional[int],
                width: Optional[int]) -> Iterator[str]:
        """The CPU's copies, one MoE layer's a step, then the path on; a short RAM budget or page-locked memory
        leaves "auto" streaming (and says why), placement "cpu" failing."""
        from runtime.cpu import path as cpu_path
        self.on_stage("Placing experts: copying cold experts for the CPU")
        try:
            for i, (lo, owned) in enumerate(zip(self.layers, split.owned)):
                if owned:
                    paths[i] = cpu_path.CpuPath(lo.packs, owned, self.top_k, threads, f"MoE layer {lo.index}",
                                                self.ram, self.device, width=width)
                    yield f"copied MoE layer {lo.index}'s cold experts for the CPU ({i + 1} of {len(self.layers)})"
                    if self._building is not paths:   # dropped meanwhile: its copies were freed there
                        return
        except BudgetError as e:
            self.drop()
            if self.policy == "cpu":
                raise
            self.reason = self.unavailable = f"the RAM budget is short for the CPU copies ({e})"   # "auto": stream
            log.warning("CPU expert path left out: %s", self.reason)
            return
        except (MemoryError, RuntimeError) as e:          # page-locked buffers, the copies themselves
            self.drop()
            if self.policy == "cpu":
                raise
            self.reason = self.unavailable = alloc_failure(e)
            log.warning("CPU expert path left out: %s", self.reason)
            return
        self._activate(paths, split, cut)
        self.split, self.reason = split, ""
        self.cut, self.cut_log, self._cut_ms, self._window = cut, [], {}, []
        self._balance_prev = self.balance_totals()
        log.info("CPU expert path: %d threads, %s experts%s; predicted cold-expert time %.0f -> %.0f us/token",
                 threads, sum(len(o) for o in split.owned),
                 f", the first {cut} of {self.layers[0].packs[2].in_features} intermediate rows of each"
                 if cut is not None else "", split.stream_s * 1e6, split.split_s * 1e6)

    def _activate(self, paths: list, split: CpuSplit, cut: Optional[int]) -> None:
        """A build's last step: its copies become the layers' CPU paths. Ownership as the experts are
        now: one promoted or lent while the copies were made stays the GPU's."""
        if self.cuda:                             # steps that forwards queued between the build's steps
            torch.cuda.synchronize(self.device)
        self._building = None
        for lo, cpu, owned, share in zip(self.layers, paths, split.owned, split.shares):
            if cpu is None:
                continue
            lo.cpu = cpu
            for e in owned:
                cpu.own(e, lo.table_words(e) is None)
            if cut is not None:
                cpu.set_cut(cut)
            elif self.balance:
                cpu.set_share(share)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _plan(self, freq: np.ndarray, resident: list[list[int]], costs: CpuSplitCosts, cut_mode: bool) -> CpuSplit:
        return plan_cpu_split(freq, resident, [lo.code_bytes for lo in self.layers], self.top_k, costs,
                              oversubscribe=1.0 if cut_mode else max(1.0, self.balance), cut=cut_mode)

    def _team(self, resident: list[list[int]], limit: int) -> int:
        """Automatic threads: the team sized from the CPU kernel's rates measured at `limit` threads and
        fewer (cpu_path.sized_team), on the layer _split_costs measures (its rate then comes from the cache)."""
        from runtime.cpu import path as cpu_path
        lo = max(self.layers, key=lambda l: self.E - len(resident[l.index]))
        cold = [e for e in range(self.E) if e not in set(resident[lo.index])]
        threads, rates = cpu_path.sized_team(lo.packs, cold, self.top_k, limit)
        log.info("CPU expert path: %d of %d threads (GB/s by team: %s)", threads, limit,
                 ", ".join(f"{t}: {r / 1e9:.1f}" for t, r in sorted(rates.items())))
        return threads

    def _split_costs(self, resident: list[list[int]], threads: int) -> CpuSplitCosts:
        """Measured once per process: the CPU kernel's rate (on the layer with the most cold experts)
        and, on a GPU, pinned host-to-device bandwidth."""
        from runtime.cpu import path as cpu_path
        lo = max(self.layers, key=lambda l: self.E - len(resident[l.index]))
        cold = [e for e in range(self.E) if e not in set(resident[lo.index])]
        cpu = cpu_path.cpu_bytes_per_s(lo.packs, cold, self.top_k, threads)
        if self.cuda and self.staging.buffers:         # into a staging buffer: scratch between steps
            pcie = cpu_path.pcie_bytes_per_s(lo.packs[0].cold, self.staging.buffers[0][0])
        else:
            pcie = cpu_path.PCIE_GUESS
        ratio = cpu_path.cpu_expert_bytes(lo.packs) / lo.code_bytes
        return CpuSplitCosts(pcie, cpu, CPU_OVERHEAD_S, ratio)

    def _copy_width(self, I: int, cut: int, align: int, owned: list) -> int:
        """The copies' rows for a planned cut (`copy_widths`): wide where the RAM budget holds every
        owned expert's copy at that width with a tenth of it to spare, else narrow."""
        from runtime.cpu import path as cpu_path
        narrow, wide = copy_widths(I, cut, align)
        if wide == narrow or self.ram is None:
            return wide
        need = cpu_path.cpu_copies_bytes(self.layers[0].packs, sum(len(o) for o in owned), wide)
        return wide if need <= 0.9 * self.ram.free_bytes else narrow

    # -- the cut, moved while decoding ----------------------------------------------------------------

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
            raise ValueError("the CPU path does not cut experts here (the split, the placement, the layout)")
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        for lo in self.layers:
            if lo.cpu is not None:
                lo.cpu.set_cut(rows)
        if self.cuda:                                   # the device values written before any stream reads them
            torch.cuda.current_stream(self.device).synchronize()
        self.cut = int(rows)

    def boundary(self, rows: int, forwards: int) -> None:
        """Before each forward: maybe move the cut, time the step, wake the worker's polling."""
        if self.split is None:
            return
        from runtime.cpu.doorbell import kick
        if self.cut is not None and not self.experiment.fixed_cut and not self.experiment.naive:
            if forwards % REBALANCE_EVERY == 0:
                self.rebalance(forwards)
                self._t_prev = None             # a move synchronises: not part of a step's time
            self._time_step(rows)
        kick()                                  # the worker polls its doorbell without pause again

    def rebalance(self, forwards: int) -> None:
        """"cut": climb to the cut whose decode steps are fastest, one `cut_stride` at a time.

        Every REBALANCE_EVERY forwards the current cut's step time is measured (the median of the
        window's decode steps, so a graph capture or a lending copy in the window does not move it;
        averaged with its last fresh value). Then: a neighbouring cut measured REBALANCE_GAIN faster
        is taken; else a neighbour not measured within REBALANCE_KEEP forwards is tried (first the
        side the worker's counts point at: more rows to the CPU when it finished first more often);
        else the cut stays. Times, not the counts, decide: across runs the fastest cut had the CPU
        finishing first in 12% to 78% of layer calls (docs/engine-notes.md). Between forwards,
        with the stream synchronised (the worker's copy of the cut changes at once)."""
        from runtime.experts.decode import CUT_ALIGN
        steps, self._window = sorted(self._window), []
        if len(steps) < REBALANCE_EVERY // 2 or not self.active:   # a prefill or pause in the window
            return
        fresh = {c: ms for c, (ms, at) in self._cut_ms.items() if forwards - at <= REBALANCE_KEEP}
        ms = steps[len(steps) // 2] * 1e3
        if self.cut in fresh:
            ms = (ms + fresh[self.cut]) / 2
        self._cut_ms[self.cut] = (ms, forwards)
        fresh[self.cut] = ms
        now = self.balance_totals()
        cpu_first, gpu_first = now[0] - self._balance_prev[0], now[1] - self._balance_prev[1]
        self._balance_prev = now
        share = cpu_first / (cpu_first + gpu_first) if cpu_first + gpu_first else 0.5
        stride = cut_stride(self.layers[0].packs[2].in_features, CUT_ALIGN)
        up, down = self.cut + stride, self.cut - stride
        near = [c for c in ((up, down) if share >= 0.5 else (down, up)) if CUT_ALIGN <= c <= self.cut_width]
        faster = [c for c in near if c in fresh and fresh[c] < ms * (1 - REBALANCE_GAIN)]
        untried = [c for c in near if c not in fresh]
        new = min(faster, key=fresh.get) if faster else untried[0] if untried else None
        if new is None:
            return
        self.set_cut(new)
        self.cut_log.append((forwards, new, round(share, 3)))
        self._balance_prev = self.balance_totals()

    def _time_step(self, rows: int) -> None:
        """Decode step times for rebalance: the time from one one-row forward's start to the next's."""
        t = time.perf_counter()
        if self._t_prev is not None and t - self._t_prev < 1.0:     # not a pause between two requests
            self._window.append(t - self._t_prev)
        self._t_prev = t if rows == 1 else None


def copy_widths(intermediate: int, cut: int, align: int) -> tuple[int, int]:
    """(narrow, wide): rows the CPU copies may hold for a planned `cut`, the most the cut can climb to.
    Narrow leaves room for one move up; wide for CUT_ROOM of the rows. The planned cut comes from rates
    measured apart, and the climb could not go past the copies: DBRX at 24 GB on the H200 kept its cut
    at the copies' 5,184 of 10,752 rows, the CPU finishing first in 81% of layer calls and idle 44 ms a
    token, while the GPU's part took ~101 ms."""
    narrow = min(intermediate, cut + max(CUT_HEADROOM, cut_stride(intermediate, align)))
    wide = min(intermediate, max(narrow, cut + int(intermediate * CUT_ROOM) // align * align))
    return narrow, wide


def cut_stride(intermediate: int, align: int) -> int:
    """Rows a move of the cut shifts: `align` (the kernels' step), or 1/CUT_STEPS of the expert's
    intermediate rows where that is more. A move must change the step time by more than
    REBALANCE_GAIN for the climb to see it: Mixtral-8x22B's experts have 16,384 rows, and moves of
    64 (0.4% of each cut pick) are below that: on the H200 its cut wandered between 7,360 and 7,680
    rows for 128 steps, and the CPU path, timed there, gained nothing (where the balance lay is not
    measured yet)."""
    return max(align, intermediate // CUT_STEPS // align * align)


T = TypeVar("T")


def run_steps(steps: Generator[str, None, T]) -> T:
    """A generator of steps (build_steps, set_path_steps) run to its end, all at once; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def cold_share(freq: np.ndarray, resident: list[list[int]]) -> float:
    """The share of the routing picks `freq` ([L, E], rows summing to 1) sends to experts outside
    `resident`, averaged over the layers."""
    freq = np.asarray(freq, dtype=np.float64)
    hot = [float(freq[i, list(r)].sum()) if len(r) else 0.0 for i, r in enumerate(resident)]
    return float(np.mean([max(0.0, 1.0 - h) for h in hot])) if hot else 0.0


def alloc_failure(e: BaseException) -> str:
    """What ran out, in words, when building the CPU copies or their page-locked buffers failed."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, MemoryError):
        return f"host RAM ran out while copying cold experts for the CPU ({text})"
    low = text.lower()
    if "pin" in low or "host" in low or "cudahostalloc" in low or "out of memory" in low:
        return ("page-locked host memory ran out for the CPU path's buffers (the system's limit on locked "
                f"memory, ulimit -l, or host RAM): {text}")
    return f"building the CPU path failed: {type(e).__name__}: {text}"
