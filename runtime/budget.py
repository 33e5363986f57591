"""Memory budgets: an account of every allocation the engine makes against a VRAM or RAM budget.

The engine reserves bytes by name before it allocates ("attention weights", "KV cache", "experts
layer 12"), so it can say in words what did not fit and how much was free, and so a 24 GB card can be
emulated on a larger one: the CUDA allocator is capped at the same figure
(`torch.cuda.set_per_process_memory_fraction(budget.fraction_of(device_total))`).
Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

GB = 1024 ** 3


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GiB"


class BudgetError(MemoryError):
    """An allocation does not fit its budget. Carries the figures; the message says them in words."""

    def __init__(self, label: str, what: str, needed: int, available: int, total: int, detail: str = ""):
        self.label, self.what = label, what
        self.needed, self.available, self.total = needed, available, total
        msg = (f"{what} needs {gb(needed)} of {label} but only {gb(available)} of the {gb(total)} "
               f"{label} budget is left (short by {gb(needed - available)})")
        super().__init__(msg + (f"; {detail}" if detail else ""))


@dataclass
class MemoryBudget:
    """A named-allocation ledger against a fixed total."""

    total_bytes: int
    label: str = "VRAM"
    items: dict[str, int] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(self.items.values())

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def reserve(self, what: str, nbytes: int, detail: str = "") -> None:
        if nbytes < 0:
            raise ValueError(f"{what}: negative size {nbytes}")
        if what in self.items:
            raise ValueError(f"{what}: already reserved ({gb(self.items[what])})")
        if nbytes > self.free_bytes:
            raise BudgetError(self.label, what, nbytes, self.free_bytes, self.total_bytes, detail)
        self.items[what] = nbytes

    def release(self, what: str) -> int:
        return self.items.pop(what, 0)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.free_bytes

    def fraction_of(self, device_total_bytes: int) -> float:
        """The allocator cap that matches this budget on a device of the given size."""
        if device_total_bytes <= 0:
            raise ValueError("device size must be positive")
        return min(1.0, self.total_bytes / device_total_bytes)

    def report(self) -> str:
        rows = [f"{name}: {gb(n)}" for name, n in sorted(self.items.items(), key=lambda kv: -kv[1])]
        return f"{self.label} budget {gb(self.total_bytes)}, used {gb(self.used_bytes)}: " + "; ".join(rows)


def vram_budget(requested_gb: Optional[float], device_free_bytes: int, device_total_bytes: int) -> MemoryBudget:
    """The VRAM budget for a load: what the user asked for, never more than the device has free."""
    if requested_gb is None:
        return MemoryBudget(device_free_bytes, "VRAM")
    want = int(requested_gb * GB)
    if want > device_total_bytes:
        raise BudgetError("VRAM", f"a VRAM budget of {requested_gb:g} GiB", want, device_free_bytes,
                          device_total_bytes, "the GPU is smaller than the budget; lower it in Settings")
    return MemoryBudget(min(want, device_free_bytes), "VRAM")


def ram_budget(requested_gb: Optional[float], available_bytes: int, keep_free_bytes: int = 2 * GB) -> MemoryBudget:
    """Host RAM for cold experts: the user's figure, or what is available minus a margin for the system."""
    if requested_gb is None:
        return MemoryBudget(max(0, available_bytes - keep_free_bytes), "RAM")
    want = int(requested_gb * GB)
    if want > available_bytes:
        raise BudgetError("RAM", f"a RAM budget of {requested_gb:g} GiB", want, available_bytes, available_bytes,
                          "close other programs or lower the RAM budget in Settings")
    return MemoryBudget(want, "RAM")
