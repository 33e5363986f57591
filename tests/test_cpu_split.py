"""Which cold experts the CPU computes per layer (placement.plan_cpu_split): a pure function."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.offload.placement import CpuSplitCosts, plan_cpu_split

E, A = 16, 4
MB = 1 << 20


def _uniform(L=2):
    return np.full((L, E), 1.0 / E)


def test_no_cpu_owns_nothing():
    resident = [[0, 1, 2, 3]] * 2
    split = plan_cpu_split(_uniform(), resident, [MB] * 2, A, CpuSplitCosts(50e9, 0.0))
    assert split.owned == ((), ()) and split.gain == 0.0
    assert split.stream_s == pytest.approx(2 * A * 12 / 16 * MB / 50e9)


def test_equal_rates_split_the_cold_share_about_in_half():
    split = plan_cpu_split(_uniform(1), [[]], [MB], A, CpuSplitCosts(50e9, 50e9, cpu_overhead_s=0.0))
    assert split.owned == (tuple(range(8)),)
    assert split.gain == pytest.approx(1.0)                    # twice as fast: both sides in parallel


def test_a_cpu_faster_than_pcie_owns_more_and_overhead_costs_experts():
    freq = _uniform(1)
    slow = plan_cpu_split(freq, [[]], [MB], A, CpuSplitCosts(50e9, 25e9, cpu_overhead_s=0.0))
    fast = plan_cpu_split(freq, [[]], [MB], A, CpuSplitCosts(50e9, 100e9, cpu_overhead_s=0.0))
    assert len(slow.owned[0]) < 8 < len(fast.owned[0]) < E
    assert fast.gain > slow.gain > 0
    costly = plan_cpu_split(freq, [[]], [MB], A, CpuSplitCosts(50e9, 100e9, cpu_overhead_s=20e-6))
    assert len(costly.owned[0]) < len(fast.owned[0])
    hopeless = plan_cpu_split(freq, [[]], [MB], A, CpuSplitCosts(50e9, 100e9, cpu_overhead_s=1.0))
    assert hopeless.owned == ((),) and hopeless.gain == 0.0


def test_never_a_resident_expert_and_the_most_routed_cold_ones_first():
    rng = np.random.default_rng(0)
    freq = rng.dirichlet(np.ones(E), size=3)
    resident = [list(np.argsort(-freq[0])[:5]), [], list(range(E))]
    split = plan_cpu_split(freq, resident, [MB, 2 * MB, MB], A, CpuSplitCosts(50e9, 40e9, cpu_overhead_s=5e-6))
    for layer, owned in enumerate(split.owned):
        assert not set(owned) & set(int(e) for e in resident[layer])
        cold = [e for e in range(E) if e not in resident[layer]]
        if owned:                                   # owned = the top shares among the cold experts
            top = sorted(cold, key=lambda e: -freq[layer, e])[:len(owned)]
            assert set(owned) == set(top)
    assert split.owned[2] == ()                     # everything resident: nothing cold to compute
    assert split.owned[0] and split.owned[1]
    assert split.split_s < split.stream_s


def test_bad_inputs():
    with pytest.raises(ValueError, match="resident lists"):
        plan_cpu_split(_uniform(2), [[]], [MB, MB], A, CpuSplitCosts(50e9, 1e9))
    with pytest.raises(ValueError, match="PCIe"):
        plan_cpu_split(_uniform(1), [[]], [MB], A, CpuSplitCosts(0.0, 1e9))


def test_oversubscribed_split_stores_more_experts_and_says_the_cpus_share():
    costs = CpuSplitCosts(50e9, 50e9, cpu_overhead_s=0.0)
    plain = plan_cpu_split(_uniform(1), [[0, 1, 2, 3]], [MB], A, costs)
    wide = plan_cpu_split(_uniform(1), [[0, 1, 2, 3]], [MB], A, costs, oversubscribe=1.5)
    assert plain.owned == ((4, 5, 6, 7, 8, 9),)                   # half of the 12 cold experts
    assert wide.owned == (tuple(range(4, 13)),)                   # 1.5 times as many copies
    assert plain.shares == wide.shares == (pytest.approx(0.5),)   # the planned share of the cold picks
    assert wide.split_s == plain.split_s                          # planned for the same balance
    every = plan_cpu_split(_uniform(1), [[0, 1, 2, 3]], [MB], A, costs, oversubscribe=10.0)
    assert every.owned == (tuple(range(4, 16)),)                  # at most every cold expert
    none = plan_cpu_split(_uniform(1), [[]], [MB], A, CpuSplitCosts(50e9, 0.0), oversubscribe=2.0)
    assert none.owned == ((),) and none.shares == (0.0,)
    with pytest.raises(ValueError, match="oversubscribe 0.5"):
        plan_cpu_split(_uniform(1), [[]], [MB], A, costs, oversubscribe=0.5)


def test_cut_split_owns_every_cold_expert_and_balances_the_two_sides():
    """Experts cut between CPU and GPU: the CPU owns every cold expert and its part of each pick makes
    the expected times equal (CPU twice as fast: two thirds), whatever the routing shares."""
    rng = np.random.default_rng(1)
    freq = rng.dirichlet(np.ones(E), size=2)
    resident = [[0, 1, 2], list(range(E))]
    costs = CpuSplitCosts(25e9, 50e9, cpu_overhead_s=0.0)
    split = plan_cpu_split(freq, resident, [MB, MB], A, costs, cut=True)
    assert split.owned[0] == tuple(range(3, E)) and split.owned[1] == ()
    assert split.shares[0] == pytest.approx(2 / 3)
    cold = A * freq[0, 3:].sum() * MB
    assert split.split_s == pytest.approx(cold * (1 / 3) / 25e9)            # both sides take this long
    assert split.gain == pytest.approx(2.0)                                 # three times as fast
    # an overhead per layer call leaves the CPU a little less
    slower = plan_cpu_split(freq, resident, [MB, MB], A, CpuSplitCosts(25e9, 50e9, cpu_overhead_s=5e-6), cut=True)
    assert slower.shares[0] < split.shares[0] and slower.split_s > split.split_s
    # an overhead that eats all of PCIe's time: nothing for the CPU
    none = plan_cpu_split(freq, resident, [MB, MB], A, CpuSplitCosts(25e9, 50e9, cpu_overhead_s=1.0), cut=True)
    assert none.owned == ((), ()) and none.gain == 0.0
