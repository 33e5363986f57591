"""bench/placement_loads.py's logic on the CPU: the timed decode, the spread and deadline arithmetic,
uniform statistics placing every load alike, and forced routing's decisions saved apart."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from bench import offload as bo
from bench import placement_loads as pl
from runtime.budget import MemoryBudget


class FakeEngine:
    """What timed_decode touches: reset, prefill, forward (one row), the vocabulary."""

    def __init__(self, vocab=50):
        self.info = types.SimpleNamespace(vocab_size=vocab)
        self.calls = []

    def reset(self):
        self.calls.append(("reset",))

    def prefill(self, ids):
        self.calls.append(("prefill", len(ids)))

    def prepare_decode(self, max_new_tokens):
        self.calls.append(("prepare", max_new_tokens))

    def forward(self, tokens):
        self.calls.append(("forward", len(tokens)))
        return torch.zeros(len(tokens), self.info.vocab_size)


def test_timed_decode_times_only_the_steps_after_the_warm_ones():
    e = FakeEngine()
    steps = pl.timed_decode(e, prompt=12, warm=3, n=7)
    assert len(steps) == 7 and all(s >= 0 for s in steps)
    assert e.calls[:3] == [("reset",), ("prefill", 12), ("prepare", 11)]    # graphs ready before any step
    assert e.calls[3:] == [("forward", 1)] * 10                   # one row a step, warm ones included
    with pytest.raises(ValueError, match="want at least 1 step"):
        pl.timed_decode(e, prompt=12, warm=3, n=0)


def test_rates_spread_and_summary():
    tps, med = pl.decode_rates([0.02, 0.03, 0.05])
    assert tps == pytest.approx(3 / 0.10) and med == pytest.approx(1 / 0.03)
    with pytest.raises(ValueError, match="no decode steps"):
        pl.decode_rates([])
    assert pl.spread([28.9, 32.7]) == pytest.approx(32.7 / 28.9 - 1) and pl.spread([]) is None
    with pytest.raises(ValueError, match="must be positive"):
        pl.spread([0.0, 1.0])
    loads = [{"decision": {"path": "cpu"}, "decode_tps": t, "decode_tps_median_step": t + 1} for t in (40, 41, 39.5)]
    s = pl.summary(loads)
    assert s["paths"] == ["cpu"] * 3 and s["same_path"] and s["decode_tps"] == 40
    assert s["decode_spread"] == pytest.approx(41 / 39.5 - 1) and s["decode_spread_median"] == pytest.approx(42 / 40.5 - 1)
    loads[1]["decision"]["path"] = "stream"
    assert not pl.summary(loads)["same_path"]


def test_a_load_starts_only_where_the_last_ones_wall_time_ends_by_the_deadline():
    assert pl.another_load_fits(1e6, [70.0], 0)                   # no deadline
    assert pl.another_load_fits(0.0, [], 360)
    assert pl.another_load_fits(280.0, [90.0, 70.0], 360)          # judged by the last (reused decision) load
    assert not pl.another_load_fits(300.0, [90.0, 70.0], 360)


def test_uniform_statistics_are_uniform_and_weigh_a_half_life():
    from runtime.offload.routing_stats import RoutingStats
    s = RoutingStats.empty(3, 8)
    s.counts[0, 2] = 1e6
    bo.uniform_statistics(s, top_k=2)
    assert np.allclose(s.frequencies(), 1 / 8) and s.tokens == s.half_life_tokens
    assert s.counts.sum() == pytest.approx(3 * 2 * s.half_life_tokens)
    with pytest.raises(ValueError, match="must be positive"):
        bo.uniform_statistics(s, top_k=0)


def _manager(seed_stats):
    from bench.check_experts import random_layer
    from runtime.offload.manager import OffloadManager
    layers = [random_layer(8, 64, 32, 2, 4, "cpu", seed=i, host_codes=True) for i in range(4)]
    m = OffloadManager(layers, MemoryBudget(1 << 40), "stream")
    m.vram.total_bytes = 22 * m.layers[0].code_bytes
    rng = np.random.default_rng(seed_stats)
    m.stats.counts[...] = rng.pareto(1.0, size=m.stats.counts.shape) * 100    # concentrated, unlike each other
    m.stats.tokens = 512
    return m


def test_two_loads_placed_by_other_statistics_place_alike_from_uniform_statistics():
    """The H200's loads: each placed by the statistics the load before saved (its uniform traffic
    included), so their resident sets, staging and hit rates under uniform picks differed."""
    a, b = _manager(1), _manager(2)
    a.place()
    b.place()
    sets = lambda m: [sorted(lo.expert_slot) for lo in m.layers]
    assert sets(a) != sets(b)                                    # the variance's source
    before = max(sum(map(len, sets(m))) for m in (a, b))
    for m in (a, b):
        bo.uniform_statistics(m.stats, m.top_k)
        m.place()
    assert sets(a) == sets(b) and a.staging.capacity == b.staging.capacity
    assert sum(map(len, sets(a))) >= before                      # no fewer experts hot under uniform picks


def test_placing_for_uniform_routing_saves_no_statistics_and_counts_no_earlier_traffic(tmp_path):
    m = _manager(3)
    m.stats_file = tmp_path / "stats.json"
    m.place()
    rebased, budgets = [], []
    m.residency.rebase = lambda counts, tokens: rebased.append((counts.shape, tokens))
    engine = types.SimpleNamespace(offload=m, set_vram_budget=budgets.append)
    bo.place_for_uniform_routing(engine, 24.0)
    assert m.stats_file is None and np.allclose(m.stats.frequencies(), 1 / 8)
    assert rebased == [((4, 8), m.counters.tokens)] and budgets == [24.0]
    m.close()
    assert not (tmp_path / "stats.json").exists()


def test_a_decision_under_forced_routing_is_saved_apart_from_the_models_own():
    from runtime.backends.expert_path import decision_key
    from runtime.offload.experiment import NO_EXPERIMENT
    engine = types.SimpleNamespace(info=types.SimpleNamespace(path="/models/q"), setup=None,
                                   experiment=NO_EXPERIMENT)
    own = decision_key(engine)
    engine.experiment = NO_EXPERIMENT.replace(forced_routing=(object(),), routing_label="uniform")
    uniform = decision_key(engine)
    engine.experiment = NO_EXPERIMENT.replace(forced_routing=(object(),), routing_label="trace qwen3")
    trace = decision_key(engine)
    assert len({own, uniform, trace}) == 3 and uniform.startswith(own) and uniform.endswith("|forced routing uniform")
