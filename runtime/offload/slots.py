"""Expert offload, one layer: hot experts in VRAM slots, cold ones in pinned host RAM, one code path.

Every projection (gate, up, down) keeps all E experts' codes in pinned host memory (`cold`, which
GPU kernels read at its own address over PCIe) and S of them in a VRAM stack of slots (`qweight`).
The kernels find expert e's codes at `qweight`'s base + `woff[e]` int32 words (runtime/experts/decode.py, grouped.py), so
moving an expert is one table write: `slot * words` for a resident expert, the distance from the
slot stack to its place in `cold` for a cold one. No branch in the kernels, no host synchronisation
in a step: a decode step captured in a CUDA graph reads whatever the table says when it runs.

Rules that keep queued steps safe (all table writes go on the compute stream, in order):
- evicting: the victim's entry is pointed at `cold` first; the copy into its slot runs on a side
  stream that waits for an event recorded after that write, so steps queued before it are done;
- promoting: the new expert's entry points at the slot only once the copy's event has completed
  (polled with `event.query()` at a step boundary, never waited for).

Lent experts (`lend`, `unlend`): between prefills the manager lends the staging buffers' pages to cold
experts; their entries point into the pages like a slot's, but they are no slot of the layer: they
stay cold for the placement, re-placement leaves them alone, and every one goes back to host memory
before a forward that stages (staging.py orders the pages' reuse after that).

Hit accounting on the device: the router kernel counts every chosen expert in `layer.counts`; at each
residency change (in stream order) the pairs counted since the last change are split into hits and
misses with the residency mask of that interval. Telemetry reads the sums (one sync, at its time).
Letters: E experts, S slots, W words per expert (per projection).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from runtime.experts.layer import ExpertLayer
from runtime.experts.pack import PackedExperts
from runtime.inference_mode import inference_mode_methods


def cold_base(p: PackedExperts) -> int:
    """Word offset of the host stack's first expert from the slot stack's base (may be negative)."""
    return word_distance(p.cold, p.qweight)


def word_distance(a: torch.Tensor, base: torch.Tensor) -> int:
    """(a's address - base's address) in int32 words; a multiple of 16 (the kernels' WALIGN)."""
    d = a.data_ptr() - base.data_ptr()
    if d % 64:
        raise ValueError(f"expert code stacks {d} bytes apart: not a multiple of 64 (allocations are "
                         "aligned to 64 bytes or more)")
    return d // 4


@inference_mode_methods
class LayerOffload:
    """Residency of one MoE layer's experts; owns the offset tables' contents."""

    def __init__(self, layer: ExpertLayer, index: int):
        self.layer, self.index = layer, index
        self.packs: list[PackedExperts] = [layer.w1, layer.w3, layer.w2]
        for p in self.packs:
            if p.cold is None:
                raise ValueError(f"MoE layer {index}: experts were not loaded into host memory for offload")
        E = layer.num_experts
        self.num_experts = E
        self.device = layer.w1.scales.device
        self.slot_expert: list[int] = []                # slot -> expert, -1 while a copy fills it
        self.expert_slot: dict[int, int] = {}           # resident experts (their entry points at the slot)
        self.pending: dict[int, tuple[int, Optional[torch.cuda.Event]]] = {}   # expert -> (slot, copy done)
        self.lent: dict[int, list[int]] = {}            # cold experts in lent VRAM pages -> their table words
        dev = self.device
        self.mask = torch.zeros(E, dtype=torch.int32, device=dev)        # 1 = entry points at a slot
        self.snap = torch.zeros(E, dtype=torch.int32, device=dev)        # counts at the last change
        self.hits = torch.zeros((), dtype=torch.int64, device=dev)
        self.pairs = torch.zeros((), dtype=torch.int64, device=dev)
        self.tables_host = [[0] * E for _ in self.packs]                 # mirrors of the woff tables
        self.promotions = 0
        self.cpu = None              # runtime/cpu/path.CpuPath when the CPU computes some cold experts
        self.set_slots(0)

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def code_bytes(self) -> int:
        """Bytes of one expert's codes, all three projections: a slot, or one expert over PCIe."""
        return sum(p.code_bytes() for p in self.packs)

    @property
    def num_slots(self) -> int:
        return len(self.slot_expert)

    def resident(self) -> list[int]:
        return sorted(self.expert_slot)

    def cold(self) -> list[int]:
        return [e for e in range(self.num_experts) if e not in self.expert_slot]

    @property
    def path(self) -> str:
        if len(self.expert_slot) == self.num_experts:
            return "vram"
        return "cpu+stream" if self.cpu is not None and self.cpu.owned_set else "stream"

    # -- placement (at load, or a new budget: nothing may be queued that reads the old slots) -------

    def set_slots(self, num_slots: int) -> None:
        """(Re)allocate S VRAM slots, every expert cold. With S = 0 the kernels' base is the host stack."""
        self.account()
        for p in self.packs:
            if num_slots == 0:
                p.qweight = p.cold
            else:
                p.qweight = torch.empty((num_slots,) + tuple(p.cold.shape[1:]), dtype=torch.int32,
                                        device=self.device)
        self.slot_expert = [-1] * num_slots
        self.expert_slot = {}
        self.pending = {}
        self.lent = {}
        self.mask.zero_()
        for j, p in enumerate(self.packs):
            base, W = cold_base(p), p.words_per_expert
            self.tables_host[j] = [base + e * W for e in range(self.num_experts)]
            p.woff.copy_(torch.tensor(self.tables_host[j], dtype=torch.int64))

    def fill(self, experts: Sequence[int], stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make `experts` resident in slots 0..n-1 (empty slots, at load): copy, then point the tables.
        The caller synchronises before the next step (load time only)."""
        experts = sorted(int(e) for e in experts)
        if len(experts) > self.num_slots or len(set(experts)) != len(experts):
            raise ValueError(f"layer {self.index}: {len(experts)} experts for {self.num_slots} slots")
        for e in experts:
            if not 0 <= e < self.num_experts:
                raise ValueError(f"layer {self.index}: expert {e} out of range 0..{self.num_experts - 1}")
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            for s, e in enumerate(experts):
                for p in self.packs:
                    p.qweight[s].copy_(p.cold[e], non_blocking=True)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.account()
        for s, e in enumerate(experts):
            self.slot_expert[s] = e
            self.expert_slot[e] = s
        self.write_entries(experts)

    # -- re-placement between steps ------------------------------------------------------------------

    def evict(self, e: int) -> int:
        """Point expert e back at host memory (compute stream); returns the slot it gave up, which
        must not be overwritten before the steps queued so far are done (see `promote`)."""
        s = self.expert_slot.pop(e)
        self.account()
        self.slot_expert[s] = -1
        self.write_entries([e])
        return s

    def promote(self, e: int, slot: int, side: Optional[torch.cuda.Stream]) -> None:
        """Copy expert e into a free slot on the side stream, after everything queued on the compute
        stream so far (which may still read the slot's old expert). Its entry moves at `poll`."""
        if e in self.expert_slot or e in self.pending or self.slot_expert[slot] != -1:
            raise ValueError(f"layer {self.index}: cannot promote expert {e} into slot {slot}")
        ev = None
        if side is not None:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            side.wait_event(freed)
            with torch.cuda.stream(side):
                for p in self.packs:
                    p.qweight[slot].copy_(p.cold[e], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        else:
            for p in self.packs:
                p.qweight[slot].copy_(p.cold[e])
        self.slot_expert[slot] = -2 - e             # reserved for e while its copy runs
        self.pending[e] = (slot, ev)

    def poll(self) -> list[int]:
        """Point promoted experts whose copy has completed at their slot; returns them."""
        done = [e for e, (_, ev) in self.pending.items() if ev is None or ev.query()]
        if done:
            self.account()
        for e in done:
            s, _ = self.pending.pop(e)
            self.slot_expert[s] = e
            self.expert_slot[e] = s
            self.lent.pop(e, None)                  # promoted while lent: its page until now
            self.promotions += 1
        self.write_entries(done)
        return done

    # -- lent pages (between prefills) ----------------------------------------------------------------

    def lend(self, pages: dict[int, Sequence[torch.Tensor]]) -> None:
        """Point cold experts at VRAM pages that hold their codes ({expert: one page per projection});
        the caller has ordered the copies before the next step. One table write per projection."""
        for e, pg in pages.items():
            if e in self.expert_slot or e in self.pending or e in self.lent or not 0 <= e < self.num_experts:
                raise ValueError(f"layer {self.index}: expert {e} is resident, on its way or lent already")
            if len(pg) != len(self.packs) or any(t.shape != p.cold.shape[1:] for t, p in zip(pg, self.packs)):
                raise ValueError(f"layer {self.index}: pages for expert {e} do not match its projections")
        if not pages:
            return
        self.account()
        for e, pg in pages.items():
            self.lent[e] = [word_distance(t, p.qweight) for t, p in zip(pg, self.packs)]
        self.write_entries(list(pages))

    def unlend(self) -> list[int]:
        """Point every lent expert back at host memory (compute stream); returns them. Their pages
        may be overwritten by work ordered after this (the steps queued so far may still read them)."""
        back = list(self.lent)
        if back:
            self.account()
            self.lent = {}
            self.write_entries(back)
        return back

    def table_words(self, e: int) -> Optional[list[int]]:
        """Table words of expert e: its slot's, its lent page's, or None (host memory)."""
        if e in self.expert_slot:
            return [self.expert_slot[e] * p.words_per_expert for p in self.packs]
        return self.lent.get(e)

    def write_entries(self, experts: list[int]) -> None:
        """Rewrite the entries of `experts` from `table_words` (slot, lent page or host memory), one copy per
        table and one for the mask, in stream order. A resident or lent expert is the GPU's; a cold one
        the CPU's if it has a copy."""
        if not experts:
            return
        for j, p in enumerate(self.packs):
            for e in experts:
                w = self.table_words(e)
                self.tables_host[j][e] = w[j] if w is not None else cold_base(p) + e * p.words_per_expert
            _upload(p.woff, self.tables_host[j], torch.int64)
        _upload(self.mask, [int(self.table_words(e) is not None) for e in range(self.num_experts)], torch.int32)
        if self.cpu is not None:
            for e in experts:
                self.cpu.own(e, self.table_words(e) is None and self.cpu.stores(e))

    # -- accounting ------------------------------------------------------------------------------------

    def account(self) -> None:
        """Split the pairs routed since the last call into hits and misses (device ops, stream order)."""
        d = self.layer.counts - self.snap
        self.hits += (d * self.mask).sum()
        self.pairs += d.sum()
        self.snap.copy_(self.layer.counts)

    def skip_counted(self) -> None:
        """Leave the pairs routed since the last `account` out of the hit rate (staged prefill rows)."""
        self.snap.copy_(self.layer.counts)

    def hit_counts(self) -> tuple[int, int]:
        """(hits, pairs) so far, including pairs not yet accounted; read-only (telemetry thread)."""
        d = self.layer.counts - self.snap
        h = self.hits + (d * self.mask).sum()
        n = self.pairs + d.sum()
        return int(h), int(n)

    def table(self, j: int) -> list[int]:
        return list(self.tables_host[j])


def _upload(dst: torch.Tensor, values: list[int], dtype: torch.dtype) -> None:
    """dst[:] = values in stream order, without a host synchronisation on a GPU (from page-locked
    memory, which torch's host allocator keeps until the copy is done)."""
    src = torch.tensor(values, dtype=dtype)
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
