"""The seams of the expert-offload rooms (runtime/offload/manager.py and the modules it wires): what a
layer gets instead of the manager, the Experiment argument, and the telemetry snapshot."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from bench.check_experts import random_layer
from runtime.budget import MemoryBudget
from runtime.offload.experiment import NO_EXPERIMENT, Experiment, apply_experiment
from runtime.offload.manager import LayerHooks, OffloadManager
from runtime.offload.telemetry import OffloadTelemetry

E, TOP_K = 8, 2

# The keys of the telemetry event the worker sends (runtime/backends/exl2.py merges them), whatever the CPU path
BASE_KEYS = {
    "cpu_expert_ms_per_token", "cpu_expert_pairs", "cpu_expert_owned", "cpu_expert_bytes_per_token",
    "cpu_expert_path", "expert_hit_rate", "pcie_bytes_per_token", "expert_pairs", "expert_hits",
    "expert_zero_copy_bytes", "expert_moved_bytes", "expert_residents", "expert_lent", "expert_lent_pending",
    "expert_prefetch", "expert_prefetch_wasted_bytes", "expert_paths", "expert_path_counts",
    "expert_promotions", "expert_promotions_pending", "expert_staging_capacity", "vram_budget_bytes",
    "vram_budget_used_bytes", "vram_budget_items", "tokens_seen"}


def _manager(n=2, **kw) -> OffloadManager:
    layers = [random_layer(E, 64, 32, TOP_K, 4, "cpu", seed=i, host_codes=True) for i in range(n)]
    return OffloadManager(layers, MemoryBudget(1 << 40), **kw)


# -- what a layer gets ----------------------------------------------------------------------------------

class FakePrefetch:
    def __init__(self):
        self.calls = []

    def after_layer(self, lo, h, ids):
        self.calls.append((lo, h.shape[0], ids))


def test_a_layer_calls_its_hooks_not_a_manager():
    """A layer with a fake expert source and fake hooks: after a decode step's residual add it hands its
    picks to the hooks' prefetch; several rows, no hooks or no prefetch: nothing."""
    layer = random_layer(E, 64, 32, TOP_K, 4, "cpu")
    source, pf = types.SimpleNamespace(index=3), FakePrefetch()
    layer.offload, layer.hooks = source, types.SimpleNamespace(prefetch=pf, cpu_decode=True)
    layer._ids = torch.tensor([[1, 5]])                     # what a forward on the GPU leaves
    layer.after_residual(torch.zeros(1, 64).half())
    assert pf.calls and pf.calls[0][0] is source and pf.calls[0][1] == 1 and pf.calls[0][2] is layer._ids
    layer.after_residual(torch.zeros(4, 64).half())         # a prefill or verify forward
    layer.hooks.prefetch = None                              # none in the step (or the naive baseline)
    layer.after_residual(torch.zeros(1, 64).half())
    layer.hooks = None
    layer.after_residual(torch.zeros(1, 64).half())
    assert len(pf.calls) == 1


def test_the_manager_wires_each_layer_with_its_source_and_shared_hooks():
    m = _manager(n=3, prefetch_pages=1)
    for lo in m.layers:
        assert lo.layer.offload is lo and isinstance(lo.layer.hooks, LayerHooks)
        assert not hasattr(lo, "manager")
    assert m.layers[0].layer.hooks is m.layers[2].layer.hooks is m.hooks
    m.place(free_bytes=20 * m.layers[0].code_bytes)
    assert m.prefetch is not None and m.hooks.prefetch is m.prefetch and m.hooks.cpu_decode
    old = m.prefetch
    m.apply([[0, 1], [2, 3], [4]])                             # a new placement: a new prefetch, wired
    assert m.prefetch is not old and m.hooks.prefetch is m.prefetch
    m.apply([list(range(E))] * 3)                              # all in VRAM: none
    assert m.prefetch is None and m.hooks.prefetch is None
    m.close()
    assert all(lo.layer.offload is None and lo.layer.hooks is None for lo in old.layers)


def test_hooks_before_after_are_the_staging_rooms():
    m = _manager()
    m.apply([[1, 2, 6], [0]])
    m.staging.min_pairs = 1
    m.begin_forward(4)
    a = m.layers[0]
    packs = a.layer.hooks.before(a, 4, torch.zeros(4, TOP_K, dtype=torch.int64))
    assert m.staging.using == {0: m.staging.using[0]} and len(packs) == 3
    a.layer.hooks.after(a)
    assert m.staging.using == {}


# -- the Experiment -------------------------------------------------------------------------------------

def test_an_experiment_is_frozen_checked_and_says_when_graphs_change():
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_EXPERIMENT.naive = True
    with pytest.raises(ValueError, match="prefetch_oracle=1.5"):
        Experiment(prefetch_oracle=1.5)
    with pytest.raises(ValueError, match="forced_routing"):
        Experiment(forced_routing=[])
    picks = (object(), object())
    run = Experiment(forced_routing=list(picks), prefetch_oracle=0.6)
    assert run.forced_routing == picks and run.forced(1) is picks[1] and run.oracle(0) == (picks[0], 0.6)
    assert Experiment(prefetch_oracle=0.6).oracle(0) is None and NO_EXPERIMENT.forced(0) is None
    for other in (run.replace(naive=True), run.replace(prefetch=False), run.replace(prefetch_oracle=1.0),
                  run.replace(forced_routing=None), run.replace(forced_routing=(object(), picks[1]))):
        assert run.changes_graphs(other)
    for other in (run.replace(fixed_cut=True), run.replace(lend_staging=False), run.replace()):
        assert not run.changes_graphs(other)
    with pytest.raises(ValueError, match="2 pick sets for 3 MoE layers"):
        run.check_layers(3)


def test_an_experiment_reaches_the_layers_and_the_rooms():
    m = _manager(n=3, prefetch_pages=1)
    m.place(free_bytes=20 * m.layers[0].code_bytes)
    layers = [lo.layer for lo in m.layers]
    picks = ("picks 0", "picks 1", "picks 2")
    exp = Experiment(forced_routing=picks, prefetch_oracle=1.0, naive=True)
    apply_experiment(exp, layers, m)
    assert [la.forced for la in layers] == list(picks)
    assert m.experiment is m.staging.experiment is m.cpu.experiment is m.prefetch.experiment is exp
    assert m.hooks.prefetch is None and not m.hooks.cpu_decode            # the baseline: neither
    apply_experiment(exp.replace(naive=False, prefetch=False), layers, m)
    assert m.hooks.prefetch is None and m.prefetch_in_step is None and m.hooks.cpu_decode
    assert m.telemetry().expert_prefetch is None                            # out of the step, out of the figures
    apply_experiment(NO_EXPERIMENT, layers, m)
    assert [la.forced for la in layers] == [None] * 3 and m.hooks.prefetch is m.prefetch
    m.set_experiment(exp)
    m.apply([[0, 1], [2, 3], [4]])                                               # a new placement keeps it
    assert m.prefetch.experiment is exp
    with pytest.raises(ValueError, match="needs a model loaded with expert offload"):
        apply_experiment(Experiment(naive=True), layers, None)
    apply_experiment(Experiment(forced_routing=picks), layers, None)         # forced picks need no offload
    assert [la.forced for la in layers] == list(picks)


def test_lending_off_is_an_experiment_and_the_apps_switch_stays():
    m = _manager()
    m.staging.lend = True                                      # the app's default on a GPU (CPU tensors here)
    m.apply([[0, 2, 5], [1]])
    m.set_experiment(Experiment(lend_staging=False))
    m.step_boundary(1)
    m.step_boundary(1)
    assert m.telemetry().expert_lent == 0 and m.telemetry().expert_lent_pending == 0
    m.set_experiment(NO_EXPERIMENT)
    m.step_boundary(1)
    assert m.telemetry().expert_lent_pending > 0
    m.staging.lend = False                                     # MOEDESK_LEND_STAGING=0 (or no GPU): never
    m.apply([[0, 2, 5], [1]])
    m.step_boundary(1)
    assert m.telemetry().expert_lent_pending == 0


def test_a_fixed_cut_is_never_moved(monkeypatch):
    from runtime.offload import cpu_share
    m = _manager(policy="stream")
    m.apply([[0], [1]])
    moved = []
    monkeypatch.setattr(m.cpu, "rebalance", lambda forwards: moved.append(forwards))
    m.cpu.split, m.cpu.cut = object(), 64                     # as a placement with the cut leaves them
    m.set_experiment(Experiment(fixed_cut=True))
    for _ in range(2 * cpu_share.REBALANCE_EVERY):
        m.step_boundary(1)
    assert moved == []
    m.set_experiment(NO_EXPERIMENT)
    for _ in range(cpu_share.REBALANCE_EVERY):
        m.step_boundary(1)
    assert moved == [3 * cpu_share.REBALANCE_EVERY]


# -- the telemetry snapshot -----------------------------------------------------------------------------

def test_telemetry_is_a_frozen_snapshot_with_the_events_keys():
    m = _manager(policy="stream")
    m.apply([[0, 2, 5], [1]])
    t = m.telemetry()
    assert isinstance(t, OffloadTelemetry)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.expert_pairs = 3
    d = t.as_dict()
    assert set(d) == BASE_KEYS and d["cpu_expert_path"] == "off: placement 'stream'"
    assert d["expert_residents"] == [3, 1] and d["expert_staging_capacity"] == m.staging.capacity
    json.dumps(d)                                              # the event goes out as JSON
    m.counters.bytes["staged"] = 7
    assert t.expert_moved_bytes["staged"] == 0 and m.telemetry().expert_moved_bytes["staged"] == 7


def test_telemetry_keys_of_the_cpu_path_only_where_they_apply(monkeypatch):
    from runtime.offload import cpu_share
    from runtime.experts.pack import align_intermediate
    from runtime.offload.placement import CpuSplitCosts
    monkeypatch.setattr(cpu_share.CpuShare, "_split_costs",
                        lambda self, resident, threads: CpuSplitCosts(50e9, 50e9, 0.0))
    layers = [random_layer(8, 64, 256, 2, 3, "cpu", seed=i, group_size=64, host_codes=True) for i in range(2)]
    for la in layers:
        align_intermediate(la.w1, la.w3, la.w2)
    m = OffloadManager(layers, MemoryBudget(1 << 40), "cpu", cpu_threads=1)
    m.apply([[0, 1], [2]])
    d = m.telemetry().as_dict()
    assert set(d) == BASE_KEYS | {"cpu_expert_cut", "cpu_expert_signal", "cpu_expert_predicted_gain"}
    assert d["cpu_expert_path"] == "on" and d["cpu_expert_predicted_gain"] == m.cpu.split.gain
    assert set(d["cpu_expert_cut"]) == {"rows", "of", "copied", "cpu_first_share", "cpu_idle_ms_per_token", "moves"}
    assert d["cpu_expert_cut"]["rows"] == m.cpu.cut
    m.cpu.set_path(False, "measured slower")
    d = m.telemetry().as_dict()
    assert set(d) == BASE_KEYS and d["cpu_expert_path"] == "off: measured slower"
    m.close()
