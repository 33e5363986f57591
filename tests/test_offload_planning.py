"""CPU-side parts of expert offload: budget accounting, routing statistics, placement, slots."""
from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.budget import GB, BudgetError, MemoryBudget, ram_budget, vram_budget
from runtime.offload.placement import PathCosts, decode_roofline, plan_placement
from runtime.offload.routing_stats import RoutingStats, drift, stats_path

GiB_s = float(GB)
RIG = PathCosts(pcie_bytes_per_s=51.7 * GiB_s, cpu_bytes_per_s=92 * GiB_s)  # measured H200-rig ceilings


# -- budget ----------------------------------------------------------------------------------

def test_budget_accounts_every_reservation_and_says_what_did_not_fit():
    b = MemoryBudget(24 * GB)
    b.reserve("attention weights", 10 * GB)
    b.reserve("KV cache", 2 * GB)
    assert b.free_bytes == 12 * GB and b.fits(12 * GB) and not b.fits(12 * GB + 1)
    with pytest.raises(BudgetError) as e:
        b.reserve("experts layer 0", 13 * GB)
    msg = str(e.value)
    assert "experts layer 0 needs 13.00 GiB of VRAM" in msg and "only 12.00 GiB of the 24.00 GiB" in msg
    assert e.value.needed - e.value.available == 1 * GB
    assert b.release("KV cache") == 2 * GB and b.free_bytes == 14 * GB
    with pytest.raises(ValueError):
        b.reserve("attention weights", 1)
    assert b.fraction_of(141 * GB) == pytest.approx(24 / 141)


def test_vram_and_ram_budgets_from_user_settings():
    assert vram_budget(None, 100 * GB, 141 * GB).total_bytes == 100 * GB
    assert vram_budget(24, 100 * GB, 141 * GB).total_bytes == 24 * GB
    assert vram_budget(24, 10 * GB, 141 * GB).total_bytes == 10 * GB      # never more than is free
    with pytest.raises(BudgetError, match="GPU is smaller than the budget"):
        vram_budget(200, 100 * GB, 141 * GB)
    with pytest.raises(BudgetError, match="RAM budget of 64 GiB"):
        ram_budget(64, 16 * GB)
    assert ram_budget(None, 16 * GB).total_bytes == 14 * GB


# -- routing statistics ----------------------------------------------------------------------

def test_stats_decay_and_frequencies():
    s = RoutingStats.empty(2, 4, half_life_tokens=100)
    assert np.allclose(s.frequencies(), 0.25)                              # nothing known: uniform
    s.absorb(np.array([[10, 0, 0, 0], [0, 0, 5, 5]]), tokens=10)
    s.absorb(np.array([[0, 10, 0, 0], [0, 0, 0, 0]]), tokens=100)          # one half-life later
    f = s.frequencies()
    assert f[0, 1] == pytest.approx(10 / 15) and f[0, 0] == pytest.approx(5 / 15)
    assert np.allclose(f.sum(axis=1), 1.0)
    with pytest.raises(ValueError, match="shape"):
        s.absorb(np.zeros((3, 4)), 1)


def test_stats_persist_and_reload(tmp_path):
    s = RoutingStats.empty(3, 8)
    s.record(1, np.array([[1, 2], [2, 7]]))
    p = stats_path(tmp_path, tmp_path)
    s.save(p)
    loaded, warning = RoutingStats.load(p, 3, 8)
    assert warning is None and np.allclose(loaded.counts, s.counts)


@pytest.mark.parametrize("content,needle", [
    ("{not json", "Expecting property name"),
    (json.dumps({"version": 1, "tokens": 1, "counts": [[1, 2]]}), "shape (1, 2)"),
    (json.dumps({"version": 9, "tokens": 1, "counts": []}), "format version 9"),
    (json.dumps({"version": 1, "tokens": 1, "counts": [[-1] * 8] * 3}), "negative"),
])
def test_corrupt_stats_are_ignored_with_a_warning(tmp_path, content, needle, caplog):
    p = tmp_path / "stats.json"
    p.write_text(content)
    stats, warning = RoutingStats.load(p, 3, 8)
    assert stats is None and needle in warning and str(p) in warning
    assert needle in caplog.text


def test_drift_measures_lost_coverage():
    old = np.array([[0.7, 0.1, 0.1, 0.1]])
    new = np.array([[0.1, 0.7, 0.1, 0.1]])
    assert drift(old, new, [[0]]) == pytest.approx(0.6)
    assert drift(new, old, [[0, 1]]) == 0.0


# -- placement -------------------------------------------------------------------------------

def test_everything_fits_means_all_in_vram():
    p = plan_placement(np.full((2, 8), 1 / 8), [100, 100], 1600, top_k=2, policy="auto", costs=RIG)
    assert all(layer.cold_path == "vram" and len(layer.resident) == 8 for layer in p.layers)
    assert p.hit_rate == 1.0


def test_vram_policy_refuses_what_does_not_fit():
    with pytest.raises(BudgetError, match="all experts needs"):
        plan_placement(np.full((2, 8), 1 / 8), [100, 100], 1000, top_k=2, policy="vram", costs=RIG)


def test_hot_experts_are_kept_first():
    freq = np.array([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    p = plan_placement(freq, [10, 10], 30, top_k=1, policy="cpu", costs=RIG)
    assert p.layers[0].resident == (0, 1) and len(p.layers[1].resident) == 1
    assert p.layers[0].hit_share == pytest.approx(0.8) and p.vram_bytes == 30


def test_auto_streams_when_pcie_is_cheaper_and_slots_come_out_of_the_budget():
    freq = np.full((4, 16), 1 / 16)
    fast_pcie = PathCosts(pcie_bytes_per_s=100e9, cpu_bytes_per_s=10e9)
    p = plan_placement(freq, [10] * 4, 400, top_k=2, policy="auto", costs=fast_pcie)
    assert "stream" in p.paths() and "cpu" not in p.paths()
    assert all(layer.stream_slots == (2 if layer.cold_path == "stream" else 0) for layer in p.layers)
    slots = sum(layer.stream_slots for layer in p.layers)
    assert p.vram_bytes == 400 and sum(len(layer.resident) for layer in p.layers) == 40 - slots
    slow_pcie = PathCosts(pcie_bytes_per_s=10e9, cpu_bytes_per_s=100e9)
    slow = plan_placement(freq, [10] * 4, 400, top_k=2, policy="auto", costs=slow_pcie)
    assert "stream" not in slow.paths() and "cpu" in slow.paths()
    assert sum(len(layer.resident) for layer in slow.layers) == 40


def test_q125_roofline_at_24_gb_matches_the_rig_figures():
    # q125-a11 at 3.0 bpw: 48 layers, 128 experts of 3 x 4096 x 1536 weights.
    L, E, top_k = 48, 128, 8
    expert = int(3 * 4096 * 1536 * 3.0 / 8)
    attn = int(48 * (4096 * (8192 + 512 + 512) + 8192 * 4096) * 3.0 / 8)
    head = int(151936 * 4096 * 6.0 / 8)
    kv = 48 * 2 * 4 * 128 * 8192 * 2
    budget = MemoryBudget(24 * GB)
    for what, n in (("attention", attn), ("head", head), ("KV cache 8K", kv)):
        budget.reserve(what, n)
    p = plan_placement(np.full((L, E), 1 / E), [expert] * L, budget.free_bytes, top_k, "cpu", RIG)
    assert 0.45 < p.hit_rate < 0.56
    roof = decode_roofline(p, attn + head, 3978 * GiB_s, 51.7 * GiB_s, 92 * GiB_s)
    assert 55 < roof["overlapped_tps"] < 85          # the rig's ~65-80 tokens/s with uniform routing
    # The same placement with 8-bit CPU copies of the 3-bit experts reads 8/3 the bytes.
    fat = plan_placement(np.full((L, E), 1 / E), [expert] * L, budget.free_bytes, top_k, "cpu",
                         PathCosts(RIG.pcie_bytes_per_s, RIG.cpu_bytes_per_s, cpu_bytes_ratio=8 / 3))
    assert decode_roofline(fat, attn + head, 3978 * GiB_s, 51.7 * GiB_s, 92 * GiB_s)["overlapped_tps"] < 30


# -- the offload benchmark's routing figures (pure arithmetic; the benchmark itself runs on the GPU) --

def test_routing_concentration_and_uniform_roofline():
    from types import SimpleNamespace
    import numpy as np
    from bench.offload import routing_concentration, uniform_roofline
    uniform = np.full((3, 128), 1 / 128)
    assert routing_concentration(uniform) == {"top8": 0.0625, "top16": 0.125, "top32": 0.25, "top64": 0.5}
    skewed = np.zeros((2, 128))
    skewed[:, 5:13] = 0.1                           # 8 experts take 80% of the picks, in any position
    skewed[:, 13:] = 0.2 / 115
    skewed[:, :5] = 0.0
    assert abs(routing_concentration(skewed)["top8"] - 0.8) < 1e-12
    assert routing_concentration(np.full((1, 16), 1 / 16)) == {"top8": 0.5, "top16": 1.0}   # E < 32

    def layer(residents, lent=0):
        return SimpleNamespace(expert_slot=dict.fromkeys(range(residents)), code_bytes=1000,
                               lent=dict.fromkeys(range(residents, residents + lent)),
                               layer=SimpleNamespace(num_experts=128))
    engine = SimpleNamespace(info=SimpleNamespace(experts_per_token=8),
                             offload=SimpleNamespace(layers=[layer(32), layer(64, lent=32)]))   # lent pages: in VRAM
    r = uniform_roofline(engine, hbm_other=4000.0, hbm=1e6, h2d=1e4, ram=1e4)
    # cold shares 3/4 and 1/4 of 8 experts of 1000 bytes: 6000 + 2000 over PCIe, 2000 + 6000 from HBM
    assert r["pcie_bytes_per_token"] == 8000
    t_gpu, t_pcie = (4000 + 8000) / 1e6, 8000 / 1e4
    assert abs(r["serial_tps"] - 1 / (t_gpu + t_pcie)) < 1e-9
    assert abs(r["overlapped_tps"] - 1 / t_pcie) < 1e-9


_FORCED_ROUTING_CHECK = """
import torch
from runtime.experts.routing import UniformPicks, route_fused
torch.manual_seed(0)
E, A, H = 16, 4, 64
picks = UniformPicks.draw(E, A, "cpu", rows=1000, seed=3)
assert picks.table.shape == (1000, A) and all(len(set(r)) == A for r in picks.table.tolist())
assert torch.bincount(picks.table.reshape(-1).long(), minlength=E).min() > 150      # 250 expected each
a, b = picks.for_layer(0), picks.for_layer(1)
assert int(a.step) != int(b.step) and a.table is b.table
x, gate = torch.randn(7, H).half(), torch.randn(E, H).half()
counts = torch.zeros(E, dtype=torch.int32)
start = int(b.step)
ids, w = route_fused(x, gate, A, counts, forced=b)
want = picks.table[[(start + t) % 1000 for t in range(7)]]
assert torch.equal(ids, want)                               # row t takes the t-th set after the counter
assert int(b.step) == start + 7 and torch.allclose(w, torch.full((7, A), 1 / A))
assert torch.equal(counts, torch.bincount(ids.reshape(-1).long(), minlength=E).int())
one, _ = route_fused(x[:1], gate, A, torch.zeros(E, dtype=torch.int32), forced=b)  # a decode step: the kernel moves it
assert torch.equal(one, picks.table[[(start + 7) % 1000]]) and int(b.step) == start + 8
real, _ = route_fused(x, gate, A, torch.zeros(E, dtype=torch.int32))
assert not torch.equal(real, ids)                                                   # not the router's picks
try:
    route_fused(x, gate, 3, counts, forced=b)
except ValueError as e:
    assert "pick sets of 4 experts for top-k 3" in str(e)
else:
    raise AssertionError("top-k mismatch accepted")
print("forced routing ok")
"""


def test_uniform_routing_replaces_the_routers_picks_after_it_ran():
    """Benchmarks' uniform routing (in the interpreter): the router's kernels run as always, then
    each row takes the next of a table's sets of distinct experts (a counter per layer, on the
    device), equal weights, counted like the router's picks."""
    from tests.interpreted import run_interpreted
    run_interpreted(_FORCED_ROUTING_CHECK, "forced routing ok")


def test_uniform_roofline_splits_cold_bytes_between_pcie_and_cpu():
    from types import SimpleNamespace
    from bench.offload import uniform_roofline
    lo = SimpleNamespace(expert_slot={e: e for e in range(4)}, layer=SimpleNamespace(num_experts=8), code_bytes=100.0,
                         lent={})
    eng = SimpleNamespace(info=SimpleNamespace(experts_per_token=2), offload=SimpleNamespace(layers=[lo, lo]))
    r = uniform_roofline(eng, hbm_other=0.0, hbm=1e12, h2d=50.0, ram=50.0)
    assert r["pcie_bytes_per_token"] == 200.0                    # 2 layers x 2 picks x half cold x 100
    assert abs(r["overlapped_tps"] - 50.0 / 200.0) < 1e-9        # PCIe alone
    assert abs(r["pcie_and_cpu_overlapped_tps"] - 100.0 / 200.0) < 1e-9   # both channels, equal shares
