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
(runtime/offload/experiment.py's `prefetch_oracle`, kept with a set probability) to measure what a
given accuracy buys.
Letters: L MoE layers, E experts, A experts per token, P pages.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from runtime.experts.pack import PackedExperts
from runtime.inference_mode import inference_mode_methods
from runtime.experts.routing import UniformPicks, router_logits
from runtime.offload.experiment import NO_EXPERIMENT, Experiment
from runtime.offload.slots import word_distance


# manager.PREFETCH_PAGES (handed over by runtime/offload/manager.py): experts per layer copied
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
        self.layers = layers                     # runtime/offload/slots.LayerOffload, one per MoE layer
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


# -- the kernels: the next layer's prediction, its plan and score, the copies --------------------------

def predict_logits(h: torch.Tensor, norm_w: Optional[torch.Tensor], gate_w: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """out fp32 [E] = (h [1, H] * norm_w [H]) . gate_w[e]: the next layer's router on the residual stream,
    normed by its weight only (the RMS factor does not change the ranking)."""
    H, E = h.shape[-1], gate_w.shape[0]
    if h.numel() != H or out.numel() != E or out.dtype != torch.float32:
        raise ValueError(f"predict_logits: one row of {H} into fp32 [{E}], got {list(h.shape)} into "
                         f"{out.dtype} {list(out.shape)}")
    return router_logits(h.reshape(1, H), gate_w, out, norm_w)


def prefetch_plan(logits, mask, tables, steps, pages, skip, step_skip, cand, copy, on, ids, prev_cand,
                  prev_copy, score, top_k: int, plan: bool, oracle: Optional[tuple[UniformPicks, float]] = None) -> None:
    """Launch `_prefetch_plan` (one program). tables/steps: the next layer's three offset tables and
    their step copies (int64 [E]); pages int64 [3, P]; skip/step_skip uint8 [E] or None; cand/copy
    int32 [P] (the next layer's); ids int32 [1, A] and prev_cand/prev_copy int32 [P] (this layer's,
    None: nothing to score); score int64 [4]."""
    E, P = mask.numel(), cand.numel()
    score_it = ids is not None
    dummy = score
    t = oracle[0] if oracle is not None else None
    _prefetch_plan[(1,)](
        logits if plan else dummy, mask, *(tables if plan else (dummy,) * 3), *(steps if plan else (dummy,) * 3),
        pages if plan else dummy, skip if skip is not None else dummy, step_skip if step_skip is not None else dummy,
        cand, copy, on, ids if score_it else dummy, prev_cand if score_it else dummy,
        prev_copy if score_it else dummy, score, t.table if t is not None else dummy,
        t.step if t is not None else dummy, t.table.shape[0] if t is not None else 1,
        float(oracle[1]) if oracle is not None else 0.0,
        E=E, BE=triton.next_power_of_2(E), A=top_k, BA=triton.next_power_of_2(top_k), P=P,
        BP=max(2, triton.next_power_of_2(P)), PLAN=plan, SCORE=score_it, SKIP=skip is not None,
        ORACLE=oracle is not None, num_warps=4)


PREFETCH_BLOCKS = 16      # programs per projection and page of a prefetch copy


def prefetch_copy(base: torch.Tensor, desc: torch.Tensor, copy: torch.Tensor, words: int) -> None:
    """Copy each expert of `copy` (int32 [P], -1: none) from host memory into its VRAM page, reading it
    in place over PCIe; addresses in desc (int64 [3, 2 + P], words from base's address); `words`: the
    most words of one projection of an expert."""
    P, block = copy.numel(), 2048
    nit = triton.cdiv(triton.cdiv(words, PREFETCH_BLOCKS), block)
    _prefetch_copy[(P, 3, PREFETCH_BLOCKS)](base, desc, copy, P=P, D=desc.shape[1], NIT=nit, BLOCK=block,
                                            num_warps=4)


@triton.jit
def _prefetch_plan(logits_ptr, mask_ptr, o1, o2, o3, s1, s2, s3, page_ptr, skip_ptr, sskip_ptr,
                   cand_ptr, copy_ptr, on_ptr, ids_ptr, pcand_ptr, pcopy_ptr, score_ptr,
                   otab_ptr, ostep_ptr, n_rows, oracle_q,
                   E: tl.constexpr, BE: tl.constexpr, A: tl.constexpr, BA: tl.constexpr,
                   P: tl.constexpr, BP: tl.constexpr, PLAN: tl.constexpr, SCORE: tl.constexpr,
                   SKIP: tl.constexpr, ORACLE: tl.constexpr):
    """One program. SCORE: this layer's prediction (made by the layer before) against its picks `ids`:
    score[0..3] += candidates, candidates picked, copies, copies picked. PLAN: the next layer's
    candidates, its top-A predicted picks (by `logits`) that are cold there (mask 0), the first P in
    rank order; the copies are the candidates when *on_ptr, none otherwise; its step tables s1..s3
    are its tables o1..o3 with each copied expert pointed at its page (page_ptr [3, P] word offsets),
    and (SKIP) its step mask the CPU mask without the copied experts. ORACLE (benchmarks, uniform
    routing): the picks the next layer will draw from `otab` (row *ostep_ptr), each kept with
    probability oracle_q and otherwise replaced by a pseudo-random expert."""
    a = tl.arange(0, BA)
    am = a < A
    k = tl.arange(0, BP)
    km = k < P
    if SCORE:
        ids = tl.load(ids_ptr + a, mask=am, other=-2)
        pc = tl.load(pcand_ptr + k, mask=km, other=-1)
        pp = tl.load(pcopy_ptr + k, mask=km, other=-1)
        c_hit = tl.max(((pc[:, None] == ids[None, :]) & (pc[:, None] >= 0)).to(tl.int64), axis=1)
        p_hit = tl.max(((pp[:, None] == ids[None, :]) & (pp[:, None] >= 0)).to(tl.int64), axis=1)
        tl.store(score_ptr + 0, tl.load(score_ptr + 0) + tl.sum((pc >= 0).to(tl.int64), axis=0))
        tl.store(score_ptr + 1, tl.load(score_ptr + 1) + tl.sum(c_hit, axis=0))
        tl.store(score_ptr + 2, tl.load(score_ptr + 2) + tl.sum((pp >= 0).to(tl.int64), axis=0))
        tl.store(score_ptr + 3, tl.load(score_ptr + 3) + tl.sum(p_hit, axis=0))
    if PLAN:
        e = tl.arange(0, BE)
        me = e < E
        if ORACLE:
            row = tl.load(ostep_ptr) % n_rows
            truth = tl.load(otab_ptr + row * A + a, mask=am, other=0)
            h = (row * 2654435761 + a * 40503 + 12345) % 1000003                  # a cheap hash of (row, pick)
            keep = (h.to(tl.float32) / 1000003.0) < oracle_q
            sel = tl.where(keep, truth, ((h * 7919) % E).to(tl.int32))
        else:
            z = tl.load(logits_ptr + e, mask=me, other=float("-inf"))
            sel = tl.zeros([BA], dtype=tl.int32)
            for j in tl.static_range(A):
                mx = tl.max(z, axis=0)
                i = tl.min(tl.where(z == mx, e, BE), axis=0)
                sel = tl.where(a == j, i, sel)
                z = tl.where(e == i, float("-inf"), z)
        cold = am & (tl.load(mask_ptr + sel, mask=am, other=1) == 0)
        rank = tl.cumsum(cold.to(tl.int32), axis=0)
        pick = cold[None, :] & (rank[None, :] == k[:, None] + 1)                 # [BP, BA]
        cand = tl.sum(tl.where(pick, sel[None, :] + 1, 0), axis=1) - 1           # -1: none
        on = tl.load(on_ptr)
        copy = tl.where(on != 0, cand, -1)
        tl.store(cand_ptr + k, cand, mask=km)
        tl.store(copy_ptr + k, copy, mask=km)
        v1 = tl.load(o1 + e, mask=me, other=0)
        v2 = tl.load(o2 + e, mask=me, other=0)
        v3 = tl.load(o3 + e, mask=me, other=0)
        if SKIP:
            sk = tl.load(skip_ptr + e, mask=me, other=0)
        for j in tl.static_range(P):
            cj = tl.sum(tl.where(k == j, copy, 0), axis=0)
            v1 = tl.where(e == cj, tl.load(page_ptr + j), v1)
            v2 = tl.where(e == cj, tl.load(page_ptr + P + j), v2)
            v3 = tl.where(e == cj, tl.load(page_ptr + 2 * P + j), v3)
            if SKIP:
                sk = tl.where(e == cj, 0, sk)
        tl.store(s1 + e, v1, mask=me)
        tl.store(s2 + e, v2, mask=me)
        tl.store(s3 + e, v3, mask=me)
        if SKIP:
            tl.store(sskip_ptr + e, sk, mask=me)


@triton.jit
def _prefetch_copy(base_ptr, desc_ptr, copy_ptr, P: tl.constexpr, D: tl.constexpr, NIT: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program (k, j, b): words [b, b + 1) x NIT x BLOCK of projection j of copy k's expert, from host
    memory to its page. desc [3, D] int64, words from base_ptr: [cold stack, words per expert, pages]."""
    kk = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    e = tl.load(copy_ptr + kk).to(tl.int64)
    if e >= 0:
        W = tl.load(desc_ptr + j * D + 1)
        src = tl.load(desc_ptr + j * D) + e * W
        dst = tl.load(desc_ptr + j * D + 2 + kk)
        for it in range(NIT):
            offs = (b * NIT + it) * BLOCK + tl.arange(0, BLOCK)
            m = offs < W
            tl.store(base_ptr + dst + offs, tl.load(base_ptr + src + offs, mask=m, cache_modifier=".cg"), mask=m)
