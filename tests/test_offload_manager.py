"""Expert offload bookkeeping on the CPU: offset tables, placement in a budget, staging, re-placement,
hit accounting, statistics persistence. (The kernels reading these tables: test_experts_kernels.py.)"""
from __future__ import annotations

import pytest
import torch

from runtime.budget import BudgetError, MemoryBudget
from runtime.offload.experiment import Experiment
from bench.check_experts import random_layer
from runtime.offload.manager import OffloadManager, cold_offsets_ok
from runtime.offload.routing_stats import RoutingStats
from runtime.offload.slots import cold_base

E, TOP_K = 8, 2


def _layers(n=2):
    return [random_layer(E, 64, 32, TOP_K, 4, "cpu", seed=i, host_codes=True) for i in range(n)]


def _manager(n=2, **kw):
    return OffloadManager(_layers(n), MemoryBudget(1 << 40), **kw)


def _resident_codes_ok(lo) -> bool:
    """Every resident slot holds its expert's codes."""
    return all(torch.equal(p.qweight[s], p.cold[e]) for e, s in lo.expert_slot.items() for p in lo.packs)


def test_tables_point_at_slots_or_host_memory_and_the_ledger_counts_them():
    m = _manager()
    m.apply([[0, 2, 5], [1]])
    a, b = m.layers
    assert a.resident() == [0, 2, 5] and b.resident() == [1] and a.path == b.path == "stream"
    assert cold_offsets_ok(a) and cold_offsets_ok(b) and _resident_codes_ok(a) and _resident_codes_ok(b)
    assert a.mask.tolist() == [1, 0, 1, 0, 0, 1, 0, 0]
    cb = a.code_bytes
    assert m.staging.capacity == E - 1 + 1                         # layer 1 leaves 7 cold, + 1 in flight
    assert m.vram.items["prefill staging"] == 2 * m.staging.capacity * cb
    assert m.vram.items["hot experts"] == 4 * cb
    m.apply([list(range(E)), list(range(E))])                    # everything fits: no staging, "vram"
    assert m.staging.capacity == 0 and [lo.path for lo in m.layers] == ["vram", "vram"]
    for lo in m.layers:
        assert all(int(p.woff[e]) == e * p.words_per_expert for p in lo.packs for e in range(E))


def test_placement_keeps_the_most_routed_experts_within_the_budget():
    stats = RoutingStats.empty(4, E)
    stats.counts[0, [3, 6]] = 100.0                              # layer 0: experts 3 and 6 are hot
    stats.counts[1:, :] = 1.0
    m = _manager(n=4, stats=stats)
    cb = m.layers[0].code_bytes
    # 24 of 32 experts' worth: staging for 6 (x2) and 3 residents per layer serve the most routing
    # share (staging for all 8 would leave 8 slots; for 7, 10 slots but fewer where they matter).
    m.place(free_bytes=24 * cb)
    assert {3, 6} <= set(m.layers[0].resident()) and [len(lo.expert_slot) for lo in m.layers] == [3] * 4
    assert m.staging.capacity == 6 and m.vram.used_bytes == 24 * cb
    assert all(cold_offsets_ok(lo) and _resident_codes_ok(lo) for lo in m.layers)
    with pytest.raises(BudgetError, match="offloaded experts needs") as e:
        m.place(free_bytes=15 * cb)                              # staging for every expert (x2) does not fit
    assert e.value.needed == 16 * cb and e.value.needed > e.value.available    # the least any placement takes
    m.place(free_bytes=32 * cb)                                  # all fit: no staging
    assert m.telemetry().expert_path_counts == {"vram": 4} and m.staging.capacity == 0


def test_swap_points_the_victim_at_host_memory_first_and_the_new_expert_after_its_copy():
    m = _manager()
    m.apply([[0, 1], [0]])
    lo = m.layers[0]
    slot = lo.expert_slot[1]
    lo.evict(1)
    assert int(lo.packs[0].woff[1]) == cold_base(lo.packs[0]) + lo.packs[0].words_per_expert
    lo.promote(4, slot, None)
    assert 4 not in lo.expert_slot and lo.pending and cold_offsets_ok(lo)   # still read from host memory
    with pytest.raises(ValueError):
        lo.promote(5, slot, None)                                # the slot is taken by the copy
    assert lo.poll() == [4]
    assert lo.expert_slot == {0: lo.expert_slot[0], 4: slot} and cold_offsets_ok(lo) and _resident_codes_ok(lo)
    with pytest.raises(ValueError, match="already resident"):
        m.residency.swap(0, 0, 4)


def test_re_placement_under_pressure_moves_the_strongest_gains_only():
    m = _manager(n=3, max_promotions=2)
    m.apply([[0, 1], [0, 1], [0, 1]])
    s = m.stats.counts
    s[:, :] = 10.0
    s[0, 7], s[1, 6], s[2, 5] = 100.0, 50.0, 12.0                # layer 2's gain is inside the margin
    s[0, 1] = 5.0                                                # layer 0's weakest resident
    moves = m.residency.decide()
    assert moves == [(0, 1, 7), (1, 0, 6)]                       # biggest gain first; ties: lowest id evicted
    assert m.residency.decide() == []                          # one copy in flight per layer; layer 2 no gain
    for lo in m.layers:
        lo.poll()
        assert cold_offsets_ok(lo) and _resident_codes_ok(lo)
    assert m.layers[0].resident() == [0, 7] and m.layers[1].resident() == [1, 6]
    assert m.telemetry().expert_promotions == 2
    assert m.counters.bytes["promoted"] == 2 * m.layers[0].code_bytes


def test_routing_counts_reach_the_statistics_a_boundary_later_and_drive_promotions():
    m = _manager(n=1, replace_every=2)
    m.apply([[0, 1]])
    lo = m.layers[0]
    lo.layer.counts[5] += 40                                     # the router chose expert 5 often
    m.step_boundary(1)
    m.step_boundary(1)                                           # round 1: counts copied out
    assert m.stats.counts.sum() == 0
    m.step_boundary(1)
    m.step_boundary(1)                                           # round 2: absorbed, expert 5 promoted
    assert m.stats.counts[0, 5] == pytest.approx(40, rel=1e-3)
    assert 5 in lo.pending
    m.step_boundary(1)                                           # the copy is done: its entry moves
    assert 5 in lo.expert_slot and cold_offsets_ok(lo) and m.counters.tokens == 5


def test_pcie_per_token_counts_the_tokens_since_the_warm_up_only():
    """After the load's warm-up the bytes and hits start from zero, and so do the tokens they are
    divided by: counted from the load on, a Mixtral answer's 7 GB a token showed as 0.2 GB (2,000
    warm-up and trial tokens in the denominator, none of their bytes in the numerator)."""
    m = _manager(n=1)
    m.apply([[0, 1]])
    lo = m.layers[0]
    lo.layer.counts[4] += 30                                     # warm-up: 30 misses over 30 tokens
    m.counters.tokens = 30
    assert m.telemetry().pcie_bytes_per_token == pytest.approx(lo.code_bytes)
    restarted = []
    lo.cpu = type("Cpu", (), {"restart_counts": lambda self: restarted.append(1)})()
    m.forget_warmup()                                            # the CPU path's counts too (they are subtracted)
    lo.cpu = None
    assert restarted == [1]
    assert m.telemetry().pcie_bytes_per_token is None            # no token since
    lo.layer.counts[4] += 2                                      # an answer's two tokens: a miss each
    m.counters.tokens += 2
    t = m.telemetry()
    assert t.expert_pairs == 2 and t.pcie_bytes_per_token == pytest.approx(lo.code_bytes)
    assert t.tokens_seen == 32                                   # the statistics' count goes on


def test_hit_rate_splits_pairs_by_the_residency_of_their_time():
    m = _manager(n=1)
    m.apply([[0, 1]])
    lo = m.layers[0]
    lo.layer.counts[0] += 3                                      # 3 hits
    lo.layer.counts[4] += 1                                      # 1 miss
    m.counters.tokens = 2
    t = m.telemetry()
    assert t.expert_hit_rate == pytest.approx(0.75) and t.expert_pairs == 4
    assert t.pcie_bytes_per_token == pytest.approx(lo.code_bytes / 2)
    m.residency.swap(0, 1, 4)
    m.step_boundary(0)                                           # 4 resident from now on
    lo.layer.counts[4] += 4
    t = m.telemetry()
    assert t.expert_hits == 7 and t.expert_pairs == 8
    assert t.expert_residents == [2] and t.expert_paths == ["stream"]
    m.staging.min_pairs = 4                                        # a prefill-sized forward:
    m.step_boundary(2)
    m.begin_forward(2)
    lo.layer.counts[5] += 4                                      # its routing
    m.step_boundary(1)                                           # ... is left out
    lo.layer.counts[0] += 1
    assert m.telemetry().expert_pairs == 9


def test_staging_copies_cold_experts_in_runs_and_points_the_table_into_the_buffer():
    m = _manager(n=2)
    m.apply([[1, 2, 6], [0]])
    m.staging.min_pairs = 1
    m.begin_forward(4)                                           # layer 0 staged ahead
    a = m.layers[0]
    assert m.staging.runs(a) == [(0, 1), (3, 3), (7, 1)]
    ids = torch.zeros(4, TOP_K, dtype=torch.int64)
    packs = m.hooks.before(a, 4, ids)
    assert 1 in m.staging.staged                               # the next layer's copy started
    cold = a.cold()
    for j, p in enumerate(packs):
        b = m.staging.using[0]
        base = (m.staging.buffers[b][j].data_ptr() - a.packs[j].qweight.data_ptr()) // 4
        for e in range(E):
            if e in a.expert_slot:
                assert int(p.woff[e]) == a.expert_slot[e] * p.words_per_expert
            else:
                r = cold.index(e)
                assert int(p.woff[e]) == base + r * p.words_per_expert
                assert torch.equal(m.staging.buffers[b][j][r], a.packs[j].cold[e])
    m.hooks.after(a)
    assert m.counters.bytes["staged"] == (len(cold) + len(m.layers[1].cold())) * a.code_bytes


def _page_of(m, lo, e, j) -> torch.Tensor:
    """The staging page expert e's table entry j points at (it must point into a staging buffer)."""
    p = lo.packs[j]
    addr = p.qweight.data_ptr() + int(p.woff[e]) * 4
    for buf in m.staging.buffers:
        t = buf[j]
        off = addr - t.data_ptr()
        if 0 <= off < t.numel() * 4:
            assert off % (p.words_per_expert * 4) == 0
            return t[off // (p.words_per_expert * 4)]
    raise AssertionError(f"layer {lo.index} expert {e}: entry {j} points outside the staging buffers")


def test_staging_pages_are_lent_to_cold_experts_between_prefills_and_reclaimed_before_one():
    m = _manager(n=2)
    m.staging.lend = True                                      # on a GPU by default; CPU tensors here
    m.apply([[0, 2, 5], [1]])
    a, b = m.layers
    assert 2 * m.staging.capacity >= len(a.cold()) + len(b.cold())  # pages enough for every cold expert
    m.step_boundary(1)                                           # a decode step: the copies are queued
    assert m.telemetry().expert_lent_pending == 12 and not a.lent
    m.step_boundary(1)                                           # the next boundary points the tables
    tel = m.telemetry()
    assert tel.expert_lent == 12 and tel.expert_lent_pending == 0
    assert tel.expert_residents == [3, 1]                     # lent pages are no slots
    for lo in (a, b):
        assert lo.mask.tolist() == [1] * E and cold_offsets_ok(lo) and _resident_codes_ok(lo)
        assert sorted(lo.lent) == lo.cold()                       # still cold for the placement
        for e in lo.lent:
            for j, p in enumerate(lo.packs):
                assert torch.equal(_page_of(m, lo, e, j), p.cold[e])
    assert m.counters.bytes["lent"] == 12 * a.code_bytes
    assert m.residency.decide() == []                          # re-placement leaves lent experts alone
    e = a.cold()[0]                                              # promoted by hand while lent: the page
    m.residency.swap(0, 0, e)                                  # serves until the slot's copy lands
    assert e in a.lent and cold_offsets_ok(a)
    a.poll()
    assert e in a.expert_slot and e not in a.lent and 0 not in a.lent and cold_offsets_ok(a)   # 0: host memory
    m.residency.swap(0, e, 0)
    a.poll()
    assert 0 in a.expert_slot and 0 not in a.lent and cold_offsets_ok(a)
    # A forward that stages takes every page back first: host memory again, then the staging copies.
    m.staging.min_pairs = 1
    m.begin_forward(4)
    assert not a.lent and not b.lent and cold_offsets_ok(a) and cold_offsets_ok(b)
    assert a.mask.tolist() == [int(e in a.expert_slot) for e in range(E)] and len(a.expert_slot) == 3
    packs = m.hooks.before(a, 4, torch.zeros(4, TOP_K, dtype=torch.int64))
    cold = a.cold()
    for e in cold:
        assert torch.equal(m.staging.buffers[m.staging.using[0]][0][cold.index(e)], a.packs[0].cold[e])
        assert int(packs[0].woff[e]) != int(a.packs[0].woff[e])   # the staged table, not the lent one
    m.hooks.after(a)
    m.staging.min_pairs = 2 * E                                # back to the default: 8+ rows stage
    m.step_boundary(64)                                          # another prefill-sized forward: nothing lent
    assert m.telemetry().expert_lent_pending == 0
    m.step_boundary(1)
    m.step_boundary(1)
    assert len(a.lent) == 5 and len(b.lent) == 7 and cold_offsets_ok(a)
    m.set_experiment(Experiment(naive=True))                     # the baseline copies into staging too
    m.begin_forward(1)
    assert not a.lent and not b.lent and cold_offsets_ok(b)
    m.step_boundary(1)
    assert m.telemetry().expert_lent_pending == 0             # no lending under the baseline


def test_lent_pages_go_to_the_experts_routed_most_spread_over_layers():
    stats = RoutingStats.empty(4, E)
    stats.counts[:, :] = 1.0
    stats.counts[3, [6, 7]] = 50.0                               # layer 3's cold experts are routed most
    m = _manager(n=4, stats=stats)
    m.staging.lend = True
    m.apply([list(range(6))] * 4)                                # 2 cold per layer, staging for 3 (x2)
    assert 2 * m.staging.capacity == 6
    plan = m.staging.lend_plan()
    assert len(plan) == 6 and {(3, 6), (3, 7)} <= set(plan)
    per_layer = [sum(1 for l, _ in plan if l == i) for i in range(4)]
    assert per_layer == [2, 1, 1, 2]                             # equal shares: rank 0 of each layer first
    m.step_boundary(1)
    m.step_boundary(1)
    assert sum(len(lo.lent) for lo in m.layers) == 6 and all(cold_offsets_ok(lo) for lo in m.layers)
    m.apply([list(range(6))] * 4)                                # a new placement drops what was lent
    assert not any(lo.lent for lo in m.layers) and all(cold_offsets_ok(lo) for lo in m.layers)


def test_statistics_are_saved_at_close_and_read_back(tmp_path):
    f = tmp_path / "routing" / "model.json"
    m = _manager(n=2, stats_file=f)
    m.apply([[0], [0]])
    m.layers[1].layer.counts[3] += 9
    m.counters.tokens = 5
    m.close()
    stats, warning = RoutingStats.load(f, 2, E)
    assert warning is None and stats.counts[1, 3] == pytest.approx(9) and stats.counts.sum() == pytest.approx(9)
    f.write_text("{broken")
    stats, warning = RoutingStats.load(f, 2, E)
    assert stats is None and "Ignoring routing statistics" in warning


def test_offload_needs_host_codes():
    layer = random_layer(E, 64, 32, TOP_K, 4, "cpu")
    with pytest.raises(ValueError, match="not loaded into host memory"):
        OffloadManager([layer], MemoryBudget(1 << 30))


def test_prefill_scratch_estimate_grows_with_the_chunk_and_the_context():
    from types import SimpleNamespace
    from runtime.backends.gpu_offload import SCRATCH_MARGIN, prefill_scratch_bytes
    cfg = SimpleNamespace(max_input_len=2048, max_seq_len=8192, hidden_size=4096, vocab_size=151936,
                          num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                          num_experts_per_token=8, intermediate_size=1536)
    big = prefill_scratch_bytes(cfg)
    # q125-a11's chunk: MoE 453 MB (h, the inputs gathered per pair, the per-pair outputs), K/V expanded to
    # 64 heads over 8192 rows 268 MB, hidden 134 MB, attention output 67 MB, logits of 16 rows 10 MB: no
    # [2048, vocab] logits (prefill asks for one row)
    assert 0.88e9 < big - SCRATCH_MARGIN < 0.98e9
    assert prefill_scratch_bytes(cfg, matmul_attention=True) - big == 2 * 64 * 2048 * 8192 * 2
    cfg.max_seq_len = 4096
    assert prefill_scratch_bytes(cfg) == big - 2 * 64 * 4096 * 128 * 2
    cfg.max_input_len = 512
    assert prefill_scratch_bytes(cfg) < big
    cfg.num_key_value_heads = 64                                   # no GQA: nothing to expand
    assert prefill_scratch_bytes(cfg) < big - 2 * 64 * 4096 * 128 * 2


def test_host_arena_carves_stacks_from_few_blocks():
    from runtime.experts.pack import HostArena
    a = HostArena(block_bytes=1 << 16)
    x = a.empty((3, 100))                                        # 1200 bytes, rounded to 4096 in the block
    y = a.empty((10, 100))
    big = a.empty((40, 1000))                                    # 160 000 bytes: a block of its own (2**18)
    assert len(a.blocks) == 2 and a.reserved_bytes == (1 << 16) + (1 << 18)
    assert (y.data_ptr() - x.data_ptr()) == 4096 and y.data_ptr() % 4 == 0
    x.fill_(1), y.fill_(2), big.fill_(3)
    assert int(x.sum()) == 300 and int(y.sum()) == 2000 and int(big.sum()) == 120000
    with pytest.raises(ValueError):
        HostArena(3000)
    a.release()
    assert a.blocks == [] and int(x.sum()) == 300                # stacks keep their memory alive
