"""The budgets a load's VRAM planner reports (tests and benchmarks size an offloaded load by them), and a
load's memory hand-back around torch's caches, on the CPU (torch.cuda replaced where a GPU is asked)."""
from __future__ import annotations

import pytest
import torch

from bench.check_experts import random_layer
from runtime.budget import MemoryBudget
from runtime.offload.manager import OffloadManager
from runtime.offload.residency import offload_bytes
from runtime.options import OffloadOptions

E, TOP_K = 8, 2
FIXED = {"weights, KV cache and kernel workspaces": 3_000_000, "prefill scratch": 700_000}


def _manager(n=4, prefetch_pages=0, total=1 << 40):
    layers = [random_layer(E, 64, 32, TOP_K, 4, "cpu", seed=i, host_codes=True) for i in range(n)]
    vram = MemoryBudget(total)
    for what, nbytes in FIXED.items():
        vram.reserve(what, nbytes)
    return OffloadManager(layers, vram, prefetch_pages=prefetch_pages)


@pytest.mark.parametrize("pages", [0, 1])
def test_offload_bytes_is_what_the_planner_needs_for_that_many_residents(pages):
    m = _manager(prefetch_pages=pages)
    cb = m.residency.code_bytes()
    for r in range(E):
        need = offload_bytes(cb, E, r, pages)
        m.place(free_bytes=need)
        kept = [len(lo.resident()) for lo in m.layers]
        if need >= sum(cb) * E:                # as much as every expert: all stay in VRAM
            assert r >= E - 2 and kept == [E] * 4, (r, kept)
            continue
        assert m.staging.capacity == min(E, E - r + 1)
        # staging for every expert (r <= 1) asks no layer to keep any: the r x 4 slots may go anywhere
        assert kept == [r] * 4 if r > 1 else sum(kept) == 4 * r, (r, need, kept)
        if r:                                  # a byte less: fewer slots
            m.place(free_bytes=need - 1)
            assert sum(len(lo.resident()) for lo in m.layers) < 4 * r
    with pytest.raises(ValueError, match="8 resident experts of 8"):
        offload_bytes(cb, E, E)


def test_budget_for_adds_the_ledger_s_fixed_items_and_a_load_at_it_keeps_that_many():
    m = _manager(prefetch_pages=1)
    assert m.fixed_bytes() == sum(FIXED.values())
    budget = m.budget_for(5)
    assert budget == sum(FIXED.values()) + offload_bytes(m.residency.code_bytes(), E, 5, 1)
    m.vram.total_bytes = budget                 # a load at that budget: the ledger has exactly that left
    m.place()
    assert [len(lo.resident()) for lo in m.layers] == [5] * 4 and m.vram.free_bytes == 0
    assert m.fixed_bytes() == sum(FIXED.values())          # the placement's own items are not fixed
    assert m.budget_for(5) == budget                       # placed or not: the same figure


def _fake_cuda(monkeypatch, calls):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("blas"), raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: calls.append("measure") or (8 << 20, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)


def test_a_load_gives_torch_s_cached_blocks_back_before_it_measures_free_memory(monkeypatch, tmp_path):
    """A tensor deleted just before a load leaves its blocks in torch's cache, where allocations outside
    torch (kernel modules, mappings of page-locked memory) cannot use them: the load hands them back
    first, device and page-locked host blocks, after the device's queued copies."""
    from runtime.backends import gpu_offload
    calls = []
    _fake_cuda(monkeypatch, calls)
    setup = gpu_offload.prepare(tmp_path, None, OffloadOptions(), own_moe=False)
    assert calls == ["sync", "blas", "empty", "host", "measure"], calls
    assert not setup.offload and setup.vram.total_bytes == 8 << 20


def test_cublas_workspaces_go_back_only_while_no_engine_is_open(monkeypatch):
    """A workspace is a small block that keeps a freed segment reserved, so the hand-back drops them; an
    open engine's CUDA graphs replay the workspace they captured, so not while one is open (a draft
    model loading beside its target)."""
    import gc
    from runtime.backends import gpu_offload

    class Engine:
        pass
    calls = []
    _fake_cuda(monkeypatch, calls)
    target = Engine()
    gpu_offload.engine_opened(target)
    gpu_offload.return_cached_memory()
    assert calls == ["sync", "empty", "host"], calls
    gpu_offload.engine_closed(target)
    calls.clear()
    gpu_offload.return_cached_memory()
    assert calls == ["sync", "blas", "empty", "host"], calls
    leaked = Engine()                        # never closed: open while alive, gone with it
    gpu_offload.engine_opened(leaked)
    calls.clear()
    gpu_offload.return_cached_memory()
    assert "blas" not in calls
    del leaked
    gc.collect()
    calls.clear()
    gpu_offload.return_cached_memory()
    assert "blas" in calls


def test_under_a_budget_the_ledger_counts_what_torch_still_holds_unused_before_the_load(monkeypatch, tmp_path):
    """The allocator's cap counts every reserved byte; blocks torch holds but cannot give back (a live
    tensor's segment, a graph pool something still refers to) were missing from the ledger, and the
    planner filled that much of the cap twice (the GPU tests' loads after others ran out of memory)."""
    from runtime.backends import gpu_offload
    from runtime.errors import OutOfMemory
    calls, caps = [], []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 5 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 << 30)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: caps.append(f))
    setup = gpu_offload.prepare(tmp_path, None, OffloadOptions(vram_budget_gb=24), own_moe=False)
    assert setup.vram.total_bytes == 24 << 30 and setup.capped and caps == [24 / 140]
    assert setup.vram.items == {gpu_offload.HELD_BEFORE: 3 << 30}
    setup = gpu_offload.prepare(tmp_path, None, OffloadOptions(), own_moe=False)     # no budget, no cap
    assert setup.vram.items == {} and not setup.capped and caps == [24 / 140]
    with pytest.raises(OutOfMemory, match=r"held before the load \(unused blocks .*\) needs 3.00 GiB of VRAM"):
        gpu_offload.prepare(tmp_path, None, OffloadOptions(vram_budget_gb=2), own_moe=False)
    assert caps == [24 / 140]                  # no cap is left set by a load that could not start


def test_the_repacking_s_page_locked_batches_go_back_after_the_weights(monkeypatch, tmp_path):
    from runtime.backends import gpu_offload
    setup = gpu_offload.OffloadSetup(MemoryBudget(1 << 30), None, None, "auto", False)
    calls = []
    _fake_cuda(monkeypatch, calls)
    assert gpu_offload.start(setup, None, None, tmp_path) is None     # all in VRAM: no manager
    assert calls == ["sync", "host"], calls
    assert setup.vram.items == {"weights, KV cache and kernel workspaces": 0}


def test_a_closed_manager_holds_no_vram_where_something_still_refers_to_it():
    """A closed engine's manager kept alive (a caller's variable, a snapshot) held its hot slots and,
    through its rooms' layer lists, every layer's scales: the next load's ledger found that much less."""
    import weakref
    m = _manager(n=2)
    m.apply([[0, 1, 2], [3]])
    lo = m.layers[0]
    slot, scales = weakref.ref(lo.packs[0].qweight), weakref.ref(lo.packs[0].scales)
    assert slot() is not lo.packs[0].cold
    layer = lo.layer
    m.close()
    del lo
    assert slot() is None                                        # the slots are gone
    assert m.residency.layers == [] and m.staging.layers == [] and m.cpu.layers == []
    assert layer.offload is None and scales() is not None        # the model's own scales stay the model's
