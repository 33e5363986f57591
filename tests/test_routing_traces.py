"""Routing traces: their own statistics hit the published figures they are calibrated to, and the
placement check on them (LRU vs the manager's frequency placement)."""
from __future__ import annotations

import numpy as np
import pytest

from bench.routing_traces import PROFILES, compare_policies, coverage, generate, lru_hit_rate


def test_picks_are_distinct_top_k_experts():
    picks = generate(200, 128, 8, PROFILES["qwen3-30b-a3b"], layers=2, seed=1)
    assert picks.shape == (2, 200, 8) and picks.min() >= 0 and picks.max() < 128
    assert all(len(set(row.tolist())) == 8 for layer in picks for row in layer)
    assert not np.array_equal(picks[0], picks[1])                   # layers route independently


def test_qwen3_30b_profile_half_the_experts_cover_90_percent():
    """Qwen3-30B-A3B: ~51% of experts cover 90% of picks; the top expert takes 4-6% (ours: < 10%)."""
    picks = generate(2048, 128, 8, PROFILES["qwen3-30b-a3b"], layers=2, seed=2)
    assert coverage(picks, 128) == pytest.approx(0.51, abs=0.06)
    top = max(np.bincount(layer.reshape(-1), minlength=128).max() / layer.size for layer in picks)
    assert 0.03 < top < 0.10


def test_512_expert_profile_lru_caches_hit_as_published():
    """A 512-expert model (top-10): per-layer LRU caches of 64 and 128 experts hit ~67% and ~81%."""
    picks = generate(1500, 512, 10, PROFILES["qwen-512"], layers=1, seed=3)
    assert lru_hit_rate(picks, 64) == pytest.approx(0.67, abs=0.04)
    assert lru_hit_rate(picks, 128) == pytest.approx(0.81, abs=0.04)


def test_uniform_routing_is_what_the_profiles_are_not():
    """The statistics tell traces from uniform picks (the benchmark's worst case)."""
    rng = np.random.default_rng(0)
    uniform = np.stack([rng.permuted(np.tile(np.arange(128), (1024, 1)), axis=1)[:, :8]])
    assert coverage(uniform, 128) > 0.8 and lru_hit_rate(uniform, 16) < 0.2


def test_recency_wins_hits_but_not_pcie_traffic_on_the_realistic_traces():
    """On the 128-expert profile with a third of the experts resident: LRU hits more often than the
    manager's frequency placement, but copying each miss in as well as reading it in place moves more
    over PCIe; so the manager keeps its frequency placement (an in-stream copy the kernels read from
    would turn it around: see `pcie_per_pick_if_the_copy_served`)."""
    picks = generate(1536, 128, 8, PROFILES["qwen3-30b-a3b"], layers=1, seed=4)
    row = compare_policies(picks, 128, [40])[40]
    lru, freq = row["lru"], row["frequency"]
    assert lru["hit_rate"] > freq["hit_rate"]
    assert lru["pcie_per_pick"] > freq["pcie_per_pick"]
    assert lru["pcie_per_pick_if_the_copy_served"] < freq["pcie_per_pick"]
