"""Expert offload for a whole model: the coordinator of the rooms below, the object the engine calls.

Each idea lives in its own module; this one wires them together and gives the engine one object:

- **Placement and re-placement** (runtime/offload/residency.py): hot slots per layer in a VRAM budget,
  swapped between steps as the routing shifts. `place` plans, `apply` fills slots and staging.
- **Staging and lending** (runtime/offload/staging.py): prefill's double-buffered copies of cold
  experts, the pages lent to cold experts between prefills, and the naive baseline's copies.
- **The CPU's share** (runtime/offload/cpu_share.py): CPU copies of the cold experts (or of their
  first rows, the cut, moved while decoding).
- **Decode prefetch** (runtime/offload/prefetch.py, `prefetch_pages`, 1 by default on a GPU):
  after each MoE layer of a decode step, the next layer's router applied to the residual stream
  predicts its picks, and the likeliest cold one is copied into a VRAM page on a side stream while
  host RAM is idle (that layer's attention); copying runs only while 90% of the predictions come true.
  Its pages are reserved and placed here.
- **Statistics and telemetry** (runtime/offload/telemetry.py): traffic counters and the snapshot.
- **Experiments** (runtime/offload/experiment.py): benchmark-only switches in one argument, given by
  `set_experiment` (the app runs with none).

The layers do not see this object: each gets its expert source (slots.LayerOffload, `layer.offload`)
and a `LayerHooks` (`layer.hooks`): staging's before/after, the prefetch a decode step uses, and
whether its CPU path may run. The engine calls the manager for what concerns every room (placement,
the boundaries around a forward, telemetry, close) and the room itself for what is its alone: the CPU
share (`cpu`: the path on or off, the cut; runtime/backends/expert_path.py), staging (`staging`).

Letters: L MoE layers, E experts per layer, A experts per token, C staging capacity (experts).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from runtime.budget import MemoryBudget
from runtime.experts.layer import ExpertLayer
from runtime.experts.pack import PackedExperts
from runtime.inference_mode import inference_mode_methods
from runtime.offload import prefetch as decode_prefetch
from runtime.offload.cpu_share import CpuShare
from runtime.offload.experiment import NO_EXPERIMENT, Experiment
from runtime.offload.residency import Residency
from runtime.offload.route_prior import absorb_prior
from runtime.offload.routing_stats import RoutingStats
from runtime.offload.slots import LayerOffload, cold_base
from runtime.offload.staging import Staging
from runtime.offload.telemetry import Counters, OffloadTelemetry, collect, path_counts

log = logging.getLogger(__name__)

# The VRAM ledger's items a placement reserves (and gives back when it places again); the rest is fixed
OFFLOAD_ITEMS = ("hot experts", "prefill staging", "decode prefetch")

PREFETCH_PAGES = 1     # experts per layer copied ahead while decoding, on a GPU (leaving the prefetch out of the
                       # step lost: 37.1-37.6 against 38.8-40.1 tok/s at 24 GB on the H200, docs/engine-notes.md)


class LayerHooks:
    """What an offloaded layer (runtime/experts/layer.ExpertLayer) calls around its kernels: staging's
    `before`/`after`, the decode prefetch a decode step uses (`prefetch`, None when there is none or
    under the naive baseline), and whether a decode step may use the layer's CPU path (`cpu_decode`)."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.prefetch: Optional[decode_prefetch.DecodePrefetch] = None
        self.cpu_decode = True

    def before(self, lo: LayerOffload, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        return self.staging.before(lo, rows, ids)

    def after(self, lo: LayerOffload) -> None:
        self.staging.after(lo)


@inference_mode_methods
class OffloadManager:
    def __init__(self, layers: list[ExpertLayer], vram: MemoryBudget, policy: str = "auto",
                 stats: Optional[RoutingStats] = None, stats_file: Optional[Path] = None,
                 replace_every: int = 16, max_promotions: int = 2, margin: float = 0.25,
                 cpu_threads: int = 0, ram: Optional[MemoryBudget] = None,
                 prefetch_pages: Optional[int] = None, experiment: Experiment = NO_EXPERIMENT,
                 lend_staging: bool = True, prior_reason: Optional[str] = None, saved_off: str = ""):
        """policy: the placement ("auto", "cpu", "stream", "vram"); stats, stats_file: the routing statistics
        and where they are saved; cpu_threads, ram: the CPU path's team and RAM ledger; prefetch_pages: the decode
        prefetch's (None: PREFETCH_PAGES on a GPU); lend_staging: Tuning.lend_staging; prior_reason: why the
        load measures a routing prior (routing_prior.saved_statistics), or None; saved_off: a saved path
        decision that rules out CPU copies at the first placement (path_judge.saved_off)."""
        if not layers:
            raise ValueError("offload needs at least one MoE layer")
        self.layers = [LayerOffload(layer, i) for i, layer in enumerate(layers)]
        self.E = layers[0].num_experts
        self.top_k = layers[0].top_k
        self.device = self.layers[0].device
        self.cuda = self.device.type == "cuda"
        self.vram = vram
        self.policy = "stream" if policy in ("auto", "cpu") else policy
        self.stats = stats or RoutingStats.empty(len(layers), self.E)
        self.stats_file = stats_file
        self.prior_source = ""                      # what the measured prior came from, in words
        self._prior_mark: Optional[tuple[np.ndarray, float]] = None     # the statistics right after it
        self.saved_off = saved_off  # a saved path decision that rules out CPU copies at load (expert_path)
        self.lock = threading.Lock()
        self.counters = Counters()
        self._exclude = False                              # the last forward was prefill-sized
        side = torch.cuda.Stream(self.device) if self.cuda else None      # promotions, lending copies
        self.staging = Staging(self.layers, self.counters, self.stats, side, lend_staging and self.cuda)
        self.residency = Residency(self.layers, self.stats, self.counters, self.staging, side,
                                   replace_every, max_promotions, margin)
        # "cpu" or "auto": the CPU path
        self.cpu = CpuShare(self.layers, self.staging, self.stats, policy, cpu_threads, ram)
        self.cpu.saved_off = saved_off
        self.prior_reason = prior_reason
        # Decode prefetch (runtime/offload/prefetch.py): pages per layer, on a GPU by default.
        self.prefetch_pages = (PREFETCH_PAGES if self.cuda else 0) if prefetch_pages is None else prefetch_pages
        self.prefetch: Optional[decode_prefetch.DecodePrefetch] = None
        self.hooks = LayerHooks(self.staging)
        self.experiment = NO_EXPERIMENT
        self.set_experiment(experiment)
        for lo in self.layers:
            lo.layer.offload = lo
            lo.layer.hooks = self.hooks

    @property
    def prior_reason(self) -> Optional[str]:
        """Why the load measures a routing prior (route_prior.py), or None: the CPU share makes no copies
        before the prior's placement."""
        return self._prior_reason

    @prior_reason.setter
    def prior_reason(self, reason: Optional[str]) -> None:
        self._prior_reason = reason
        self.cpu.prior_due = reason is not None

    @property
    def on_stage(self) -> Callable[[str], None]:
        """Hears which part of a placement runs (the load's progress); nothing by default."""
        return self.cpu.on_stage

    @on_stage.setter
    def on_stage(self, hear: Callable[[str], None]) -> None:
        self.cpu.on_stage = hear

    # -- experiments -------------------------------------------------------------------------------

    def set_experiment(self, experiment: Experiment) -> None:
        """Between forwards (graphs dropped by the caller where `Experiment.changes_graphs` says so):
        the rooms run under `experiment` from the next forward. Forced picks go to the layers through
        the engine (experiment.apply_experiment)."""
        experiment.check_layers(len(self.layers))
        self.experiment = experiment
        self.staging.experiment = self.cpu.experiment = experiment
        self._wire_prefetch()

    def _wire_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch.experiment = self.experiment
        self.hooks.prefetch = self.prefetch_in_step if not self.experiment.naive else None
        self.hooks.cpu_decode = not self.experiment.naive

    @property
    def prefetch_in_step(self) -> Optional[decode_prefetch.DecodePrefetch]:
        """The decode prefetch the steps run (None when there is none or the experiment leaves it out)."""
        return self.prefetch if self.experiment.prefetch else None

    # -- placement ---------------------------------------------------------------------------------

    def fixed_bytes(self) -> int:
        """VRAM the ledger holds beside the placement's items (OFFLOAD_ITEMS): the weights, the KV
        cache, workspaces, prefill scratch, as the load measured and reserved them."""
        return sum(n for key, n in self.vram.items.items() if key not in OFFLOAD_ITEMS)

    def budget_for(self, resident: int) -> int:
        """The VRAM budget at which this model, loaded as now (same context and cache), keeps
        `resident` experts per layer in VRAM under uniform routing: the fixed items plus what
        residency.offload_bytes says the hot slots, staging and prefetch pages take."""
        from runtime.offload.residency import offload_bytes
        return self.fixed_bytes() + offload_bytes(self.residency.code_bytes(), self.E, resident, self.prefetch_pages)

    def place(self, free_bytes: Optional[int] = None, freq: Optional[np.ndarray] = None) -> None:
        """Fill hot slots and staging from `free_bytes` of VRAM (default: what the ledger has left
        once the current slots and staging are given back), as residency.plan chooses. Nothing may be
        queued that reads the current slots: load time, or a new budget after a synchronisation."""
        freq = self.stats.frequencies() if freq is None else np.asarray(freq, dtype=np.float64)
        for key in OFFLOAD_ITEMS:
            self.vram.release(key)
        if free_bytes is None:
            free_bytes = self.vram.free_bytes
        self.apply(*self.residency.plan(free_bytes, freq, self.policy, self.prefetch_pages, self.vram))

    def apply(self, resident: list[list[int]], capacity: Optional[int] = None) -> None:
        """Give each layer slots for its `resident` experts and fill them; staging for `capacity`
        cold experts (default: the most any layer leaves cold, + 1). Reserved in the VRAM ledger."""
        if len(resident) != len(self.layers):
            raise ValueError(f"{len(resident)} resident lists for {len(self.layers)} MoE layers")
        cb = self.residency.code_bytes()
        most_cold = max(self.E - len(r) for r in resident)
        if capacity is None:
            capacity = min(self.E, most_cold + 1) if most_cold else 0
        if most_cold and capacity < min(self.E, most_cold + 1):
            raise ValueError(f"staging for {capacity} experts, a layer leaves {most_cold} cold (+ 1 in flight)")
        for key in OFFLOAD_ITEMS:
            self.vram.release(key)
        if self.cuda:                                   # lending copies may still write the old pages
            torch.cuda.synchronize(self.device)
        self.staging.drop()
        self.prefetch = None
        self._wire_prefetch()
        self.cpu.drop()
        for lo in self.layers:
            lo.set_slots(0)
        if self.cuda:
            torch.cuda.empty_cache()
        self.vram.reserve("prefill staging", 2 * capacity * max(cb),
                          "lower the context length or raise the VRAM budget")
        self.vram.reserve("hot experts", sum(len(r) * b for r, b in zip(resident, cb)))
        if most_cold and self.prefetch_pages:
            self.vram.reserve("decode prefetch", self.prefetch_pages * max(cb),
                              "raise the VRAM budget")
        if capacity:
            self.staging.allocate(capacity)
        self.on_stage("Placing experts: filling the hot experts' slots")
        for lo, r in zip(self.layers, resident):
            lo.set_slots(len(r))
            lo.fill(r, self.residency.side)
        self.staging.staged.clear()
        if most_cold and self.prefetch_pages:
            self.prefetch = decode_prefetch.DecodePrefetch(self.layers, self.prefetch_pages, self.experiment)
            self.prefetch.place()
            self._wire_prefetch()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.cpu.build(resident)
        log.info("expert placement: %s", ", ".join(f"{n} layers {k}" for k, n in path_counts(self.layers).items()))

    @property
    def all_in_vram(self) -> bool:
        """Every layer's experts are resident: none is cold."""
        return all(lo.path == "vram" for lo in self.layers)

    # -- around a forward --------------------------------------------------------------------------------

    def begin_forward(self, rows: int) -> bool:
        """Called by the engine before a forward of `rows` tokens (after `step_boundary`): start
        staging the first layer; True when this forward stages its cold experts (copies scheduled from the
        host per call: the engine runs it eagerly, not through a decode graph). Prefill-sized forwards stay
        out of the hit rate (their pairs are accounted up to here now, and dropped at the next boundary)."""
        self.staging.begin_forward(rows)
        if self.prefetch_in_step is not None:
            self.prefetch_in_step.begin()
        if rows * self.top_k >= self.staging.min_pairs:
            for lo in self.layers:
                lo.account()
            self._exclude = True
        self.staging.start_first(rows)
        return self.staging.worth(rows)

    def release_prefetch(self, layer) -> None:
        """The decode graphs' call once the attention before MoE `layer` (an ExpertLayer) has queued its
        q/k/v projections: the decode prefetch's plan for that layer starts (prefetch.DecodePrefetch.release)."""
        pf = self.hooks.prefetch
        if pf is not None and layer.offload is not None:
            pf.release(layer.offload)

    def step_boundary(self, rows: int) -> None:
        """Before each forward (the engine calls it): finish promotions, maybe start new ones."""
        with self.lock:
            if self._exclude:                          # the previous forward was prefill-sized
                for lo in self.layers:
                    lo.skip_counted()
                self._exclude = False
            self.counters.tokens += rows
            self.counters.forwards += 1
            self.cpu.boundary(rows, self.counters.forwards)
            for lo in self.layers:
                if lo.pending:
                    lo.poll()
            self.staging.boundary(rows)
            if not self.experiment.naive:
                self.residency.boundary()
                if self.prefetch_in_step is not None:
                    self.prefetch_in_step.boundary(self.counters.forwards)

    # -- telemetry and persistence ---------------------------------------------------------------------

    def telemetry(self) -> OffloadTelemetry:
        """The snapshot the engine's telemetry carries (read-only, any thread)."""
        with self.lock:
            hits = [lo.hit_counts() for lo in self.layers]
        return collect(self.layers, hits, self.cpu, self.staging, self.prefetch_in_step, self.counters, self.vram)

    def routing_counts(self) -> np.ndarray:
        """[L, E] picks counted on the device since load (int32 counters, wrapping; a sync)."""
        return torch.stack([lo.layer.counts for lo in self.layers]).cpu().numpy().astype(np.int64)

    def learn_prior(self, before: np.ndarray, after: np.ndarray, source: str = "") -> None:
        """At load, once (`prior_reason` set): the picks of the calibration prefill (`after - before`,
        from `routing_counts`) enter the statistics as the prior (route_prior.absorb_prior), the
        traffic before it (the warm-up's random ids) stays out of them, and the experts are placed
        again by the new statistics. Nothing may be queued that reads the current slots."""
        if self.prior_reason is None:
            raise ValueError("no routing prior is due at this load (saved statistics, or measured already)")
        window = (np.asarray(after, dtype=np.int64) - np.asarray(before, dtype=np.int64)) % (1 << 32)
        absorb_prior(self.stats, window, self.top_k)
        self.residency.rebase(np.asarray(after, dtype=np.int64), self.counters.tokens)
        self._prior_mark = (self.stats.counts.copy(), self.stats.tokens)
        self.prior_reason, self.prior_source = None, source or "a calibration prompt"
        self.cpu.saved_off = self.saved_off      # the load's first placement used it up
        self.place()

    def prior_not_measured(self, why: str) -> None:
        """At load: the routing prior that was due is not measured after all (`why`, logged). The
        placement before it made no CPU copies, waiting for the prior's placement: they are made
        now, for the experts placed. Nothing may be queued that reads the current slots."""
        log.info("no routing prior at this load: %s", why)
        self.prior_reason = None
        if self.cpu.skipped_for_prior:
            self.staging.reclaim()                       # lent pages back: the CPU owns cold experts only
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.cpu.build([sorted(lo.expert_slot) for lo in self.layers])

    def forget_warmup(self) -> None:
        """After the load's warm-up (random tokens): the hit counts, moved bytes and prefetch scores
        start from zero, so the figures say what answers did. Routing statistics keep what was seen,
        except after a routing prior measured at this load: they go back to the prior (the warm-up's
        and the path trials' steps are no user traffic to place by)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self._prior_mark is not None:
            self.stats.counts[...] = self._prior_mark[0]
            self.stats.tokens = self._prior_mark[1]
            self.residency.rebase(self.routing_counts(), self.counters.tokens)
            self._prior_mark = None
        for lo in self.layers:
            lo.skip_counted()
            lo.hits.zero_()
            lo.pairs.zero_()
            if lo.cpu is not None:
                lo.cpu.restart_counts()
        self.counters.reset_bytes()
        if self.prefetch_in_step is not None:
            self.prefetch_in_step.reset_score()

    def save_stats(self) -> None:
        """Absorb the counts since the last snapshot and write the statistics file (a sync: at close, or a
        benchmark keeping a load's statistics for the next)."""
        self.residency.save_stats(self.stats_file)

    def close(self) -> None:
        if self.cuda:          # promotions and lending copies may still write slots and pages freed below
            torch.cuda.synchronize(self.device)
        self.staging.drop()
        self.prefetch = None
        self._wire_prefetch()
        self.save_stats()
        self.cpu.drop()
        for lo in self.layers:
            lo.set_slots(0)            # the hot slots' VRAM goes now, whoever still refers to this manager
            lo.layer.offload = None
            lo.layer.hooks = None
        self.layers.clear()            # in place: the rooms share the list (and with it the layers' scales)


def cold_offsets_ok(lo: LayerOffload) -> bool:
    """Every table entry points at the expert's slot, its lent page, or its place in host memory (for tests)."""
    for j, p in enumerate(lo.packs):
        for e in range(lo.num_experts):
            want = (lo.expert_slot[e] * p.words_per_expert if e in lo.expert_slot
                    else lo.lent[e][j] if e in lo.lent else cold_base(p) + e * p.words_per_expert)
            if lo.tables_host[j][e] != want or int(p.woff[e]) != want:
                return False
    return True
