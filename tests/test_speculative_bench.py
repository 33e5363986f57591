"""The speculative benchmarks' bookkeeping, on a toy engine (the timings themselves are the benchmark's).

The toy engine routes every token to two of 16 experts per layer (a fixed function of the token) and
counts the choices the way the CUDA engine's MoE layers do; with `graphs` set, one-token forwards
take a separate "graph" path, as the CUDA engine's decode step does.
"""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine, ModelInfo
from bench import spec as bench, verify as bench_verify

E, TOP_K, LAYERS, V = 16, 2, 3, 50


class Experts:
    def __init__(self):
        self.counts = torch.zeros(E, dtype=torch.int32)


class Layer:
    def __init__(self):
        self.experts = Experts()


class RoutedEngine(Engine):
    backend = "cpu"

    def __init__(self, graphs: bool):
        self.info = ModelInfo(name="toy", path="", architecture="toy", vocab_size=V, context_length=256,
                              num_layers=LAYERS, num_experts=E, experts_per_token=TOP_K)
        self.moe = [Layer() for _ in range(LAYERS)]
        self.graphs = object() if graphs else None
        self.graph_steps = self.loop_forwards = 0
        self.length = 0

    def forward(self, tokens):
        if len(tokens) == 1 and self.graphs is not None:
            self.graph_steps += 1
        else:
            self.loop_forwards += 1
        for l, layer in enumerate(self.moe):
            for t in tokens:
                ids = torch.tensor([(3 * t + l) % E, (5 * t + l + 1) % E])
                layer.experts.counts.index_add_(0, ids, torch.ones(2, dtype=torch.int32))
        self.length += len(tokens)
        return torch.zeros(len(tokens), V)

    def truncate(self, length):
        assert 0 <= length <= self.length
        self.length = length

    @property
    def position(self):
        return self.length


@pytest.mark.parametrize("graphs", [True, False])
def test_verify_cost_reads_routing_and_both_baselines(graphs):
    eng = RoutedEngine(graphs)
    t = bench_verify.verify_cost(eng, context=8, k_max=4, repeats=2)
    assert [c.rows for c in t.costs] == [1, 2, 3, 4, 5]
    assert t.step_kind == ("cuda_graph" if graphs else "layer_loop")
    assert eng.graphs is not None if graphs else eng.graphs is None      # restored after the loop runs
    # per repeat (3 with the warm-up), 11 timed forwards (the step, the loop's row, K = 0..4, 4 repeated
    # tokens), each after an untimed one-row forward: the step, K = 0 and the 10 one-row forwards outside the
    # loop through the graph, the rest through the loop (after the prefill)
    assert eng.graph_steps == (3 * 12 if graphs else 0)
    assert eng.loop_forwards == 1 + 3 * (2 + 4 + 4) + (0 if graphs else 3 * 12)
    assert t.costs[0].experts == TOP_K                                     # one row: exactly top-k experts
    for c in t.costs[1:]:
        assert TOP_K <= c.experts <= min(E, c.rows * TOP_K)
        assert c.repeat_experts == TOP_K                                   # one token repeated: its experts only
        assert c.relative > 0 and c.relative_to_loop > 0 and c.repeat_seconds > 0
    assert eng.position == 8


def test_verify_cost_without_routing_has_no_expert_figures():
    eng = RoutedEngine(graphs=False)
    eng.moe = []
    t = bench_verify.verify_cost(eng, context=4, k_max=2, repeats=1)
    assert all(c.experts is None and c.repeat_seconds is None for c in t.costs)
    assert t.marginal_expert_s is None


def test_speedup_and_marginal_expert_cost():
    costs = [bench_verify.VerifyCost(0, 1, 1.0, 1.0, 0.5, 8.0),
             bench_verify.VerifyCost(1, 2, 2.0, 2.0, 1.0, 16.0, repeat_seconds=1.5, repeat_experts=8.0)]
    assert bench_verify.speedup_at(costs, 0.5, "step") == {1: pytest.approx(1.5 / 2.0)}
    assert bench_verify.speedup_at(costs, 0.5, "loop") == {1: pytest.approx(1.5 / 1.0)}
    assert bench_verify.marginal_expert_cost(costs) == pytest.approx(0.5 / 8.0)
    with pytest.raises(ValueError, match="baseline"):
        bench_verify.speedup_at(costs, 0.5, "graph")


def test_spread_and_criterion():
    s = bench.spread([1.0, 0.9, 0.97, 0.99, 1.02])
    assert s["median"] == 0.99 and s["min"] == 0.9 and s["max"] == 1.02 and s["n"] == 5
    assert s["q1"] <= s["median"] <= s["q3"]
    ok = bench.criterion(s, bench.spread([0.98, 0.99]))
    assert ok["passes"] and ok["conclusive"]
    assert not bench.criterion(bench.spread([0.9, 0.91, 0.92]), None)["passes"]
    wide = bench.criterion(bench.spread([0.8, 0.9, 1.0, 1.1]), None)
    assert not wide["conclusive"]
    with pytest.raises(ValueError):
        bench.spread([])


def test_lockstep_gives_every_mode_the_same_tokens_and_its_own_time():
    from runtime.options import DraftOptions
    engines = {"plain": RoutedEngine(False), "adaptive": RoutedEngine(False)}
    modes = {"plain": None, "adaptive": DraftOptions(mode="ngram", draft_tokens=4, adaptive=True)}
    runs = bench.lockstep(engines, modes, [1, 2, 3, 1, 2, 3], 20)
    assert runs["plain"].tokens == runs["adaptive"].tokens == [0] * 20    # the toy's argmax is token 0
    assert runs["plain"].steps == 20 and runs["plain"].draft is None
    assert runs["adaptive"].draft["mode"] == "ngram" and runs["adaptive"].steps <= 20
    assert all(r.wall_s > 0 and r.tps > 0 for r in runs.values())
    assert engines["plain"].position == 6 + 20 - 1                        # the generation loop's contract


def test_verify_result_records_the_engines_rollback_window():
    """Rows past a hybrid engine's rollback window run as a prompt's would: the result says where it lies."""
    eng = RoutedEngine(graphs=True)
    said = []
    eng.telemetry = lambda: {"rollback_window": 5}
    fields = bench_verify.verify_result(eng, context=8, forced=False, n_tokens=4, say=said.append)
    assert fields["bench"]["rollback_window"] == 5 and any("rollback window 5 rows" in s for s in said)
    assert bench_verify.verify_result(RoutedEngine(graphs=True), 8, False, 4, said.append)["bench"][
        "rollback_window"] is None


def test_verify_cost_times_rows_past_the_rollback_window_last():
    """A forward wider than a hybrid engine's rollback window replays the context at its truncate, which slows
    the forwards after it: the baselines and the rows within the window are all timed before any wider row."""
    eng = RoutedEngine(graphs=True)
    eng.telemetry = lambda: {"rollback_window": 3}
    sizes = []
    real_forward = eng.forward
    eng.forward = lambda tokens: (sizes.append(len(tokens)), real_forward(tokens))[1]
    t = bench_verify.verify_cost(eng, context=8, k_max=4, repeats=2)
    assert [c.rows for c in t.costs] == [1, 2, 3, 4, 5] and all(c.seconds > 0 for c in t.costs)
    assert all(c.repeat_seconds > 0 for c in t.costs[1:])
    sizes = sizes[1:]                                                        # the context's prefill
    first_wide = next(i for i, n in enumerate(sizes) if n > 3)
    assert max(i for i, n in enumerate(sizes) if 1 < n <= 3) < first_wide
    assert sorted(set(sizes[first_wide:])) == [1, 4, 5]                      # each still after a one-row forward
    # 3 repeats of each pass: the step, the loop's row, rows 1..3 (2 and 3 twice) in the first; rows 4, 5 twice
    assert len(sizes) == 2 * (3 * (2 + 1 + 2 * 2) + 3 * (2 * 2))
