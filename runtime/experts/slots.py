"""Slot bookkeeping for streamed experts: a fixed set of VRAM slots per layer, filled in place.

The GPU side owns one tensor set per slot (same shapes as every expert of the layer, so copies go
into the slot's tensors in place and kernels keep their pointers). This class decides, for the
experts a step needs, which are already in a slot (hits), which slot each missing one is copied into
(misses), and which resident slot is given up (eviction): the one whose expert has the lowest
routing score, least recently used among equals — never one the current round needs.

When the rows of one step need more distinct cold experts than there are slots (verifying many
draft tokens), the work is split into rounds that each fit; every needed expert is read once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class SlotAssignment:
    expert: int
    slot: int
    copy: bool          # True: the expert must be copied into the slot first (a miss)


class SlotTable:
    def __init__(self, num_slots: int, num_experts: int):
        if num_slots < 1:
            raise ValueError("a streaming layer needs at least one slot")
        self.num_slots, self.num_experts = num_slots, num_experts
        self.expert_in = [-1] * num_slots          # slot -> expert (-1 empty)
        self.slot_of: dict[int, int] = {}          # expert -> slot
        self.last_used = [0] * num_slots
        self.clock = 0
        self.hits = 0
        self.misses = 0

    def plan(self, needed: Sequence[int], score: Optional[np.ndarray] = None) -> list[list[SlotAssignment]]:
        """Rounds of assignments covering every needed expert once; each round fits in the slots."""
        uniq = list(dict.fromkeys(int(e) for e in needed))
        for e in uniq:
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert {e} out of range 0..{self.num_experts - 1}")
        # Hits first, so experts already in place are used before any eviction can touch them.
        uniq.sort(key=lambda e: e not in self.slot_of)
        rounds = []
        for start in range(0, len(uniq), self.num_slots):
            rounds.append(self._round(uniq[start:start + self.num_slots], score))
        return rounds

    def _round(self, experts: list[int], score: Optional[np.ndarray]) -> list[SlotAssignment]:
        self.clock += 1
        keep = {self.slot_of[e] for e in experts if e in self.slot_of}
        out = []
        for e in experts:
            if e in self.slot_of:
                slot = self.slot_of[e]
                self.hits += 1
                out.append(SlotAssignment(e, slot, False))
            else:
                slot = self._victim(keep, score)
                old = self.expert_in[slot]
                if old >= 0:
                    del self.slot_of[old]
                self.expert_in[slot] = e
                self.slot_of[e] = slot
                keep.add(slot)
                self.misses += 1
                out.append(SlotAssignment(e, slot, True))
            self.last_used[slot] = self.clock
        return out

    def _victim(self, keep: set[int], score: Optional[np.ndarray]) -> int:
        free = [s for s in range(self.num_slots) if s not in keep]
        empty = [s for s in free if self.expert_in[s] < 0]
        if empty:
            return empty[0]

        def value(s: int):
            e = self.expert_in[s]
            return (float(score[e]) if score is not None else 0.0, self.last_used[s])
        return min(free, key=value)

    @property
    def hit_rate(self) -> Optional[float]:
        n = self.hits + self.misses
        return self.hits / n if n else None
