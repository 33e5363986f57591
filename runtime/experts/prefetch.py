"""Decode prefetch: the next MoE layer's likely cold experts copied into VRAM while host RAM is idle.

A decode step reads cold experts in place (PCIe, and the CPU from RAM), so host RAM is busy during
each layer's expert phase and idle between two of them (attention, norms, router: ~7 ms per token at
q125-a11's 24 GB budget on the H200). The prefetch moves reads into that gap. After MoE layer l the
residual h is kept (`h`, one row per layer: the next attention adds into h in place), and once layer
l+1's q/k/v projections are queued (`release`), a side stream predicts, plans and copies (captured into
the decode graph like everything else):

    layer l experts ─ + h ─ keep h ─ layer l+1: q/k/v ─ attention ─ o ─ router ─ CPU part ─ wait(copied) ─ GPU kernels
                                                  └─ side: logits(h · norm_{l+1}, router_{l+1}) ─ plan ─ copy ─┘

Why not from h on: exllamav2's quantized GEMM clears its output from the blocks of the first K slice
while the blocks of the other slices add into it (q_gemm_kernel.cuh, `clear`), correct only while the
first slice's blocks run first. A kernel reading host memory beside it (the copy) holds SMs' loads
for microseconds; on the H200 the q/k/v outputs then came out wrong in some decode steps (relative
errors up to 0.1 on the next layer's input, tests/gpu/test_offload_gpu.py). Its o projection adds
into the residual without clearing, and the rest of the gap is our own kernels: the side stream
starts after q/k/v. The decode graphs call `release` there (runtime/backends/exl2_graph.py); other
paths release at the next layer's router (`planned`), where the copy overlaps little.

- **Prediction**: layer l+1's router applied to the residual stream after layer l, scaled by layer
  l+1's norm weight (the RMS factor does not change the ranking): its top-k picks, of which the first
  `pages` that are cold at layer l+1 (not in a slot, not lent) are the candidates.
- **Copy**: a kernel reads each candidate's codes over PCIe into a VRAM page (one set of pages for all
  layers: layer l+1's copy starts after layer l's kernels, the pages' last readers).
- **Use**: layer l+1's kernels take step tables (its tables with the copied experts pointed at their
  pages) and, with the CPU path, a step mask without them: a copied expert is computed whole by the
  GPU from VRAM, and neither the CPU nor PCIe reads it during the expert phase.
- **Scoring and the switch**: each layer's plan also scores the previous prediction (candidates,
  candidates picked, copies, copies picked; device counters). Every WINDOW forwards the manager reads
  them (without waiting) and copies while at least MIN_USE of the candidates were picked (`mode`
  "auto", starting with copying off; "on"/"off" hold it, for benchmarks). The prediction and its score
  run either way, so nothing is copied to find out.

Routing that cannot be predicted (uniform, as the benchmarks force) makes every copy a wasted PCIe read;
the switch turns copying off there. Benchmarks can also hand the plan the next layer's forced picks
(runtime/experts/experiment.py's `prefetch_oracle`, kept with a set probability) to measure what a
given accuracy buys.
Letters: L MoE layers, E experts, A experts per token, P pages.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from runtime.experts.experiment import NO_EXPERIMENT, Experiment
from runtime.experts.offload import inference_mode_methods, word_distance
from runtime.experts.pack import PackedExperts


# MOEDESK_PREFETCH (runtime/tuning.py, handed over by runtime/experts/manager.py): experts per layer copied
# ahead while decoding (one page each, all layers sharing them); 0: none. One q125-a11 expert (7.1 MB at
# 3 bpw) takes ~140 us over PCIe on the H200, about the gap between two layers' expert phases.
WINDOW = 64          # forwards between looks at the score
# "auto": copy while at least this share of the candidates is picked. On the H200 (q125-a11, 24 GB, one
# page, forced picks handed over at a set accuracy, same run): copying gained 2% at 100% accuracy and
# lost 4% at 60% and 7% at the router's 6% on uniform routing, so copying breaks even near 90%.
MIN_USE = 0.9
MODES = ("auto", "on", "off")


@inference_mode_methods
class DecodePrefetch:
    """Pages, per-layer step tables and masks, counters and the side stream of the decode prefetch."""

    def __init__(self, layers: list, pages: int, experiment: Experiment = NO_EXPERIMENT):
        self.layers = layers                     # runtime/experts/offload.LayerOffload, one per MoE layer
        self.top_k = layers[0].layer.top_k
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        self.P = int(pages)
        self.mode = "auto"
        self.experiment = experiment             # benchmarks: the forced picks handed over (its prefetch_oracle)
        L, E, dev = len(layers), layers[0].num_experts, self.device
        self.pages: list[list[torch.Tensor]] = []            # [page][projection]
        self.steps = torch.zeros((L, 3, E), dtype=torch.int64, device=dev)
        self.step_skip = torch.zeros((L, E), dtype=torch.uint8, device=dev)
        self.cand = torch.full((L, self.P), -1, dtype=torch.int32, device=dev)
        self.copy = torch.full((L, self.P), -1, dtype=torch.int32, device=dev)
        self.page_words = torch.zeros((L, 3, self.P), dtype=torch.int64, device=dev)   # from each qweight
        self.desc = torch.zeros((L, 3, 2 + self.P), dtype=torch.int64, device=dev)     # from w1's qweight
        self.score = torch.zeros((L, 4), dtype=torch.int64, device=dev)
        self.logits = torch.zeros(E, dtype=torch.float32, device=dev)
        self.h = torch.zeros((L, layers[0].packs[0].in_features), dtype=torch.float16, device=dev)   # kept residuals
        self.on = torch.zeros(1, dtype=torch.int32, device=dev)     # copying starts once predictions prove out
        self.copying = False
        self.stream = torch.cuda.Stream(dev) if self.cuda else None
        self.planned_ev = self._event()
        self.copied_ev = self._event()
        self._planned: Optional[int] = None      # the layer planned for in this forward (host side)
        self._pending: Optional[tuple] = None    # (layer offload, its ids or None, next layer): to `release`
        self._scored: set[int] = set()           # layers whose candidates this forward planned
        self._snap_host = torch.zeros((L, 4), dtype=torch.int64, pin_memory=self.cuda)
        self._snap_event = None
        self._score_prev = np.zeros(4, dtype=np.int64)
        self.window_use: Optional[float] = None

    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    # -- placement ------------------------------------------------------------------------------------

    def place(self) -> None:
        """After the slots are set: pages (reserved by the manager) and the addresses of each layer's
        cold stacks and pages, relative to its slot stacks. One expert shape for all layers (the manager
        checked it for staging)."""
        first = self.layers[0].packs
        self.pages = [[torch.empty(p.cold.shape[1:], dtype=torch.int32, device=self.device) for p in first]
                      for _ in range(self.P)]
        pw, desc = [], []
        for lo in self.layers:
            base = lo.packs[0].qweight
            pw.append([[word_distance(pg[j], p.qweight) for pg in self.pages] for j, p in enumerate(lo.packs)])
            desc.append([[word_distance(p.cold, base), p.words_per_expert]
                         + [word_distance(pg[j], base) for pg in self.pages] for j, p in enumerate(lo.packs)])
        self.page_words.copy_(torch.tensor(pw, dtype=torch.int64))
        self.desc.copy_(torch.tensor(desc, dtype=torch.int64))
        self.cand.fill_(-1)
        self.copy.fill_(-1)

    # -- a forward ------------------------------------------------------------------------------------

    def begin(self) -> None:
        self._planned = None
        self._pending = None
        self._scored = set()

    def _next(self, index: int) -> Optional[int]:
        nxt = index + 1
        if nxt < len(self.layers) and self.layers[nxt].path != "vram":
            return nxt
        return None

    def after_layer(self, lo, h: torch.Tensor, ids: torch.Tensor) -> None:
        """After layer lo's experts and the residual add (h [1, H] fp16, its picks ids [1, A]), on the
        compute stream: keep h for the next offloaded layer's plan (`release` launches it), or, for the
        last one, score lo's own prediction."""
        from runtime.experts.kernels import prefetch_plan
        i = lo.index
        nxt = self._next(i)
        scored = i in self._scored
        if nxt is None:
            if scored:
                prefetch_plan(None, lo.mask, None, None, None, None, None, self.cand[i], self.copy[i], self.on,
                              ids=ids, prev_cand=self.cand[i], prev_copy=self.copy[i], score=self.score[i],
                              top_k=self.top_k, plan=False)
            return
        self.h[nxt].copy_(h.reshape(-1))
        self._pending = (lo, ids if scored else None, nxt)

    def release(self, target) -> None:
        """Launch the pending plan for `target` (a layer offload; nothing if none is pending for it) on the
        side stream, after everything queued on the compute stream so far: score the layer before, predict
        from its kept residual, plan and copy for the target. Called once the target's q/k/v are queued."""
        from runtime.experts.kernels import predict_logits, prefetch_copy, prefetch_plan
        if self._pending is None or target.index != self._pending[2]:
            return
        lo, ids, nxt = self._pending
        self._pending = None
        i = lo.index
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        if cur is not None:
            self.stream.wait_stream(cur)
            if ids is not None:
                ids.record_stream(self.stream)        # read on the side stream: not reused before it has
        with torch.cuda.stream(self.stream) if cur is not None else _null():
            nl = self.layers[nxt]
            layer = nl.layer
            gate = layer.gate_w if layer.predict_gate is None else layer.predict_gate   # LayerNorm: folded
            predict_logits(self.h[nxt:nxt + 1], layer.norm_w, gate, self.logits)
            cpu = nl.cpu
            prefetch_plan(self.logits, nl.mask, [p.woff for p in nl.packs], list(self.steps[nxt]),
                          self.page_words[nxt], cpu.skip if cpu is not None else None,
                          self.step_skip[nxt] if cpu is not None else None, self.cand[nxt], self.copy[nxt],
                          self.on, ids=ids, prev_cand=self.cand[i], prev_copy=self.copy[i], score=self.score[i],
                          top_k=self.top_k, plan=True, oracle=self.experiment.oracle(nxt))
            if self.planned_ev is not None:
                self.planned_ev.record(self.stream)
            prefetch_copy(nl.packs[0].qweight, self.desc[nxt], self.copy[nxt], max(p.words_per_expert for p in nl.packs))
            if self.copied_ev is not None:
                self.copied_ev.record(self.stream)
        self._planned = nxt
        self._scored.add(nxt)

    def planned(self, lo) -> bool:
        """Whether this forward planned for layer lo (its plan released here if it was still pending);
        if so, its router waits for the plan (the oracle reads the pick counter the router moves; the
        step mask must be written)."""
        self.release(lo)
        if self._planned != lo.index:
            return False
        if self.planned_ev is not None:
            torch.cuda.current_stream(self.device).wait_event(self.planned_ev)
        return True

    def packs(self, lo, packs: tuple[PackedExperts, ...]) -> tuple[PackedExperts, ...]:
        """Layer lo's projections with its step tables, once the copies are done (stream order)."""
        if self.copied_ev is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied_ev)
        self._planned = None
        return tuple(dataclasses.replace(p, woff=self.steps[lo.index, j]) for j, p in enumerate(packs))

    def skip(self, lo) -> torch.Tensor:
        return self.step_skip[lo.index]

    # -- between forwards -----------------------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"prefetch mode {mode!r}: want one of {', '.join(MODES)}")
        self.mode = mode
        if mode != "auto":
            self._set_copying(mode == "on")

    def _set_copying(self, on: bool) -> None:
        if on != self.copying:
            self.on.fill_(1 if on else 0)            # stream order: the next step's plans see it
            self.copying = on

    def boundary(self, forwards: int) -> None:
        """Every WINDOW forwards: read the score copied at the last look (if it has landed), switch
        copying by it ("auto"), and copy the current score to the host without waiting."""
        if forwards % WINDOW:
            return
        if self._snap_event is not None:
            if self.cuda and not self._snap_event.query():
                return
            now = self._snap_host.numpy().sum(axis=0)
            d = now - self._score_prev
            self._score_prev = now
            if d[0] >= 16:
                self.window_use = float(d[1] / d[0])
                if self.mode == "auto":
                    self._set_copying(self.window_use >= MIN_USE)
        self._snap_host.copy_(self.score, non_blocking=True)
        self._snap_event = self._event() or True
        if self.cuda:
            self._snap_event.record(torch.cuda.current_stream(self.device))

    def reset_score(self) -> None:
        """Scores from zero (after the load's warm-up), the window's reference with them."""
        self.score.zero_()
        self._score_prev = self._score_prev * 0
        self._snap_event = None

    def totals(self) -> tuple[int, int, int, int]:
        """(candidates, candidates picked, copies, copies picked) so far (a device read)."""
        return tuple(int(v) for v in self.score.sum(dim=0).tolist())

    def telemetry(self) -> dict:
        c, ch, k, kh = self.totals()
        return {"pages": self.P, "mode": self.mode, "copying": self.copying,
                "accuracy": ch / c if c else None, "window_accuracy": self.window_use,
                "candidates": c, "copies": k, "copies_used": kh}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
