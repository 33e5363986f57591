"""VRAM budgets for GPU tests that want an offloaded load "with about this share of the experts resident",
from the planner's own figures (OffloadManager.budget_for) rather than from an all-in-VRAM load.

An all-in-VRAM load's allocation less a share of the codes is no measure of an offloaded load: that
allocation is read after the warm-up (graph buffers, workspaces) where the offloaded load's ledger is
taken before it, and an offloaded load needs fixed VRAM beside the hot slots (staging for each layer's
cold experts + 1, double-buffered, and the decode prefetch's pages) that a share of the codes does not
cover; with two MoE layers staging alone costs as much as every expert, so no budget offloads them
(conftest's moe_8l). So a probe load is made as the test's loads are (offloaded, same context and
cache), with every expert fitting and no warm-up, and the budget is what its ledger says a load needs
for `share` of each layer's experts resident.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from runtime.options import LoadOptions, OffloadOptions

GiB = 1024 ** 3
SLACK = 32 << 20            # a few experts' bytes over the exact figure (they go to hot slots)
LEAK = 256 << 20            # what a closed engine may leave allocated: torch keeps a cuBLAS workspace per stream
                            # a load used (per process, not per load; 64 MiB seen on the H200); the leak this
                            # guards against held every hot slot and scale (~0.9 GiB for moe_8l)


def offload_budget(path, share: float, home: Path, context_length: int = 1024, kv_cache: str = "fp16") -> float:
    """The VRAM budget in GiB at which a load of `path` (offloaded, this context and cache) keeps
    round(share * experts) experts per MoE layer in VRAM under uniform routing. `home`: MOEDESK_HOME
    for the probe (its routing statistics stay out of the test's)."""
    from runtime.backends import exl2
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    off = OffloadOptions(context_length=context_length, kv_cache=kv_cache, placement="stream",
                         vram_budget_gb=0.9 * free / GiB)
    before_home, before = os.environ.get("MOEDESK_HOME"), torch.cuda.memory_allocated()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["MOEDESK_HOME"] = str(home)
    try:
        eng, _ = exl2.load(path, LoadOptions(offload=off), lambda *a: None, warm=False)
        try:
            m = eng.offload
            assert m is not None and all(lo.path == "vram" for lo in m.layers), "the probe did not fit every expert"
            resident = min(m.E - 1, max(1, round(share * m.E)))
            budget = m.budget_for(resident) + SLACK
            print(f"offload budget for {resident}/{m.E} experts resident: {budget / GiB:.2f} GiB "
                  f"({m.vram.report()})")
        finally:
            eng.close()
    finally:
        if before_home is None:
            os.environ.pop("MOEDESK_HOME", None)
        else:
            os.environ["MOEDESK_HOME"] = before_home
    assert_closed_freed(before)
    return budget / GiB


def assert_closed_freed(before: int) -> None:
    """After an engine's close: torch holds no more than LEAK bytes beyond `before` (memory_allocated
    before its load); a leak would leave the next load's ledger short by as much."""
    left = torch.cuda.memory_allocated() - before
    assert left < LEAK, f"a closed engine left {left / GiB:.2f} GiB allocated: later loads would find less VRAM"


def live_cuda_tensors(n: int = 6) -> str:
    """The largest CUDA tensors still alive in this process (shape, dtype, MiB), and their total: what a
    load that ran out of memory after other tests found held (a leaked engine or reference shows here)."""
    import gc
    seen, found = set(), []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and id(obj) not in seen:
                seen.add(id(obj))
                found.append((obj.untyped_storage().nbytes(), tuple(obj.shape), str(obj.dtype)))
        except Exception:
            continue
    found.sort(reverse=True)
    total = sum(b for b, _, _ in found)
    top = ", ".join(f"{list(s)} {d.replace('torch.', '')} {b / 2**20:.0f} MiB" for b, s, d in found[:n])
    return f"{len(found)} live CUDA tensors, {total / GiB:.2f} GiB (views count their storage): {top}"
