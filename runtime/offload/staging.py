"""Prefill staging, the staging pages lent between prefills, and the naive baseline's copies.

- **Prefill** (many rows, `STAGE_PAIRS_PER_EXPERT` pairs per expert or more): the grouped kernels
  would read a cold expert over PCIe once per block of rows, so a layer's cold experts are first
  copied into a VRAM staging buffer on a side stream (one copy per run of consecutive cold
  experts), double-buffered: layer l+1's copy overlaps layer l's compute. The layer then runs with
  an offset table that points cold experts into the buffer.
- **Staging lent between prefills** (`MOEDESK_LEND_STAGING`, on by default): the staging buffers
  are idle while decoding, so after a prefill their pages are filled with the cold experts routed most
  (side stream) and the tables point at them: more picks read from VRAM, fewer over PCIe or by the
  CPU. They stay cold for the placement and the CPU keeps their copies; before the next forward
  that stages (or the naive baseline) every one goes back to host memory first (`reclaim`).
- **Naive baseline** (runtime/offload/experiment.py, benchmark only, no graphs): every cold expert a
  step needs is copied into VRAM on demand after a host synchronisation per layer, nothing overlapped.

Letters: E experts per layer, C staging capacity (experts).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from runtime.experts.pack import PackedExperts
from runtime.inference_mode import inference_mode_methods
from runtime.offload.experiment import NO_EXPERIMENT, Experiment
from runtime.offload.routing_stats import RoutingStats
from runtime.offload.slots import LayerOffload, word_distance
from runtime.offload.telemetry import Counters

STAGE_PAIRS_PER_EXPERT = 2     # stage a layer's cold experts when rows x top-k >= this x E
# ... and never below this many rows: forwards of up to 9 rows (a decode step, a verify of 8 drafts)
# replay decode graphs, which read cold experts in place (staging copies are scheduled from the host);
# with few experts (Mixtral: 8, top-2) 2 x E pairs would be 8 rows, and a verify of 8 would copy every
# cold expert of every layer instead of reading the few it chose once.
STAGE_MIN_ROWS = 16


@inference_mode_methods
class Staging:
    """The two staging buffers and their streams and events; the layers' before/after hooks use them."""

    def __init__(self, layers: list[LayerOffload], counters: Counters, stats: RoutingStats,
                 side: Optional[torch.cuda.Stream], lend: bool):
        self.layers = layers
        self.E = layers[0].num_experts
        self.top_k = layers[0].layer.top_k
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        self.counters, self.stats = counters, stats
        self.experiment: Experiment = NO_EXPERIMENT
        self.min_pairs = max(STAGE_PAIRS_PER_EXPERT * self.E, STAGE_MIN_ROWS * self.top_k)
        self.side = side                                   # lending copies (shared with promotions)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.buffers: list[list[torch.Tensor]] = []        # [buffer][projection] int32 [C, K/per, N]
        self.capacity = 0
        self.ready = [self._event(), self._event()]        # staging copy done (stage stream)
        self.free = [self._event(), self._event()]         # buffer's last reader done (compute stream)
        self.free_recorded = [False, False]
        self.staged: dict[int, int] = {}                   # layer -> buffer, copies queued
        self._next_buf = 0
        self.using: dict[int, int] = {}                    # layer -> buffer, being computed
        self.lend = lend                                   # the pages are VRAM only on a GPU (tests set it)
        self.lending: list[tuple[int, int, int]] = []      # (layer, expert, page): copies queued, not yet pointed
        self._lend_event = None                            # those copies done (side stream)

    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    @property
    def naive(self) -> bool:
        return self.experiment.naive

    # -- placement ------------------------------------------------------------------------------------

    def drop(self) -> None:
        """Before a new placement (the stream synchronised): no buffers, nothing lent on its way."""
        self.lending, self._lend_event = [], None
        self.buffers, self.capacity = [], 0

    def allocate(self, capacity: int) -> None:
        """Two buffers of `capacity` experts each (reserved in the ledger by the caller)."""
        for lo in self.layers:
            for p, q in zip(lo.packs, self.layers[0].packs):
                if p.cold.shape[1:] != q.cold.shape[1:]:
                    raise ValueError(f"layer {lo.index}: expert shapes differ from layer 0's; "
                                     "staging assumes one shape")
        self.buffers = [[torch.empty((capacity,) + tuple(p.cold.shape[1:]), dtype=torch.int32, device=self.device)
                         for p in self.layers[0].packs] for _ in range(2)]
        self.capacity = capacity

    # -- the layer's hook ----------------------------------------------------------------------------

    def worth(self, rows: int) -> bool:
        return rows * self.top_k >= self.min_pairs and self.capacity > 0

    def begin_forward(self, rows: int) -> None:
        """Before a forward of `rows` tokens: lent pages back if it stages, and the first layer's copy."""
        self.staged.clear()
        if self.worth(rows) or self.naive:
            self.reclaim()

    def start_first(self, rows: int) -> None:
        if self.worth(rows) and not self.naive:
            nxt = self._next_stream_layer(-1)
            if nxt is not None:
                self._start_stage(nxt)

    def before(self, lo: LayerOffload, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        """The projections (with the offset tables) this layer's kernels use for this call."""
        if lo.path == "vram":
            return tuple(lo.packs)
        if self.naive:
            return self._naive(lo, rows, ids)
        if not self.worth(rows):
            return tuple(lo.packs)
        b = self.staged.pop(lo.index, None)
        if b is None:
            b = self._start_stage(lo.index)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[b])
        nxt = self._next_stream_layer(lo.index)
        if nxt is not None and nxt not in self.staged:
            self._start_stage(nxt)
        self.using[lo.index] = b
        return tuple(self._staged_pack(lo, j, b) for j in range(3))

    def after(self, lo: LayerOffload) -> None:
        b = self.using.pop(lo.index, None)
        if b is not None:
            if self.cuda:
                self.free[b].record(torch.cuda.current_stream(self.device))
                self.free_recorded[b] = True

    def _next_stream_layer(self, index: int) -> Optional[int]:
        for lo in self.layers[index + 1:]:
            if lo.path != "vram":
                return lo.index
        return None

    @staticmethod
    def runs(lo: LayerOffload) -> list[tuple[int, int]]:
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
        if n > self.capacity:
            raise RuntimeError(f"layer {index}: {n} cold experts for {self.capacity} staging places")
        if self.cuda:
            s = self.stream
            if self.free_recorded[b]:
                s.wait_event(self.free[b])             # the buffer's previous layer has been computed
            with torch.cuda.stream(s):
                self._copy_runs(lo, b)
            self.ready[b].record(s)
        else:
            self._copy_runs(lo, b)
        self.staged[index] = b
        self.counters.bytes["staged"] += n * lo.code_bytes
        return b

    def _copy_runs(self, lo: LayerOffload, b: int) -> None:
        r = 0
        for e0, n in self.runs(lo):
            for j, p in enumerate(lo.packs):
                self.buffers[b][j][r:r + n].copy_(p.cold[e0:e0 + n], non_blocking=True)
            r += n

    def _staged_pack(self, lo: LayerOffload, j: int, b: int) -> PackedExperts:
        """Projection j with a table pointing cold experts at their place in staging buffer b
        (place = rank among the layer's cold experts, computed from the mask on the device)."""
        p = lo.packs[j]
        cold = 1 - lo.mask.long()
        rank = torch.cumsum(cold, 0) - cold
        base = word_distance(self.buffers[b][j], p.qweight)
        tab = torch.where(lo.mask.bool(), p.woff, base + rank * p.words_per_expert)
        return dataclasses.replace(p, woff=tab)

    def _naive(self, lo: LayerOffload, rows: int, ids: torch.Tensor) -> tuple[PackedExperts, ...]:
        """Baseline: host sync, then copy every cold expert the rows chose into staging buffer 0."""
        chosen = set(ids.reshape(-1).tolist())                      # the host synchronisation
        need = [e for e in sorted(chosen) if e not in lo.expert_slot]
        out = []
        for j, p in enumerate(lo.packs):
            tab = lo.table(j)
            base = word_distance(self.buffers[0][j], p.qweight)
            for i, e in enumerate(need):
                self.buffers[0][j][i].copy_(p.cold[e], non_blocking=True)
                tab[e] = base + i * p.words_per_expert
            out.append(dataclasses.replace(p, woff=torch.tensor(tab, dtype=torch.int64).to(self.device)))
        self.counters.bytes["naive"] += len(need) * lo.code_bytes
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return tuple(out)

    # -- staging pages lent to cold experts between prefills -------------------------------------------

    def boundary(self, rows: int) -> None:
        """Between forwards: point the experts whose copies landed, or start lending after a prefill."""
        if self.lending:
            self._finish_lending()
        elif (self.lend and self.experiment.lend_staging and self.capacity and not self.naive
              and not self.worth(rows) and not any(lo.lent for lo in self.layers)):
            self._start_lending()

    def page(self, k: int) -> list[torch.Tensor]:
        """Page k of the staging buffers (2 x C of them): one expert's place, one tensor per projection."""
        b, r = divmod(k, self.capacity)
        return [self.buffers[b][j][r] for j in range(3)]

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
        return [(l, e) for _, _, l, e in items[: 2 * self.capacity]]

    def lending_to(self, index: int) -> set[int]:
        """Layer `index`'s experts whose lending copies are on their way."""
        return {e for l, e, _ in self.lending if l == index}

    def _start_lending(self) -> None:
        """Copy the planned experts into the pages on the side stream, after the work queued so far
        (the last forward that staged read them); their entries move at a later boundary."""
        plan = self.lend_plan()
        if not plan:
            return
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            self.side.wait_stream(self.stream)
        with torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext():
            for k, (l, e) in enumerate(plan):
                for t, p in zip(self.page(k), self.layers[l].packs):
                    t.copy_(p.cold[e], non_blocking=True)
        if self.cuda:
            self._lend_event = torch.cuda.Event()
            self._lend_event.record(self.side)
        self.lending = [(l, e, k) for k, (l, e) in enumerate(plan)]
        self.counters.bytes["lent"] += sum(self.layers[l].code_bytes for l, _ in plan)

    def _finish_lending(self) -> None:
        """Point the lent experts at their pages once the copies are done (never waited for)."""
        if self._lend_event is not None and not self._lend_event.query():
            return
        by_layer: dict[int, dict[int, list[torch.Tensor]]] = {}
        for l, e, k in self.lending:
            by_layer.setdefault(l, {})[e] = self.page(k)
        for l, pages in by_layer.items():
            self.layers[l].lend(pages)
        self.lending, self._lend_event = [], None

    def reclaim(self) -> None:
        """Before a forward that stages (or the naive baseline, which copies into staging too): every
        lent expert back to host memory, and the staging copies ordered after the steps that read the
        pages and after the copies that filled them."""
        back = sum(len(lo.unlend()) for lo in self.layers)
        if not back and not self.lending:
            return
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            if self._lend_event is not None:
                cur.wait_event(self._lend_event)
            self.stream.wait_stream(cur)
        self.lending, self._lend_event = [], None

    def settle_lending(self) -> None:
        """Wait for lending copies in flight and point their experts (tests, benchmarks)."""
        if self.lending:
            if self._lend_event is not None:
                self._lend_event.synchronize()
            self._finish_lending()
