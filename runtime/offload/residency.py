"""Which experts live in VRAM: the placement in a budget, and re-placement between steps.

- **Placement** (`plan`): after every other allocation, the VRAM left (minus prefill scratch) is
  split into two double-buffered staging areas and hot slots per layer, chosen by
  runtime/offload/placement.py from the routing statistics (uniform when none are known; a first
  load measures a prior and places again: route_prior.py).
- **Decode / verify** (few rows): the kernels read hot experts from VRAM and cold ones from pinned
  host memory in place (offload.py): nothing to schedule, graph-capturable.
- **Re-placement** (`boundary`, before each forward): routing counts are copied to the host
  without waiting (read at a later boundary); an expert whose decayed count beats the weakest
  resident's by a margin swaps in (offload.py's evict/promote/poll, never a host sync).

Letters: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from runtime.budget import BudgetError, MemoryBudget
from runtime.inference_mode import inference_mode_methods
from runtime.offload.placement import plan_resident
from runtime.offload.routing_stats import RoutingStats
from runtime.offload.slots import LayerOffload
from runtime.offload.staging import Staging
from runtime.offload.telemetry import Counters

log = logging.getLogger(__name__)


@inference_mode_methods
class Residency:
    """Plans resident sets and swaps experts in and out of the layers' slots (promotions on `side`)."""

    def __init__(self, layers: list[LayerOffload], stats: RoutingStats, counters: Counters, staging: Staging,
                 side: Optional[torch.cuda.Stream], replace_every: int = 16, max_promotions: int = 2,
                 margin: float = 0.25):
        self.layers, self.stats, self.counters, self.staging, self.side = layers, stats, counters, staging, side
        self.E = layers[0].num_experts
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        self.replace_every, self.max_promotions, self.margin = replace_every, max_promotions, margin
        self._snap_host = torch.zeros((len(layers), self.E), dtype=torch.int32, pin_memory=self.cuda)
        self._snap_event = None
        self._snap_tokens = 0
        self._counts_prev = np.zeros((len(layers), self.E), dtype=np.int64)
        self._tokens_prev = 0

    def code_bytes(self) -> list[int]:
        return [lo.code_bytes for lo in self.layers]

    # -- placement ---------------------------------------------------------------------------------

    def plan(self, free_bytes: int, freq: np.ndarray, policy: str, prefetch_pages: int,
             vram: MemoryBudget) -> tuple[list[list[int]], int]:
        """(resident experts per layer, staging capacity) for `free_bytes` of VRAM.

        Staging for C < E experts (twice: double-buffered) needs every layer to keep at least
        E + 1 - C resident (+ 1: a promotion in flight keeps two experts cold at once); each C is
        planned and the one serving the most routing share from VRAM wins."""
        cb = self.code_bytes()
        if sum(cb) * self.E <= free_bytes:
            return [list(range(self.E))] * len(self.layers), 0
        free_bytes -= prefetch_pages * max(cb)                    # the decode prefetch's pages
        if policy == "vram":
            raise BudgetError("VRAM", "all experts", sum(cb) * self.E, free_bytes, vram.total_bytes,
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
        if best is None:                      # no staging size leaves room for the experts each layer must keep
            raise BudgetError("VRAM", "offloaded experts", least_offload_bytes(cb, self.E), free_bytes,
                              vram.total_bytes, "staging (double-buffered) plus the experts every layer keeps "
                              "must fit beside the model; raise the VRAM budget")
        return best

    # -- between steps: re-placement -------------------------------------------------------------------

    def boundary(self) -> None:
        """Every `replace_every` forwards: absorb the counts copied last time, decide, copy them anew."""
        if self.replace_every and self.counters.forwards % self.replace_every == 0:
            self._replace_round()

    def _replace_round(self) -> None:
        if self._snap_event is not None:
            if self.cuda and not self._snap_event.query():
                return
            self._absorb(self._snap_host.numpy().astype(np.int64), self._snap_tokens)
            self.decide()
        counts = torch.stack([lo.layer.counts for lo in self.layers])        # [L, E] on the device
        self._snap_host.copy_(counts, non_blocking=True)
        self._snap_tokens = self.counters.tokens
        self._snap_event = (torch.cuda.Event() if self.cuda else None) or True
        if self.cuda:
            self._snap_event.record(torch.cuda.current_stream(self.device))

    def _absorb(self, counts: np.ndarray, tokens: int) -> None:
        window = (counts - self._counts_prev) % (1 << 32)                 # the device counters are int32
        self._counts_prev = counts
        self.stats.absorb(window, max(0, tokens - self._tokens_prev))
        self._tokens_prev = tokens

    def rebase(self, counts: np.ndarray, tokens: int) -> None:
        """Count routing from here on only (`counts`: the device counters now, `tokens`: the
        token counter now): what came before never reaches the statistics."""
        self._counts_prev = np.asarray(counts, dtype=np.int64).copy()
        self._tokens_prev = tokens
        self._snap_event = None

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
            lending = self.staging.lending_to(lo.index)
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
        self.counters.bytes["promoted"] += lo.code_bytes

    # -- persistence -----------------------------------------------------------------------------------

    def save_stats(self, stats_file: Optional[Path]) -> None:
        """Absorb the counts since the last snapshot and write the statistics file (a sync: at close)."""
        if stats_file is None:
            return
        counts = torch.stack([lo.layer.counts for lo in self.layers]).cpu().numpy().astype(np.int64)
        self._absorb(counts, self.counters.tokens)
        try:
            self.stats.save(stats_file)
        except OSError as e:
            log.warning("could not save routing statistics to %s: %s", stats_file, e)


def least_offload_bytes(code_bytes: list[int], experts: int) -> int:
    """The least VRAM any offloaded placement takes: staging for C experts, double-buffered, plus
    E + 1 - C experts resident in every layer (C = E: staging only), minimised over C."""
    most, total = max(code_bytes), sum(code_bytes)
    return min(2 * c * most + (0 if c == experts else (experts + 1 - c) * total) for c in range(1, experts + 1))


def offload_bytes(code_bytes: list[int], experts: int, resident: int, prefetch_pages: int = 0) -> int:
    """VRAM the experts of an offloaded placement take when every layer keeps `resident` of its
    `experts` in VRAM: the hot slots, staging for the rest + 1 (a promotion in flight), double-buffered,
    and the decode prefetch's pages. Under uniform routing `Residency.plan` given exactly this keeps
    `resident` per layer (the budget a test or a benchmark asks for "half the experts resident");
    with `resident` 0 or 1 staging holds every expert and the slots may go to any layer. Where this is
    as much as every expert (two layers: 2 (E + 1) experts' bytes per layer), all stay in VRAM."""
    if not 0 <= resident < experts:
        raise ValueError(f"{resident} resident experts of {experts}: offload keeps 0..{experts - 1} per layer")
    most = max(code_bytes)
    return resident * sum(code_bytes) + 2 * min(experts, experts - resident + 1) * most \
        + prefetch_pages * most
